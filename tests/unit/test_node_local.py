"""The one place that decides what crosses a node (miles_core.storage.node_local).

Pins: a local path handed to a role is refused with an error naming it; file:// URIs are used in
place; object-store URIs are copied into this node's cache, trusted only with their marker,
re-fetched after the cache is deleted, and pruned to the newest copies per kind; a source without
its required marker is refused.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from miles_core.storage import Store, node_local
from miles_core.storage.node_local import HandoffError, localize, require_uri


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _snapshot(name: str) -> str:
    store = Store(f"memory://node-local-{uuid.uuid4().hex[:8]}/{name}")
    store.put_bytes("config.json", b"{}")
    store.put_bytes("sub/tokenizer.json", b"tok")
    store.put_bytes(".complete", b"")
    return store.uri()


def test_local_paths_are_refused_by_name():
    with pytest.raises(HandoffError, match="engine-0 model='/tmp/x' is a local path"):
        require_uri("/tmp/x", "engine-0 model")
    assert require_uri("s3://b/k", "x") == "s3://b/k"


def test_file_uris_are_used_in_place(tmp_path, cache):
    (tmp_path / "m").mkdir()
    assert localize(f"file://{tmp_path}/m") == str(tmp_path / "m")
    with pytest.raises(FileNotFoundError):
        localize(f"file://{tmp_path}/missing")
    assert not cache.exists()


def test_object_store_copies_are_cached_healed_and_pruned(cache, monkeypatch):
    uri = _snapshot("a")
    path = localize(uri, "weights", required=".complete")
    assert path.startswith(str(cache)) and open(os.path.join(path, "sub", "tokenizer.json")).read() == "tok"
    assert localize(uri, "weights") == path  # cached
    shutil.rmtree(cache)  # the node cache cleaned under a running role
    assert localize(uri, "weights") == path and os.path.exists(os.path.join(path, "config.json"))
    monkeypatch.setitem(node_local.KEEP, "weights", 2)
    for name in "bcd":
        localize(_snapshot(name), "weights")
    kept = sorted(p.name for p in (cache / "weights").iterdir() if p.is_dir())
    assert len(kept) == 2  # and only their lock files are left beside them
    assert sorted(p.name for p in (cache / "weights").iterdir() if not p.is_dir()) == \
        sorted(f"{e}{s}" for e in kept for s in (".lock", ".use"))


def test_a_source_without_its_marker_is_refused(cache):
    store = Store(f"memory://node-local-{uuid.uuid4().hex[:8]}/partial")
    store.put_bytes("model.safetensors", b"half")
    with pytest.raises(FileNotFoundError, match=r"\.complete"):
        localize(store.uri(), "weights", required=".complete")


def test_the_cache_keeps_only_the_versions_in_use_and_the_newest(cache):
    """Pins: pushed weights and eval snapshots are kept while a live process holds them (an engine its
    current version, another process on the node its own), plus the newest; every other copy is pruned
    as soon as a newer one is localized. Guards: three versions of a 16 GB model kept per node whether
    anyone reads them or not (the pod evicted for disk)."""
    import fcntl

    for kind in ("weights", "snapshots"):
        held = localize(_snapshot("held"), kind)
        other = os.open(held + ".use", os.O_RDWR)  # another process on the node still reads this copy
        fcntl.flock(other, fcntl.LOCK_SH)
        try:
            paths = [localize(_snapshot(name), kind) for name in ("v1", "v2", "v3")]
            kept = {str(p) for p in (cache / kind).iterdir() if p.is_dir()}
            assert kept == {held, paths[-1]}, f"{kind}: kept {len(kept)} copies, not the held one and the newest"
        finally:
            os.close(other)
        node_local.prune(kind)  # its holder is gone: the newest alone is left
        assert {str(p) for p in (cache / kind).iterdir() if p.is_dir()} == {paths[-1]}
