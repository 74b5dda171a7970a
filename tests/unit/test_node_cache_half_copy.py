"""A half copy in the node cache is not trusted (miles_core.storage.node_local.localize, docs/training.md).

A node-cache entry is trusted only with its completion marker (`node_local.MARKER`, written last).
A copy interrupted before the marker (a killed process, a full disk, a copy left by an older
version) leaves the directory in place with partial content.

Pins: when the entry's directory exists with truncated and missing files and a leftover file, but
no marker, the next `localize` downloads again and returns the same path holding exactly the
source's content plus the marker; the copy after it is served from the cache (the source is not
read again).

Guards: trusting the directory's existence instead of its marker (serving the half copy), and
re-downloading without clearing the half copy first (the new copy then fails to move into place,
or keeps the broken copy's leftovers).
"""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from miles_core.storage import Store, node_local
from miles_core.storage.node_local import MARKER, localize
from tests.support.timeouts import WAIT_SECONDS

NOTE_WAITS_SECONDS = 10  # how long the note may take before the test calls it waiting on the restart

CONTENT = {"config.json": b'{"hidden_size": 64}', "sub/tokenizer.json": b"tok" * 100,
           "model.safetensors": b"w" * 4096}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = open(p, "rb").read()
    return out


def test_a_half_copy_without_its_marker_is_downloaded_again(cache, monkeypatch):
    """Pins: no marker -> re-download and the complete content; guards against trusting a
    half-copied cache directory by its existence."""
    store = Store(f"memory://node-cache-{uuid.uuid4().hex[:8]}/model")
    for key, data in CONTENT.items():
        store.put_bytes(key, data)
    uri = store.uri()

    # where localize keeps this URI (its documented layout: {cache}/{kind}/{hash of the URI})
    dest = cache / "models" / hashlib.sha256(uri.encode()).hexdigest()[:20]
    dest.mkdir(parents=True)
    (dest / "config.json").write_bytes(CONTENT["config.json"][:5])  # truncated mid-write
    (dest / "stale.bin").write_bytes(b"left by the broken copy")  # sub/ and the weights never arrived
    assert not (dest / MARKER).exists()

    reads = []
    get_bytes = Store.get_bytes
    monkeypatch.setattr(Store, "get_bytes", lambda self, key: reads.append(key) or get_bytes(self, key))

    path = localize(uri, "models")
    assert path == str(dest)
    assert sorted(reads) == sorted(CONTENT), "the half copy was trusted: nothing was downloaded"
    assert _tree(path) == {**CONTENT, MARKER: b""}  # complete, and nothing of the half copy left

    reads.clear()
    assert localize(uri, "models") == path and reads == []  # complete now: served from the cache
    assert node_local.node_cache_dir() == str(cache)


def test_a_cache_removed_during_a_build_is_built_again(cache):
    """Pins: the node cache deleted while a build writes into it (an operator's clean-up, an evicted
    host path) makes `localize` build again, whatever error the writer raised (safetensors raises its
    own, not FileNotFoundError); guards against failing the load on the first clean-ups (a cleaner every
    3 s beside builds that take seconds under load removed three in a row on CI), and against retrying
    for ever under a cleaner faster than every copy."""
    import shutil

    calls = []

    def build(tmp: str) -> None:
        calls.append(tmp)
        if len(calls) <= 5:
            shutil.rmtree(cache / "weights")  # the partial copy's directory goes with it
            raise RuntimeError("Error while serializing: I/O error: No such file or directory")
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(b"w")

    path = localize(f"memory://node-cache-{uuid.uuid4().hex[:8]}/v1", "weights", build=build)
    assert len(calls) == 6 and open(os.path.join(path, "model.safetensors"), "rb").read() == b"w"
    assert os.path.exists(os.path.join(path, MARKER))

    def never(tmp: str) -> None:
        calls.append(tmp)
        shutil.rmtree(cache / "weights")
        raise RuntimeError("Error while serializing: I/O error: No such file or directory")

    calls.clear()
    with pytest.raises(FileNotFoundError, match="removed during the copy"):
        localize(f"memory://node-cache-{uuid.uuid4().hex[:8]}/v2", "weights", build=never)
    assert len(calls) == node_local.CACHE_REMOVED_RETRIES + 1


def test_a_build_that_fails_with_its_cache_in_place_is_not_retried(cache):
    """Guards the retry above from hiding real errors: a writer failing for its own reasons fails once."""
    calls = []

    def build(tmp: str) -> None:
        calls.append(tmp)
        raise RuntimeError("corrupt delta")

    with pytest.raises(RuntimeError, match="corrupt delta"):
        localize(f"memory://node-cache-{uuid.uuid4().hex[:8]}/v1", "weights", build=build)
    assert len(calls) == 1


def test_an_engine_whose_copy_vanished_while_it_read_it_copies_again(cache, monkeypatch):
    """Pins: the launcher's load and stage discard this node's copy of a weight version and make it again
    once when the engine failed to read it (the node cache cleaned between the copy and the read, even
    half-way: CI's node-cache test, an operator's clean-up); an engine that fails on the fresh copy too
    fails the load; a run root read in place is never copied. Guards: a run failing because a cache
    directory was removed under a load, and a retry loop."""
    import shutil

    from miles_core.engines import launcher
    from miles_core.engines.client import EngineControlError

    made = []

    def fake_localize(uri: str) -> str:
        path = cache / "weights" / f"copy{len(made)}"
        path.mkdir(parents=True)
        (path / MARKER).write_bytes(b"")
        made.append(str(path))
        return str(path)

    monkeypatch.setattr(launcher, "localize_weights", fake_localize)
    server = launcher.EngineServer.__new__(launcher.EngineServer)
    server.name = "engine-0"
    read = []

    def engine_reads(path: str) -> str:
        read.append(path)
        if len(read) == 1:
            shutil.rmtree(path)
            raise EngineControlError(f"HTTP 400: {path}: no model.safetensors")
        return "loaded"

    assert server._with_local_copy("s3://b/run/weights/step_00000002", engine_reads) == "loaded"
    assert read == made and len(made) == 2

    def engine_fails(path: str) -> str:
        raise EngineControlError("HTTP 400: out of memory")

    with pytest.raises(EngineControlError, match="out of memory"):
        server._with_local_copy("s3://b/run/weights/step_00000003", engine_fails)
    assert len(made) == 4  # copied, failed, copied again, failed: raised
    monkeypatch.setattr(launcher, "localize_weights", lambda uri: "/elsewhere/run/weights/step_00000004")
    with pytest.raises(EngineControlError, match="out of memory"):
        server._with_local_copy("file:///elsewhere/run/weights/step_00000004", engine_fails)
    assert len(made) == 4 and launcher.is_cache_entry(made[0])


def test_weights_noted_during_a_restart_do_not_wait_for_it(cache):
    """Pins: `note_weights` (the last step of a load) does not take the process lock a restart holds while
    it waits for the new engine's /health. Guards the deadlock CI's engine-kill chaos test met: a delivery
    paused the restarted engine and loaded it, then waited on the lock, while the restart waited for a
    /health that fails until that delivery resumes the engine (the run stalled until the startup timeout)."""
    import threading

    from miles_core.engines import launcher

    server = launcher.EngineServer.__new__(launcher.EngineServer)
    server._lock, server._noted = threading.RLock(), threading.Lock()
    launching, noted = threading.Event(), threading.Event()

    def restart_waiting_for_health():
        with server._lock:
            launching.set()
            noted.wait(timeout=WAIT_SECONDS)  # released once the test has seen whether the note waited

    t = threading.Thread(target=restart_waiting_for_health)
    t.start()
    launching.wait(timeout=WAIT_SECONDS)
    note = threading.Thread(target=server.note_weights, args=("s3://b/run/weights/step_00000007", 9))
    note.start()
    note.join(timeout=NOTE_WAITS_SECONDS)
    waited = note.is_alive()
    noted.set()
    t.join()
    note.join()
    assert not waited, "note_weights waited for the restart's process lock"
    assert (server.model_path, server.weight_version, server.model_kind) == (
        "s3://b/run/weights/step_00000007", 9, "weights")
