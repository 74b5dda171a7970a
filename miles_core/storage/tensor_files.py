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
from typing import TYPE_CHECKING

from miles_core.storage import TMP_MARK, Store, fsync_file

if TYPE_CHECKING:  # torch is imported where tensors are written: a process that only reads snapshot
    import torch  # names (the rollout manager) never pays its ~2 CPU-seconds import


def put_tensors(store: Store, key: str, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None, *, digest: bool = True) -> dict:
    """Commit `tensors` at `key`; returns {"size", "sha256"} of the committed bytes ({"size"} alone
    with `digest=False`)."""
    from safetensors.torch import save_file

    meta = {"format": "pt", **(metadata or {})}
    local = store.local_path(key)
    if local is not None:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = f"{local}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            save_file(tensors, tmp, metadata=meta)
            written = _file_digest(tmp) if digest else {"size": os.path.getsize(tmp)}
            fsync_file(tmp)
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return written
    with tempfile.TemporaryDirectory(prefix="miles-tensors-") as d:
        path = os.path.join(d, "t.safetensors")
        save_file(tensors, path, metadata=meta)
        written = _file_digest(path) if digest else {"size": os.path.getsize(path)}
        store.put_file(key, path)  # streamed from the file: never whole in memory
    return written


def _file_digest(path: str, chunk: int = 8 << 20) -> dict:
    """{"size", "sha256"} of a local file just written (read from the page cache)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}
