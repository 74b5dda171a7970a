"""Commit a dict of tensors as one safetensors object in a Store, without an in-memory copy.

`safetensors.torch.save` (to bytes) is several times slower than `save_file` for large models
(measured: 4-5 s vs 2.6 s for 513 MiB on this machine's CPU), so tensors are always written with
`save_file` to a temporary file: on a file:// store next to the target (hidden from listings by
the Store's temporary-name rule), fsynced and renamed into place; on object stores from a local
temporary file (under TMPDIR: the node-local disk in a pod) in one upload streamed from it
(`Store.put_file`), so a file of tens of GB never sits in memory. Readers get the whole object or
none either way.
It returns the committed object's size and sha256 (a checkpoint's COMPLETE lists them): hashed from
the local temporary file before it is committed, so the store is never read back. A caller that does
not list the digest (a weight snapshot: its `.complete` marker is its proof) passes `digest=False`
and the bytes are written once and never read again here (hashing 513 MiB costs ~0.4 s).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from typing import TYPE_CHECKING, Callable

from miles_core.storage import TMP_MARK, Store, fsync_file

if TYPE_CHECKING:  # torch is imported where tensors are written: a process that only reads snapshot
    import torch  # names (the rollout manager) never pays its ~2 CPU-seconds import


def put_tensors(store: Store, key: str, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None, *, digest: bool = True) -> dict:
    """Commit `tensors` at `key`; returns {"size", "sha256"} of the committed bytes ({"size"} alone
    with `digest=False`)."""
    from safetensors.torch import save_file

    meta = {"format": "pt", **(metadata or {})}
    return _commit(store, key, lambda path: save_file(tensors, path, metadata=meta), digest=digest)


def _file_digest(path: str, chunk: int = 8 << 20) -> dict:
    """{"size", "sha256"} of a local file just written (read from the page cache)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def put_streamed(store: Store, key: str, layout: list[tuple[str, list[int], str, int]],
                 produce: Callable[[str], torch.Tensor], metadata: Callable[[], dict[str, str]],
                 planned_metadata: dict[str, str]) -> int:
    """Commit, as one safetensors object at `key`, the tensor `produce(name)` makes for each `(name, shape,
    safetensors dtype, bytes)` of `layout`, in that order, each made while the one before is written (a
    cast to the published dtype overlaps the write); returns the object's size. The header is written
    first from the layout with `planned_metadata` and replaced at the end by `metadata()` (taken once
    every tensor was made: checksums of what was written), which must be as long (a checksum per tensor
    is a fixed-length string): ValueError otherwise, and for a tensor not as laid out. Committed as
    `put_tensors` commits."""
    import json
    import queue
    import struct
    import threading

    specs, offset = {}, 0
    for name, shape, dtype, nbytes in layout:
        specs[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes

    def header(meta: dict[str, str]) -> bytes:
        body = json.dumps({"__metadata__": {"format": "pt", **meta}, **specs}, separators=(",", ":")).encode()
        return body + b" " * (-len(body) % 8)

    planned = header(planned_metadata)

    def write(path: str) -> None:
        import torch

        made: queue.Queue = queue.Queue(maxsize=2)
        failure: list[BaseException] = []

        def writer() -> None:
            try:
                with open(path, "wb") as f:
                    f.write(struct.pack("<Q", len(planned)) + planned)
                    while (t := made.get()) is not None:
                        f.write(t.reshape(-1).view(torch.uint8).numpy())
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                failure.append(e)
                while made.get() is not None:  # drain: the producer never blocks on a dead writer
                    pass

        thread = threading.Thread(target=writer, name="put-streamed", daemon=True)
        thread.start()
        try:
            for name, shape, _, nbytes in layout:
                if failure:
                    break
                t = produce(name).contiguous()
                if list(t.shape) != list(shape) or t.nbytes != nbytes:
                    raise ValueError(f"{name}: made {list(t.shape)} ({t.nbytes} bytes), laid out as "
                                     f"{list(shape)} ({nbytes} bytes)")
                made.put(t)
        finally:
            made.put(None)
            thread.join()
        if failure:
            raise failure[0]
        final = header(metadata())
        if len(final) != len(planned):
            raise ValueError("the header's metadata is not as long as planned: the layout cannot hold it")
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(final)

    return _commit(store, key, write)["size"]


def _commit(store: Store, key: str, write: Callable[[str], None], *, digest: bool = False) -> dict:
    """`write(path)` a new local file and commit it at `key` (see the module doc): {"size"} of the
    committed bytes, and "sha256" with `digest`."""
    local = store.local_path(key)
    if local is not None:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = f"{local}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            write(tmp)
            written = _file_digest(tmp) if digest else {"size": os.path.getsize(tmp)}
            fsync_file(tmp)
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return written
    with tempfile.TemporaryDirectory(prefix="miles-tensors-") as d:
        path = os.path.join(d, "t.safetensors")
        write(path)
        written = _file_digest(path) if digest else {"size": os.path.getsize(path)}
        store.put_file(key, path)  # streamed from the file: never whole in memory
    return written
