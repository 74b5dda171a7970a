"""What crosses a node is a URI; each node makes its own local copy (docs/training.md).

The production cluster shares nothing but object storage, so roles hand each other URIs only
(`require_uri`: the guard every receiving role applies), and the role that needs files on disk
(an engine loading weights, a trainer reading its initial checkpoint, an eval engine) calls
`localize(uri)` on its own node. This module is the one place that decides:

- a `file://` URI is used in place: a file:// run root means one machine or a shared filesystem;
- anything else (`s3://`, `gs://`, ...) is downloaded into this node's cache
  (`$MILES_CACHE_DIR`, default `~/.cache/miles`) under `{kind}/{hash of the URI}/`, trusted only
  with its marker, re-fetched when missing (a deleted cache heals on next use), and each kind is
  pruned to its newest `keep` entries (by last use).

Every process on a node (trainer ranks, engines, eval engines) shares that cache:

- One download per node and URI: `localize` holds an exclusive flock(2) on `{entry}.lock` from
  checking the marker to publishing the copy; a second process waits there, then finds the marker.
- A copy is written into `.{entry}.partial-*` beside the entry, marker last, and published by one
  rename(2). A complete entry (one with its marker) is never changed, replaced or re-downloaded, so
  no reader sees a half-written copy.
- Each process keeps a shared flock on `{entry}.use` for the newest `KEEP[kind]` entries of each kind
  it localized (taken before the marker is checked, dropped when it localizes past them or exits),
  and `prune` removes an entry only when it gets that lock exclusively without waiting. So no entry
  a live process was handed, among the newest it asked for, is removed under it.
- The cache keeps only the versions in use: the entries some live process holds, plus the newest
  complete one of each kind (a retried pod or the next segment finds it); every other entry is
  pruned whenever a process localizes one. A process holds one pushed weight version and one eval
  snapshot (`KEEP`: what it loads next replaces what it served), up to 8 models. So a node holds at
  most the version its engines serve and the one being fetched (miles_core/prepare/disk.py counts
  them), not a fixed number of old ones.
- `claim` is the one way a complete entry changes: a weight version rebuilt from a delta takes its base's
  entry over only when it gets the entry's `.use` lock exclusively (no live process holds it), removes
  its marker first, moves its files into the new version and patches them there; the entry is gone after.
Not covered: a process still reading an entry after it has localized `KEEP[kind]` newer ones of that
kind, and a cache deleted by hand (the next `localize` downloads again).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from typing import Callable

from miles_core.storage import Store, normalize_uri

MARKER = ".miles-complete"
# how many of its newest entries of a kind one process holds (in use); prune keeps those and the newest
KEEP = {"weights": 1, "snapshots": 1, "models": 8}
# Copies started again when the node cache is deleted underneath one (a cleaner, an operator's rm -rf);
# each removal is an outside event, so a cleaner faster than every copy gets the error after these.
CACHE_REMOVED_RETRIES = 8
log = logging.getLogger(__name__)

# kind -> entry path -> the fd holding this process's shared lock on `{entry}.use`, oldest first
_HELD: dict[str, collections.OrderedDict[str, int]] = {}
_HELD_LOCK = threading.Lock()


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


def is_cache_entry(path: str) -> bool:
    """Whether `path` is in this node's cache (a copy `localize` made), not a directory it handed out in place."""
    root = os.path.abspath(node_cache_dir())
    return os.path.commonpath([root, os.path.abspath(path)]) == root


def localize(uri: str, kind: str = "models", *, required: str | None = None,
             build: Callable[[str], None] | None = None, identity: str = "") -> str:
    """A directory on this node holding the tree at `uri` (and, with `required`, that file in it).

    With `build`, the copy is not downloaded but made by `build(directory)` (into an empty directory,
    published as a download is; a file:// URI gets a cached copy too): how a weight version stored as a
    delta is rebuilt on the node (miles_core.storage.weight_versions). `identity` tells apart contents
    written at the same `uri` at different times (each its own entry): a weight version's seal token."""
    uri = normalize_uri(require_uri(uri, "uri"))
    if uri.startswith("file://") and build is None:
        path = uri[len("file://"):]
        if not os.path.isdir(path) or (required and not os.path.exists(os.path.join(path, required))):
            raise FileNotFoundError(f"{uri}: no such directory{f' with {required}' if required else ''}")
        return path
    dest = _entry(uri, kind, identity)
    for attempt in range(CACHE_REMOVED_RETRIES):  # the node cache may be cleaned under a copy: copy again
        try:
            return _cached(uri, dest, kind, required, build)
        except FileNotFoundError as e:
            log.info("%s: copy %d into the node cache failed (%s); copying again", uri, attempt + 1, e)
    return _cached(uri, dest, kind, required, build)  # also: a source without `required` says so here


def _cached(uri: str, dest: str, kind: str, required: str | None, build: Callable[[str], None] | None) -> str:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    use = _flock(dest + ".use", fcntl.LOCK_SH)  # before the marker is checked: prune now leaves dest alone
    try:
        if not _complete(dest):
            lock = _flock(dest + ".lock", fcntl.LOCK_EX)  # one download per node: the others wait here
            try:
                if not _complete(dest):
                    _download(Store(uri), dest, required, build)
            finally:
                os.close(lock)
        os.utime(dest)  # last use, for pruning
    except BaseException:
        os.close(use)
        raise
    _hold(kind, dest, use)
    prune(kind)
    return dest


def _complete(dest: str) -> bool:
    return os.path.exists(os.path.join(dest, MARKER))


def _download(src: Store, dest: str, required: str | None, build: Callable[[str], None] | None = None) -> None:
    keys = src.list("") if build is None else []  # a builder reads its source itself (and checked it)
    if build is None and required and required not in keys:
        raise FileNotFoundError(f"{src.uri()} has no {required}; it is incomplete")
    root, name = os.path.split(dest)
    os.makedirs(root, exist_ok=True)  # the cache may have been deleted since `_cached` made it
    tmp = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root)
    try:
        try:
            if build is not None:
                build(tmp)
            for key in keys:  # none with a builder
                out = _inside(tmp, key, src)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with open(out, "wb") as f:
                    f.write(src.get_bytes(key))
            open(os.path.join(tmp, MARKER), "wb").close()
        except Exception as e:
            if not os.path.isdir(tmp):  # the cache was cleaned under the copy (whatever the writer raised)
                raise FileNotFoundError(f"{tmp}: the node cache was removed during the copy") from e
            raise
        try:
            os.rename(tmp, dest)  # fails on a non-empty dest: a complete copy is never replaced
        except OSError:
            if _complete(dest):
                return  # published by another process (its lock file was deleted under us): use it
            shutil.rmtree(dest)  # a half copy (a crash, an older version): never handed to anyone
            os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once published


def _inside(root: str, key: str, src: Store) -> str:
    """The local path of listed `key` under `root`; HandoffError for a key that would escape it (an
    object store can hold a key such as `a/../../x`, or an absolute one)."""
    parts = key.split("/")
    if key.startswith("/") or any(p in ("..", "") for p in parts):
        raise HandoffError(f"{src.uri()} lists the key {key!r}, which would be written outside the local copy; "
                           "refusing to copy it")
    return os.path.join(root, *parts)


def _flock(path: str, op: int) -> int | None:
    """An fd of `path` (created if missing) holding flock `op`; None when `op` has LOCK_NB and another
    holds it. Locks again when `path` was removed or replaced while this waited (prune removes lock files)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, op)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _hold(kind: str, dest: str, fd: int) -> None:
    """Keep `fd`'s shared lock on `dest` while it is among this process's newest KEEP[kind] of `kind`."""
    with _HELD_LOCK:
        held = _HELD.setdefault(kind, collections.OrderedDict())
        stale = [held.pop(dest)] if dest in held else []
        held[dest] = fd
        while len(held) > max(1, KEEP.get(kind, 3)):
            stale.append(held.popitem(last=False)[1])
    for old in stale:
        os.close(old)


def prune(kind: str) -> None:
    """Keep the newest complete copy of `kind` and those a live process holds; drop the rest (a copy
    being downloaded or handed to a live process is held: see the module docstring)."""
    root = os.path.join(node_cache_dir(), kind)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    groups: dict[str, list[str]] = {}  # entry -> its directory, partial copies and lock files
    for n in names:
        groups.setdefault(n.lstrip(".").split(".", 1)[0], []).append(n)
    newest = sorted((e for e in groups if _complete(os.path.join(root, e))), key=lambda e: _mtime(root, e),
                    reverse=True)
    for entry in set(groups) - set(newest[:1]):
        try:
            fd = _flock(os.path.join(root, entry + ".use"), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            return  # the cache was deleted underneath
        if fd is None:
            continue  # in use
        try:
            for n in groups[entry]:
                path = os.path.join(root, n)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif n != entry + ".use":
                    _unlink(path)
            _unlink(os.path.join(root, entry + ".use"))  # last, still held: a waiter then locks a new file
        finally:
            os.close(fd)


def claim(entry: str) -> int | None:
    """Take the complete cache entry `entry` (a path `localize` returned) for the caller to reuse its files
    (a weight version rebuilt by patching its base's file in place instead of a copy of it): only when no
    other process holds it. This process's own hold on it is given up first; on success the marker is
    removed (nobody takes it for complete any more) and the fd of its exclusive `.use` lock is returned
    (hand it to `drop_claimed` once done), else None and the entry is left as it was."""
    kind = os.path.basename(os.path.dirname(entry))
    with _HELD_LOCK:
        mine = _HELD.get(kind, {}).pop(entry, None)
    if mine is not None:
        os.close(mine)
    try:
        fd = _flock(entry + ".use", fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return None
    if fd is None:
        return None
    if not _complete(entry):
        os.close(fd)
        return None
    _unlink(os.path.join(entry, MARKER))
    return fd


def drop_claimed(entry: str, fd: int) -> None:
    """Remove what is left of a claimed entry and its lock files, then release the claim."""
    try:
        shutil.rmtree(entry, ignore_errors=True)
        _unlink(entry + ".lock")
        _unlink(entry + ".use")  # last, still held: a waiter then locks a new file
    finally:
        os.close(fd)


def _mtime(root: str, entry: str) -> float:
    try:
        return os.path.getmtime(os.path.join(root, entry))
    except FileNotFoundError:
        return 0.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def cached(uri: str, kind: str, identity: str = "") -> str | None:
    """This node's complete cached copy of `uri` (a `localize` of it with this `identity` made it), or None;
    not held for the caller: a reader that finds it pruned underneath (FileNotFoundError) copies again."""
    dest = _entry(normalize_uri(uri), kind, identity)
    return dest if _complete(dest) else None


def _entry(uri: str, kind: str, identity: str = "") -> str:
    """The cache directory of (normalized) `uri` with that `identity`."""
    key = f"{uri}#{identity}" if identity else uri
    return os.path.join(node_cache_dir(), kind, hashlib.sha256(key.encode()).hexdigest()[:20])


def discard(uri: str, kind: str, identity: str = "") -> None:
    """Drop this node's cached copy of `uri` (a copy found damaged): moved aside, then deleted, so the next
    `localize` copies it again; a process still reading the old copy keeps its open files."""
    discard_entry(_entry(normalize_uri(uri), kind, identity))


def discard_entry(dest: str) -> None:
    """`discard` of the cache entry at `dest` (a path `localize` returned)."""
    aside = f"{os.path.dirname(dest)}/.{os.path.basename(dest)}.discarded-{os.getpid()}-{threading.get_ident()}"
    try:
        os.rename(dest, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)

