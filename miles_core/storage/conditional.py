"""Compare-and-swap on one small object in a Store: the primitive under the run-root lease (miles_core.storage.lease).

    obj = conditional_object(store, "LEASE.json")
    obj.read()                  -> (data, version), or None when there is no object
    obj.create(data)            -> version, or None when the object already exists
    obj.replace(data, version)  -> the new version, or None when the object is no longer at `version`

Of two contenders calling `create` (or `replace` from the same version) at most one gets a version.
How each backend does it:
- s3://     PutObject with `If-None-Match: *` (create) or `If-Match: <ETag>` (replace); the loser gets
            412 PreconditionFailed. AWS S3 and SeaweedFS (the test server, 4.x) honour both headers.
            Each bucket is probed once per process (two creates of a probe key; the second must fail):
            a server that ignores the headers gets the read-back fallback below and a warning.
- file://   create: link(2) of a complete, fsynced temporary, which fails with EEXIST atomically (the
            O_EXCL guarantee, also on NFS, and no reader ever sees a half-written object); replace:
            read, compare, rename under an exclusive flock(2) on `{key}.lock`, which the kernel drops
            when its holder dies. The directory is fsynced after each change.
- memory:// the same compare-and-swap under a process-wide lock (memory:// lives in one process).
- others (gs://, an S3 server without conditional writes): check, write, wait `settle_seconds`, read
            back and compare. This guarantees one winner only on a store with read-after-write
            consistency and only while no PUT takes longer than `settle_seconds` to land; a lease
            holder re-reads its record at every renewal, so an overlap is still found within one
            renewal interval and the loser stops writing.
A version is the ETag on S3 and a hash of the content elsewhere, so callers put a unique token in
what they write. The Store retries transient errors; since a retried conditional PUT can answer
412 although its first attempt landed, callers compare what they read back with what they wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
import uuid

from fsspec.asyn import sync

from miles_core.storage import TMP_MARK, ObjectNotFound, Store, fsync_dir, fsynced_temp

log = logging.getLogger(__name__)

_MEMORY_LOCK = threading.Lock()
_S3_PROBED: dict[str, bool] = {}


def content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class ConditionalObject:
    """Read through the Store; subclasses implement create and replace."""

    def __init__(self, store: Store, key: str):
        self.store, self.key = store, key

    def read(self) -> tuple[bytes, str] | None:
        try:
            data = self.store.get_bytes(self.key)
        except ObjectNotFound:
            return None
        return data, content_version(data)

    def create(self, data: bytes) -> str | None:
        raise NotImplementedError

    def replace(self, data: bytes, version: str) -> str | None:
        raise NotImplementedError


class LockedObject(ConditionalObject):
    """Compare-and-swap under a lock (`_lock`), for stores where one lock covers every contender."""

    def _lock(self):
        raise NotImplementedError

    def create(self, data: bytes) -> str | None:
        with self._lock():
            if self.read() is not None:
                return None
            self.store.put_bytes(self.key, data)
            return content_version(data)

    def replace(self, data: bytes, version: str) -> str | None:
        with self._lock():
            current = self.read()
            if current is None or current[1] != version:
                return None
            self.store.put_bytes(self.key, data)
            self._synced()
            return content_version(data)

    def _synced(self) -> None:
        pass


class MemoryObject(LockedObject):
    def _lock(self):
        return _MEMORY_LOCK


class FileObject(LockedObject):
    def create(self, data: bytes) -> str | None:
        path = self.store.path(self.key)
        tmp = fsynced_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        fsync_dir(os.path.dirname(path))
        self._synced()
        return content_version(data)

    @contextlib.contextmanager
    def _lock(self):
        path = self.store.path(self.key) + ".lock"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def _synced(self) -> None:
        fd = os.open(os.path.dirname(self.store.path(self.key)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ReadBackObject(ConditionalObject):
    """Write, wait, read back, compare: for stores without conditional writes (see the module doc)."""

    def __init__(self, store: Store, key: str, settle_seconds: float = 2.0):
        super().__init__(store, key)
        self.settle_seconds = settle_seconds

    def create(self, data: bytes) -> str | None:
        return None if self.read() is not None else self._write_and_confirm(data)

    def replace(self, data: bytes, version: str) -> str | None:
        current = self.read()
        if current is None or current[1] != version:
            return None
        return self._write_and_confirm(data)

    def _write_and_confirm(self, data: bytes) -> str | None:
        self.store.put_bytes(self.key, data)
        time.sleep(self.settle_seconds)
        current = self.read()
        return current[1] if current is not None and current[0] == data else None


class S3Object(ConditionalObject):
    """PutObject with If-None-Match / If-Match; the version is the ETag."""

    def __init__(self, store: Store, key: str):
        super().__init__(store, key)
        self.bucket, self.object_key, _ = store.fs.split_path(store.path(key))

    def read(self) -> tuple[bytes, str] | None:
        async def get():
            resp = await self.store.fs._call_s3("get_object", Bucket=self.bucket, Key=self.object_key)
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        def read_once():
            try:
                return sync(self.store.fs.loop, get)
            except FileNotFoundError:
                return None

        return self.store._retry(f"get {self.key}", read_once)

    def create(self, data: bytes) -> str | None:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: str) -> str | None:
        return self._put(data, IfMatch=version)

    def _put(self, data: bytes, **condition) -> str | None:
        def put_once():
            try:
                return self.put_once(data, **condition)
            except Exception as e:  # noqa: BLE001 - a lost race is an answer, not an error
                if precondition_failed(e):
                    return None
                raise

        return self.store._retry(f"conditional put {self.key}", put_once)

    def put_once(self, data: bytes, **condition) -> str:
        out = self.store.fs.call_s3("put_object", Bucket=self.bucket, Key=self.object_key, Body=data, **condition)
        return out["ETag"]

    def delete(self) -> None:
        self.store.delete(self.key)


def _client_error(e: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of a botocore ClientError in `e` or its cause; ("", 0) otherwise."""
    for x in (e, e.__cause__):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict) and "Error" in resp:
            return str(resp["Error"].get("Code", "")), int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return "", 0


def precondition_failed(e: BaseException) -> bool:
    """True for S3's answer to a conditional write that lost: 412, or 409 ConditionalRequestConflict."""
    if isinstance(e, FileExistsError):  # s3fs's translation of a 412 on If-None-Match
        return True
    code, status = _client_error(e)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412


def s3_honours_conditional_writes(obj: S3Object) -> bool:
    """Probe (once per endpoint, bucket and process): does a second If-None-Match create of a key fail?"""
    fs = obj.store.fs
    where = f"{getattr(fs, 'endpoint_url', None) or fs.client_kwargs.get('endpoint_url') or 'aws'}/{obj.bucket}"
    if where not in _S3_PROBED:
        _S3_PROBED[where] = obj.store._retry("probe conditional writes", lambda: _probe(obj))
        if not _S3_PROBED[where]:
            log.warning("S3 at %s ignores conditional writes (If-None-Match); the run-root lease falls back to "
                        "write-and-read-back, which is weaker (see miles_core.storage.conditional)", where)
    return _S3_PROBED[where]


def _probe(obj: S3Object) -> bool:
    probe = S3Object(obj.store, f"{obj.key}{TMP_MARK}probe-{uuid.uuid4().hex[:12]}")  # fresh per attempt
    try:
        try:
            probe.put_once(b"1", IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            code, status = _client_error(e)
            if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") or status in (400, 501):
                return False
            raise
        try:
            probe.put_once(b"2", IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            if precondition_failed(e):
                return True
            raise
        return False
    finally:
        probe.delete()


def conditional_object(store: Store, key: str) -> ConditionalObject:
    """The strongest compare-and-swap `store` offers for `key` (see the module doc)."""
    if store.protocol == "file":
        return FileObject(store, key)
    if store.protocol == "memory":
        return MemoryObject(store, key)
    if store.protocol in ("s3", "s3a"):
        obj = S3Object(store, key)
        return obj if s3_honours_conditional_writes(obj) else ReadBackObject(store, key)
    return ReadBackObject(store, key)
