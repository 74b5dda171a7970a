"""Object storage behind one small interface: fsspec URIs, atomic commits, sorted listing, retries.

A `Store` is rooted at a URI prefix (file://, s3://, gs://, memory://, or a local path) and speaks
in relative keys (`buffer/groups/w0/000000000001.arrow`). Rules (docs/quickstart.md#where-the-run-lives):
- an object is visible only when complete: local files go to a temporary name (fsynced) and are
  renamed, and the directory is fsynced after the rename and after creating a directory, so a
  commit survives a power loss;
  object stores get a single PUT (atomic there);
- listings are sorted, so zero-padded keys come back in step/sequence order from one listing;
- transient errors are retried with bounded exponential backoff (0.1 s doubling, jittered, never
  more than 4 s per wait) until a total deadline (`DEADLINE_SECONDS`, 60 s: a restarted or briefly
  unreachable S3 endpoint does not end a run) or the attempt limit; every retry is logged. When
  storage stays unreachable the caller gets StorageUnavailable naming the URI and the last cause
  (never the credentials).

A read-only tool that should give up sooner (the `miles` inspection commands) sets the deadline of
the Stores it opens, wherever they are built:

    with retry_deadline(5.0):      # Stores built inside, without their own deadline_seconds
        inspect_buffer(run_uri)
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import fsspec

log = logging.getLogger(__name__)
T = TypeVar("T")

TMP_MARK = ".tmp-"
# Written last into a directory of objects (a snapshot, an imported model): readers trust only a
# directory that has it (a half copy has not).
COMPLETE_MARKER = ".complete"
DEADLINE_SECONDS = 60.0  # how long a storage operation keeps retrying transient errors
# The default of Stores built without deadline_seconds; "bound": whether one data transfer (a get or a put)
# is cut at the deadline too (an interactive command's budget), not only listings and existence checks.
_deadline = {"seconds": DEADLINE_SECONDS, "bound": False}
_attempt = threading.local()  # .left: seconds the attempt in progress on this thread may take (None: unbounded)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}$")


class InvalidName(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


class StorageError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


class StorageUnavailable(StorageError):
    """Storage stayed unreachable through every retry."""


class ObjectNotFound(StorageError, FileNotFoundError):
    pass


class StorageNotConfigured(StorageError):
    """An object store was named that this machine cannot use: no credentials for it can be found, or the
    package its scheme needs is not installed (a configuration error, never retried)."""


# What to set, by scheme: the one place the hints of the storage errors come from.
CREDENTIALS_HINT = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or ~/.aws/credentials); with an "
          "S3-compatible endpoint also MILES_S3_ENDPOINT_URL",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file), or run "
          "`gcloud auth application-default login`, or run on GCE/GKE with a service account",
}
ENDPOINT_HINT = {
    "s3": "the endpoint (MILES_S3_ENDPOINT_URL / AWS_ENDPOINT_URL), network and credentials (AWS_ACCESS_KEY_ID, "
          "AWS_SECRET_ACCESS_KEY)",
    "gs": "the network path to storage.googleapis.com (or STORAGE_EMULATOR_HOST) and the credentials "
          "(GOOGLE_APPLICATION_CREDENTIALS)",
}
_PACKAGE = {"s3": "s3fs", "gs": "gcsfs"}


def validate_name(name: str, what: str = "name") -> str:
    """Run ids, dataset names, writer ids: one path segment, no '..', '/', control characters."""
    if not isinstance(name, str) or not name:
        raise InvalidName(f"{what}: empty name; use letters, digits, '.', '_', '-', '=', '+'.")
    bad = [c for c in name if ord(c) < 32 or ord(c) == 127]
    if bad:
        raise InvalidName(f"{what}={name!r}: control characters are not allowed.")
    if "/" in name or "\\" in name:
        raise InvalidName(f"{what}={name!r}: '/' is not allowed (a name is one path segment).")
    if ".." in name:
        raise InvalidName(f"{what}={name!r}: '..' is not allowed.")
    if not _NAME_RE.match(name):
        raise InvalidName(
            f"{what}={name!r}: use 1-128 of letters, digits, '.', '_', '-', '=', '+', starting with a letter or digit."
        )
    return name


def fsync_dir(path: str) -> None:
    """Make the entries of directory `path` durable (a rename or a new file is in the directory,
    not the file: without this a power loss can undo a commit whose data was fsynced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Make the bytes of the file at `path`, just written, durable before it is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """`os.makedirs`, then fsync the parent of every directory it created."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        os.makedirs(d, exist_ok=True)
        fsync_dir(os.path.dirname(d) or ".")


def replace_durable(src: str, dst: str) -> None:
    """`os.replace` followed by an fsync of the destination directory."""
    os.replace(src, dst)
    fsync_dir(os.path.dirname(dst) or ".")


def fsynced_temp(path: str, data: bytes) -> str:
    """`data` in a fresh, fsynced temporary file beside `path` (its parents created durably); its name."""
    makedirs_durable(os.path.dirname(path))
    tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def normalize_uri(uri: str) -> str:
    """A local path becomes an absolute file:// URI; URIs with a scheme pass through."""
    if "://" in uri:
        return uri.rstrip("/")
    return "file://" + str(Path(uri).expanduser().resolve())


def run_root_uri(storage_root: str, run_id: str) -> str:
    validate_name(run_id, "--run-id")
    return f"{normalize_uri(storage_root)}/runs/{run_id}"


def _redact(text: str) -> str:
    # key/secret/token/password, and the credential and signature of presigned URLs (X-Amz-Credential=...).
    return re.sub(r"(?i)(secret|key|token|password|credential|signature)=([^&\s]+)", r"\1=***", text)


def is_transient(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    name = type(e).__name__
    if any(s in name for s in ("Connect", "Timeout", "Throttl", "SlowDown", "ServiceUnavailable", "TransportError")):
        return True
    if isinstance(e, OSError):
        # s3fs maps 5xx and connection failures to plain OSError; 4xx map to the specific classes above.
        return True
    return False


@contextlib.contextmanager
def retry_deadline(seconds: float) -> Iterator[None]:
    """Stores built inside (without their own `deadline_seconds`) stop retrying after `seconds`."""
    before = dict(_deadline)
    _deadline.update(seconds=float(seconds), bound=True)
    try:
        yield
    finally:
        _deadline.update(before)


def _gcs_credentials_missing(opts: dict) -> bool:
    """True when gcsfs would find no credentials: no token given, no GOOGLE_APPLICATION_CREDENTIALS, no
    gcloud application-default file, not on Google Compute Engine (decided offline, from the machine's
    DMI product name, as google-auth does, instead of probing a metadata server that may never answer)."""
    if opts.get("token") is not None or os.environ.get("STORAGE_EMULATOR_HOST") or os.environ.get("GCE_METADATA_HOST"):
        return False
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key:
        if not os.path.isfile(key):
            raise StorageNotConfigured(f"GOOGLE_APPLICATION_CREDENTIALS={key} is not a file; point it at a "
                                     "service-account key file.")
        return False
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
    if os.path.isfile(os.path.join(config, "application_default_credentials.json")):
        return False
    try:
        with open("/sys/class/dmi/id/product_name") as f:
            return not f.read().startswith("Google")
    except OSError:
        return True


_S3_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                      "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
_s3_sessions: dict[tuple, Any] = {}
_s3_sessions_lock = threading.Lock()


def _s3_session():
    """One aiobotocore session per process and credential environment, shared by every S3 Store. Each Store
    still has its own filesystem and client (no state crosses Stores), but a client made from a new session
    parses botocore's S3 service model and endpoint rules again (JSON of several MB): 0.06-0.35 CPU-s per
    Store measured, several times that on a loaded node, against 0.006 from a shared one. Stores are made
    per call in many places (a version's localize, the feed, heartbeats), so this was a run's largest
    storage cost on CPU."""
    import aiobotocore.session

    key = tuple(os.environ.get(k) for k in _S3_CREDENTIAL_ENV)
    with _s3_sessions_lock:
        if key not in _s3_sessions:
            _s3_sessions[key] = aiobotocore.session.AioSession()
        return _s3_sessions[key]


# (pid, options) -> the S3 filesystem every Store of this process with those options uses
_s3_filesystems: dict[tuple, Any] = {}
_s3_filesystems_lock = threading.Lock()


def _shared_s3_fs(root_uri: str, opts: dict) -> tuple[Any, str]:
    """(filesystem, root path) of `root_uri` on S3, the filesystem shared by every Store of this process made
    with the same options (the endpoint and the credential environment are among them: `_s3_session`). Its
    client is made at its first request, with a connection pool, and that costs: measured on SeaweedFS over
    loopback, a Store's first GET took 60-70 ms against 4-6 ms for its next, and a weight version's update
    made several Stores (each a first request). s3fs runs every call on fsspec's one I/O loop, so the
    filesystem serves any thread; a forked child makes its own. fsspec's own instance cache stays off
    (`skip_instance_cache`): it keys on the calling thread, so every thread would build its own client."""
    key = (os.getpid(), repr(sorted(opts.items())))
    with _s3_filesystems_lock:
        fs = _s3_filesystems.get(key)
        if fs is None:
            fs, root = fsspec.core.url_to_fs(root_uri, **opts)
            _s3_filesystems[key] = fs
            return fs, root
    return fs, fs._strip_protocol(root_uri)


class Store:
    def __init__(self, root_uri: str, *, retries: int = 40, backoff_seconds: float = 0.1,
                 max_backoff_seconds: float = 4.0, deadline_seconds: float | None = None,
                 storage_options: dict | None = None):
        self.root_uri = normalize_uri(root_uri)
        protocol = self.root_uri.split("://", 1)[0]
        opts = dict(storage_options or {})
        if protocol == "gs":
            if _gcs_credentials_missing(opts):
                raise StorageNotConfigured(f"no credentials for {self.root_uri}: set {CREDENTIALS_HINT['gs']}.")
            # gcsfs logs every failed request with its traceback; the StorageUnavailable below says it once.
            if logging.getLogger("gcsfs").level == logging.NOTSET:
                logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
        if protocol == "s3":
            # Fail fast inside one attempt; our own loop does the retrying with backoff.
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("config_kwargs", {"connect_timeout": 3, "read_timeout": 30,
                                              "retries": {"max_attempts": 1},
                                              "max_pool_connections": 64})  # the process's Stores share it
            opts.setdefault("skip_instance_cache", True)
            opts.setdefault("session", _s3_session())
            endpoint = os.environ.get("MILES_S3_ENDPOINT_URL")
            if endpoint:
                opts.setdefault("endpoint_url", endpoint)
        try:
            if protocol == "s3":
                self.fs, self.root = _shared_s3_fs(self.root_uri, opts)
            else:
                self.fs, self.root = fsspec.core.url_to_fs(self.root_uri, **opts)
        except ImportError as e:
            package = _PACKAGE.get(protocol, f"the fsspec implementation of {protocol}://")
            raise StorageNotConfigured(f"{self.root_uri}: {protocol}:// storage needs the Python package {package}, "
                               f"which is not installed ({e}); pip install {package}.") from e
        self.protocol = protocol
        self.bound = _deadline["bound"]
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.deadline_seconds = _deadline["seconds"] if deadline_seconds is None else deadline_seconds

    def __repr__(self) -> str:
        return f"Store({self.root_uri!r})"

    # ------------------------------------------------------------------ paths

    def path(self, key: str) -> str:
        key = key.strip("/")
        if any(part == ".." for part in key.split("/")):
            raise InvalidName(f"storage key {key!r}: '..' is not allowed.")
        return f"{self.root}/{key}" if key else self.root

    def uri(self, key: str = "") -> str:
        return f"{self.root_uri}/{key.strip('/')}" if key else self.root_uri

    def child(self, prefix: str) -> "Store":
        s = object.__new__(Store)
        s.__dict__.update(self.__dict__)
        s.root_uri = self.uri(prefix)
        s.root = self.path(prefix)
        return s

    # ------------------------------------------------------------------ retry

    def _call(self, name: str, *args, transfer: bool = False, **kwargs):
        """`self.fs.name(*args, **kwargs)`; on an asynchronous filesystem (s3fs, gcsfs) one attempt is cut at
        what is left of the deadline, so neither a client's own retries, a credential chain probing a
        metadata server, nor a name lookup that never answers outlasts it. A data transfer is cut only
        under `retry_deadline` (a long upload in a run may rightly take longer than the deadline)."""
        left = getattr(_attempt, "left", None)
        if left is not None and getattr(self.fs, "async_impl", False) and (self.bound or not transfer):
            kwargs["timeout"] = max(left, 0.1)
        return getattr(self.fs, name)(*args, **kwargs)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`, retrying transient errors until `retries` or `deadline_seconds` (whichever comes first)."""
        delay, start = self.backoff_seconds, time.monotonic()
        for attempt in range(self.retries + 1):
            outer = getattr(_attempt, "left", None)
            _attempt.left = self.deadline_seconds - (time.monotonic() - start)
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e):
                    raise
                elapsed = time.monotonic() - start
                wait = min(delay * (0.5 + random.random()), self.max_backoff_seconds)  # the cap holds jittered too
                if attempt == self.retries or elapsed + wait > self.deadline_seconds:
                    cause = f"{type(e).__name__}: {_redact(str(e))[:300]}" if str(e) else type(e).__name__
                    raise StorageUnavailable(
                        f"storage at {self.root_uri} unreachable: {what} failed {attempt + 1} times over "
                        f"{elapsed:.1f} s; last error: {cause}. Check "
                        f"{ENDPOINT_HINT.get(self.protocol, 'the path and the network')}."
                    ) from e
                log.warning("storage %s: %s failed (%s), retry %d in %.2fs (%.1f s of %.0f s spent)", self.root_uri,
                            what, type(e).__name__, attempt + 1, wait, elapsed, self.deadline_seconds)
                time.sleep(wait)
                delay = min(delay * 2, self.max_backoff_seconds)
            finally:
                _attempt.left = outer
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ objects

    def put_bytes(self, key: str, data: bytes) -> None:
        """Commit `data` at `key` atomically: readers see the whole object or none."""
        path = self.path(key)
        if self.protocol == "file":
            def write():
                replace_durable(fsynced_temp(path, data), path)
            self._retry(f"put {key}", write)
        else:
            self._retry(f"put {key}", lambda: self._call("pipe_file", path, data, transfer=True))

    def put_file(self, key: str, local: str) -> None:
        """Commit the local file `local` at `key` atomically, streamed: never read whole into memory
        (an optimizer-state file of a checkpoint is tens of GB). On an object store one upload (s3fs and
        gcsfs send a large file in parts and complete it as one object); on file:// a copy beside the
        target, fsynced and renamed into place."""
        path = self.path(key)
        if self.protocol == "file":
            def write():
                makedirs_durable(os.path.dirname(path))
                tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
                try:
                    shutil.copyfile(local, tmp)
                    fsync_file(tmp)
                    replace_durable(tmp, path)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            self._retry(f"put {key}", write)
        else:
            self._retry(f"put {key}", lambda: self._call("put_file", local, path, transfer=True))

    def get_bytes(self, key: str) -> bytes:
        path = self.path(key)

        def read():
            try:
                return self._call("cat_file", path, transfer=True)
            except FileNotFoundError as e:
                raise ObjectNotFound(f"no object {self.uri(key)}") from e

        return self._retry(f"get {key}", read)

    def put_json(self, key: str, obj: Any) -> None:
        self.put_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        raw = self.get_bytes(key)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise StorageError(f"{self.uri(key)} is not valid JSON: {e}") from e

    def exists(self, key: str) -> bool:
        path = self.path(key)

        def check():
            self._invalidate(path)
            return self._call("exists", path)

        return self._retry(f"exists {key}", check)

    def size(self, key: str) -> int:
        def size():
            try:
                return int(self._call("size", self.path(key)))
            except FileNotFoundError as e:
                raise ObjectNotFound(f"no object {self.uri(key)}") from e

        return self._retry(f"size {key}", size)

    def list(self, prefix: str = "") -> list[str]:
        """Keys (relative to the root) of all committed objects under `prefix`, sorted."""
        return list(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """{key: size} of all committed objects under `prefix`, sorted by key."""
        sizes = {}
        for p, info in self._find(prefix, "list").items():
            # Filer-backed S3 servers (SeaweedFS) keep emptied "directories"; s3fs then reports the
            # prefix itself as a directory entry. It is not an object, so it is never a key.
            if info.get("type") == "directory":
                continue
            rel = self._relative(p)
            if rel:
                sizes[rel] = int(info.get("size") or 0)
        return dict(sorted(sizes.items()))

    def list_temporaries(self, prefix: str = "") -> dict[str, dict]:
        """{key: {"size", "modified"}} of the temporaries of unfinished writes under `prefix` (names holding
        TMP_MARK, which `list` hides): on file:// what a commit writes before its rename, left by a crash
        between the two; on object stores a conditional-write probe a crash left. `modified` is Unix
        seconds, None when the store does not say. Sorted by key."""
        root = self.root.rstrip("/") + "/"
        out = {}
        for p, info in self._find(prefix, "list temporaries").items():
            p = p if p.startswith(root) or not ("/" + p).startswith(root) else "/" + p
            if info.get("type") == "directory" or not p.startswith(root) or TMP_MARK not in p.rsplit("/", 1)[-1]:
                continue
            out[p[len(root):]] = {"size": int(info.get("size") or 0), "modified": _modified(info)}
        return dict(sorted(out.items()))

    def _find(self, prefix: str, what: str) -> dict[str, dict]:
        """{path: info} of everything under `prefix`, fresh (the listing cache dropped), with retries."""
        base = self.path(prefix)

        def find():
            self._invalidate(base)
            try:
                return self._call("find", base, detail=True)
            except FileNotFoundError:
                return {}

        return self._retry(f"{what} {prefix!r}", find)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:  # `list` here is the method above
        """Names of the "directories" directly under `prefix` (one level, sorted): e.g. the run ids
        under `runs/`, without listing what each holds."""
        base = self.path(prefix)

        def ls():
            self._invalidate(base)
            try:
                return self._call("ls", base, detail=True)
            except FileNotFoundError:
                return []

        entries = self._retry(f"list dirs {prefix!r}", ls)
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"}
        return sorted(n for n in names if n and TMP_MARK not in n)

    def delete(self, key: str, missing_ok: bool = True) -> None:
        path = self.path(key)

        def rm():
            try:
                self._call("rm_file", path)
            except FileNotFoundError as e:
                if not missing_ok:
                    raise ObjectNotFound(f"no object {self.uri(key)}") from e

        self._retry(f"delete {key}", rm)

    def delete_prefix(self, prefix: str) -> None:
        for key in reversed(self.list(prefix)):
            self.delete(key)
        if self.protocol == "file":
            shutil.rmtree(self.path(prefix), ignore_errors=True)

    def move(self, src: str, dst: str) -> None:
        """Copy then delete (on object stores a rename is not atomic; the copy is a single PUT)."""
        if self.protocol == "file":
            def mv():
                makedirs_durable(os.path.dirname(self.path(dst)))
                try:
                    replace_durable(self.path(src), self.path(dst))
                except FileNotFoundError as e:  # the same error type as get_bytes on every backend
                    raise ObjectNotFound(f"no object {self.uri(src)}") from e
            self._retry(f"move {src}", mv)
            return
        self.put_bytes(dst, self.get_bytes(src))
        self.delete(src)

    def local_path(self, key: str = "") -> str | None:
        """The filesystem path for file:// stores (None elsewhere): lets readers mmap, tools open."""
        return self.path(key) if self.protocol == "file" else None

    def _relative(self, path: str) -> str | None:
        """fsspec path -> key relative to the root; None for temporaries of unfinished writes."""
        root = self.root.rstrip("/") + "/"
        if not path.startswith(root):
            path = "/" + path if ("/" + path).startswith(root) else path
        rel = path[len(root):] if path.startswith(root) else None
        if rel is None or TMP_MARK in rel.rsplit("/", 1)[-1]:
            return None
        return rel

    def _invalidate(self, path: str) -> None:
        inv = getattr(self.fs, "invalidate_cache", None)
        if inv is not None:
            try:
                inv(path)
            except Exception:  # noqa: BLE001 - cache invalidation is best effort
                pass


def _modified(info: dict) -> float | None:
    """An fsspec listing entry's modification time in Unix seconds (local: mtime; S3: LastModified)."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
