"""Several processes on one node share its cache (miles_core.storage.node_local), on a real S3 server.

Pins: four processes localizing the same s3:// URI at once (each download slowed, by a different
amount per process) download it once in all, all get the same path, and while the others are
still localizing each reads the complete content there, with no file ever missing and the
directory it was handed never replaced; an entry another live process localized is kept by
`prune` (here: two newer entries with KEEP 1), stays readable in full, and is pruned once that
process has exited.

Guards: one download per process, a later finisher deleting and replacing the copy an earlier one
is reading, and pruning by age alone.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from pathlib import Path

import pytest

from miles_core.storage import Store, node_local
from miles_core.storage.node_local import MARKER, localize

from tests.support.timeouts import WAIT_SECONDS, wait_until

pytestmark = pytest.mark.s3

CONTENT = {"config.json": b'{"hidden_size": 64}', "sub/tokenizer.json": b"tok" * 1000,
           "model.safetensors": b"w" * 65536, "generation_config.json": b"{}"}
WEIGHTS = {"model.safetensors": b"w" * 65536}
PROCESSES = 4
CLOCK_LOOK_SECONDS = 0.01  # how often to look at the file system's clock (it ticks every few ms)
# separate interpreters, as ranks and engines are: forked from one clean server process that has
# imported what they need once (spawning each from scratch takes seconds on a busy machine)
RANKS = multiprocessing.get_context("forkserver")
RANKS.set_forkserver_preload(["miles_core.storage.node_local", "s3fs", "pytest"])


def _sources(bucket: str, names: list[str], content: dict[str, bytes]) -> list[str]:
    """A fresh S3 prefix per name holding `content` (one client for all: each takes a while to start)."""
    base = Store(f"s3://{bucket}/node-cache-{uuid.uuid4().hex[:8]}")
    for name in names:
        for key, data in content.items():
            base.put_bytes(f"{name}/{key}", data)
    return [base.uri(name) for name in names]


def _read_all(path: str, content: dict[str, bytes] = CONTENT) -> list[str]:
    """What is wrong with the copy at `path`: a missing or different file."""
    problems = []
    for key, data in {**content, MARKER: b""}.items():
        try:
            with open(os.path.join(path, key), "rb") as f:
                if f.read() != data:
                    problems.append(f"{key}: different content")
        except OSError as e:
            problems.append(f"{key}: {type(e).__name__}")
    return problems


def _identity(path: str):
    try:
        st = os.stat(path)
        return st.st_dev, st.st_ino
    except OSError:
        return None


def _localize_and_read(env, uri, delay, downloads, go, done, results):
    """One rank: every object it downloads is logged to `downloads` and takes `delay` seconds; once
    `localize` returns, it reads the copy over and over until every rank has localized."""
    os.environ.update(env)  # the fork server's environment is the one it started with
    get_bytes = Store.get_bytes

    def slow_get_bytes(self, key):
        with open(downloads, "a") as f:
            f.write(f"{os.getpid()} {key}\n")
        time.sleep(delay)
        return get_bytes(self, key)

    Store.get_bytes = slow_get_bytes
    go.wait()
    path = localize(uri, "models")
    handed = _identity(path)
    with done.get_lock():
        done.value += 1
    problems, reads, deadline = [], 0, time.monotonic() + 30
    while True:
        finished = done.value == PROCESSES  # every rank is past localize: one more full read, then stop
        problems += _read_all(path)
        reads += 1
        if finished or time.monotonic() > deadline:
            break
    results.put({"path": path, "handed": handed, "after": _identity(path), "problems": problems, "reads": reads})


def test_one_download_per_node_and_no_reader_sees_a_copy_replaced(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))  # handed to the ranks with the S3 settings
    (uri,), downloads = _sources(s3_bucket, ["model"], CONTENT), str(tmp_path / "downloads.log")
    go, done, results = RANKS.Event(), RANKS.Value("i", 0), RANKS.Queue()
    ranks = [RANKS.Process(target=_localize_and_read, args=(dict(os.environ), uri, 0.1 * (i + 1), downloads, go, done,
                                                                results))
             for i in range(PROCESSES)]
    for p in ranks:
        p.start()
    go.set()
    got = [results.get(timeout=WAIT_SECONDS) for _ in ranks]
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0

    lines = open(downloads).read().split()
    pids, keys = set(lines[0::2]), lines[1::2]
    assert len(pids) == 1 and sorted(keys) == sorted(CONTENT), \
        f"{len(pids)} processes downloaded {len(keys)} objects; one download of {len(CONTENT)} expected"
    assert len({r["path"] for r in got}) == 1, "the ranks were handed different copies"
    assert all(r["reads"] >= 1 for r in got)
    assert [r["problems"] for r in got] == [[]] * PROCESSES, "a rank saw its copy missing or half-written"
    assert len({r["handed"] for r in got} | {r["after"] for r in got}) == 1, \
        "the directory a rank was handed was removed or replaced while it read it"
    assert _read_all(got[0]["path"]) == []


def _hold_and_read(env, uri, handed, pruned, results):
    """A rank that localized an entry and keeps reading it while another process prunes."""
    os.environ.update(env)
    path = localize(uri, "weights")
    handed.put(path)
    pruned.wait(60)
    results.put(_read_all(path, WEIGHTS))


def _clock_past(path: str, probe: Path) -> bool:
    """A file touched now (on the same file system) is newer than `path`: the file system's clock, which
    may tick coarsely, has passed `path`'s mtime, so entries made from now on sort newer than it."""
    probe.touch()
    os.utime(probe)
    return os.path.getmtime(probe) > os.path.getmtime(path)


def test_prune_never_removes_an_entry_another_process_holds(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(node_local.KEEP, "weights", 1)  # in this process only: the rank keeps the default
    held_uri, *newer = _sources(s3_bucket, ["step_1", "step_2", "step_3"], WEIGHTS)
    handed, pruned, results = RANKS.Queue(), RANKS.Event(), RANKS.Queue()
    rank = RANKS.Process(target=_hold_and_read, args=(dict(os.environ), held_uri, handed, pruned, results))
    rank.start()
    try:
        held = handed.get(timeout=WAIT_SECONDS)
        wait_until(lambda: _clock_past(held, tmp_path / "clock"), WAIT_SECONDS,
                   "file-system clock past the held copy's mtime (so it is older than the ones below)",
                   interval=CLOCK_LOOK_SECONDS)
        paths = [localize(uri, "weights") for uri in newer]  # each prunes: KEEP 1 here
        assert os.path.isdir(held) and _read_all(held, WEIGHTS) == [], "prune removed an entry another process holds"
        assert not os.path.exists(paths[0]), "an entry nobody holds beyond KEEP was kept"
        assert _read_all(paths[1], WEIGHTS) == []
    finally:
        pruned.set()
    assert results.get(timeout=WAIT_SECONDS) == [], "the holding process could not read its copy after the prune"
    rank.join(30)
    assert rank.exitcode == 0
    node_local.prune("weights")  # its holder has exited: nothing keeps the old entry now
    assert not os.path.exists(held) and os.path.isdir(paths[1])
