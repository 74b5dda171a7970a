"""What crosses a node is a URI; each node makes its own local copy (DESIGN §15).

The production cluster shares nothing but object storage, so roles hand each other URIs only
(`require_uri`: the guard every receiving role applies), and the role that needs files on disk
(an engine loading weights, a trainer reading its initial checkpoint, an eval engine) calls
`localize(uri)` on its own node. This module is the one place that decides:

- a `file://` URI is used in place: a file:// run root means one machine or a shared filesystem;
- anything else (`s3://`, `gs://`, ...) is downloaded into this node's cache
  (`$MILES_CACHE_DIR`, default `~/.cache/miles`) under `{kind}/{hash of the URI}/`, trusted only
  with its marker (written last), re-fetched when missing (a deleted cache heals on next use),
  and each kind is pruned to its newest `keep` entries (by last use).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from miles_core.storage import Store, normalize_uri

MARKER = ".miles-complete"
KEEP = {"weights": 3, "snapshots": 3, "models": 8}


class HandoffError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


def require_uri(value: str, what: str) -> str:
    """`value` if it is a URI; a local path handed across roles is refused (it names one node's disk)."""
    if not isinstance(value, str) or "://" not in value:
        raise HandoffError(f"{what}={value!r} is a local path; roles hand each other object-storage URIs "
                           "(file://, s3://, ...), since a local path exists only on the node that wrote it")
    return value


def node_cache_dir() -> str:
    return os.environ.get("MILES_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "miles")


def localize(uri: str, kind: str = "models", *, required: str | None = None) -> str:
    """A directory on this node holding the tree at `uri` (and, with `required`, that file in it)."""
    uri = normalize_uri(require_uri(uri, "uri"))
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        if not os.path.isdir(path) or (required and not os.path.exists(os.path.join(path, required))):
            raise FileNotFoundError(f"{uri}: no such directory{f' with {required}' if required else ''}")
        return path
    dest = os.path.join(node_cache_dir(), kind, hashlib.sha256(uri.encode()).hexdigest()[:20])
    for _ in range(2):  # the node cache may be cleaned underneath a copy: copy again
        try:
            return _cached(uri, dest, kind, required)
        except FileNotFoundError:
            pass
    return _cached(uri, dest, kind, required)  # also: a source without `required` says so here


def _cached(uri: str, dest: str, kind: str, required: str | None) -> str:
    if not os.path.exists(os.path.join(dest, MARKER)):
        _download(Store(uri), dest, required)
    os.utime(dest)  # last use, for pruning
    prune(kind, keep_also=dest)
    return dest


def _download(src: Store, dest: str, required: str | None) -> None:
    keys = src.list("")
    if required and required not in keys:
        raise FileNotFoundError(f"{src.uri()} has no {required}; it is incomplete")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(dest))
    try:
        for key in keys:
            out = _inside(tmp, key, src)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(src.get_bytes(key))
        open(os.path.join(tmp, MARKER), "wb").close()
        shutil.rmtree(dest, ignore_errors=True)  # a copy without its marker is not trusted
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(dest, MARKER)):
            raise
        # another process on this node finished the same copy first: use it


def _inside(root: str, key: str, src: Store) -> str:
    """The local path of listed `key` under `root`; HandoffError for a key that would escape it (an
    object store can hold a key such as `a/../../x`, or an absolute one)."""
    parts = key.split("/")
    if key.startswith("/") or any(p in ("..", "") for p in parts):
        raise HandoffError(f"{src.uri()} lists the key {key!r}, which would be written outside the local copy; "
                           "refusing to copy it")
    return os.path.join(root, *parts)


def prune(kind: str, keep_also: str | None = None) -> None:
    """Keep the newest KEEP[kind] complete copies of `kind` (and `keep_also`); drop the rest."""
    root = os.path.join(node_cache_dir(), kind)
    entries = [os.path.join(root, d) for d in os.listdir(root) if not d.startswith(".")] if os.path.isdir(root) else []
    entries.sort(key=lambda p: os.path.getmtime(p), reverse=True)
    for path in entries[KEEP.get(kind, 3):]:
        if path != keep_also:
            shutil.rmtree(path, ignore_errors=True)
