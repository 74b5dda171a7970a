"""A producer job works with least privilege: it reads the run's config, data, feed and weights, and writes
only its own groups (`buffer/groups/{its writer}/`), the prompt claims and its heartbeat
(`producers/heartbeats/{its id}.json`); never trainer state, checkpoints, STATUS or the consumption record.

`run_producer` runs in-process against a run root prepared as a trainer leaves it before its first step
(config, STATUS running, prompts, the feed naming exported weights), through a Store that refuses every
write outside those prefixes, as an object-store policy would. Its engine is a CPU engine server in this
process (the job's Ray fleet swapped for it: engines read weights; the slow variant runs the job's own
Ray fleet). The producer commits groups, follows a new weight version from the feed, and stops by itself when the run
finishes. The run root's files before and after are compared too, so a write that bypasses the Store
(the claims' conditional create on file://) cannot escape the check.
Guards: a producer that needs write access to the trainer's records (a storage policy for producers
would break it in production), or that writes anything but its own records.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from miles_core.config import parse_flags
from miles_core.driver import placement
from miles_core.elastic import heartbeat as H
from miles_core.elastic import job as J
from miles_core.engines.client import EngineClient
from miles_core.engines.cpu_server import CpuEngineServer, serve
from miles_core.engines.launcher import free_port
from miles_core.metrics import trace
from miles_core.models.builtin import materialize_checkpoint
from miles_core.models.source import tokenizer_source
from miles_core.prepare.dataset import prepare_dataset
from miles_core.prepare.resources import ClusterShape, Node
from miles_core.rollout.feed_record import FEED_KEY, Feed, read_feed, write_feed
from miles_core.storage import COMPLETE_MARKER, StorageError, Store
from miles_core.storage.node_local import localize
from miles_core.storage.run_root import FINISHED, RUNNING, read_status, write_config, write_status

from tests.support.timeouts import WAIT_SECONDS, wait_until

STOPPED_SECONDS = 30  # the producer thread ends once told to stop (the test's cleanup)
LOOK_SECONDS = 0.05  # how often a wait looks at the producer's records

PRODUCER = "spot-a"


class WriteRefused(StorageError):
    def __init__(self, message: str):
        super().__init__(message)


class ProducerStore(Store):
    """The run root as a producer's credentials show it: reads anywhere; put, delete and move only under
    `claims/`, `producers/heartbeats/{producer}.json` and one `buffer/groups/{writer}/` (the first writer
    it writes under), and its own timeline trace chunks. Every refused write is recorded (a caller may swallow the error)."""

    def __init__(self, root_uri: str, producer_id: str):
        super().__init__(root_uri)
        self.producer_id, self.writer = producer_id, None
        self.refused: list[str] = []

    def _check(self, what: str, key: str) -> None:
        key = key.strip("/")
        if not (key.startswith("claims/") or key == f"{H.HEARTBEATS}{self.producer_id}.json" or self._own_group(key)
                or key.startswith(f"{trace.EVENTS_PREFIX}/{trace.PRODUCER_PROCESS}{self.producer_id}/")):
            self.refused.append(f"{what} {key}")
            raise WriteRefused(f"{what} {self.uri(key)}: the producer may not write there")

    def _own_group(self, key: str) -> bool:
        parts = key.split("/")
        if parts[:2] != ["buffer", "groups"] or len(parts) != 4:
            return False
        self.writer = self.writer or parts[2]
        return parts[2] == self.writer

    def put_bytes(self, key: str, data: bytes) -> None:
        self._check("put", key)
        super().put_bytes(key, data)

    def delete(self, key: str, missing_ok: bool = True) -> None:
        self._check("delete", key)
        super().delete(key, missing_ok)

    def delete_prefix(self, prefix: str) -> None:
        self._check("delete", prefix + "/")
        super().delete_prefix(prefix)

    def move(self, src: str, dst: str) -> None:
        self._check("move", src)
        self._check("move to", dst)
        super().move(src, dst)


class InProcessFleet:
    """The job's engine fleet as one CPU engine server on a thread of this process (no Ray, no process
    start-up): the same HTTP API, and weights loaded from the run-root URI the feed names."""

    def __init__(self, spec, num_engines: int, **_):
        assert num_engines == 1
        self.spec, self.port = spec, free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine", daemon=True)

    def start(self) -> "InProcessFleet":
        self.thread.start()
        server = CpuEngineServer(localize(self.spec.model_path, "weights"), weight_version=self.spec.weight_version)
        self.runner = asyncio.run_coroutine_threadsafe(serve(server, "127.0.0.1", self.port), self.loop).result()
        return self

    members = ["engine-0"]

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port}"]

    def lost(self) -> list:
        return []  # its engine lives as long as this process

    def stage_weights(self, uri: str) -> None:
        localize(uri, "weights", required=COMPLETE_MARKER)  # the download, before the pause

    def load_weights(self, uri: str, version: int) -> None:
        async def load():
            async with EngineClient(self.urls()) as client:
                await client.update_weights_from_disk(localize(uri, "weights", required=COMPLETE_MARKER), version)

        asyncio.run(load())

    def shutdown(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def weights(store: Store, step: int) -> str:
    key = f"weights/step_{step:08d}"
    materialize_checkpoint("builtin:tiny-gpt", step + 1, store.local_path(key))
    store.put_bytes(f"{key}/{COMPLETE_MARKER}", b"")
    return store.uri(key)


def feed(cfg, uri: str, version: int, step: int) -> Feed:
    return Feed(version=version, weights=uri, step=step, segment=0, queue_size=0, capacity=cfg.buffer_capacity_groups,
                consumed_groups=0, groups_per_version=cfg.rollout.rollout_batch_size, max_weight_staleness=None,
                first_version=1, written_at=time.time())


def run_root(tmp_path):
    """A run that allows producers, as its trainer leaves it before the first step ends."""
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r", "--allow-rollout-producers",
                       "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                       "--producer-poll-seconds", "0.1"])
    store = Store(cfg.run_uri)
    prepare_dataset(cfg.data, store, tokenizer_source=tokenizer_source(cfg))
    write_config(store, cfg)
    write_status(store, RUNNING, last_step=-1, segment=0)
    write_feed(store, feed(cfg, weights(store, 0), 1, -1))
    return cfg, store


def files(root: str) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime) of every file under `root`."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            st = os.stat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_size, st.st_mtime_ns)
    return out


class ProducerThread(threading.Thread):
    """run_producer on a thread; `outcome` is its result or the exception it raised."""

    def __init__(self, **kw):
        super().__init__(name="producer", daemon=True)
        self.kw, self.outcome = kw, None

    def run(self) -> None:
        try:
            self.outcome = J.run_producer(**self.kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.outcome = e

    def wait_for(self, fn, what: str, timeout: float = WAIT_SECONDS) -> None:
        def alive() -> None:
            assert self.is_alive(), f"the producer ended while the test waited for {what}: {self.outcome!r}"

        wait_until(fn, timeout, what, interval=LOOK_SECONDS, check=alive)


def test_a_producer_whose_store_refuses_writes_outside_its_records_still_works(tmp_path, monkeypatch):
    """The job's engine fleet runs in this process (InProcessFleet); with its real Ray fleet the same
    producer runs in tests/e2e/test_elastic_producers.py and test_elastic_netns.py."""
    cfg, store = run_root(tmp_path)
    monkeypatch.setattr(J, "EngineFleet", InProcessFleet)
    monkeypatch.setattr(J, "ensure_ray", lambda: None)
    monkeypatch.setattr(placement, "cluster_shape", lambda: ClusterShape((Node("this machine", 2, 0),), "this process"))
    monkeypatch.setattr(J, "HEARTBEAT_SECONDS", 0.2)  # beats (and run-state reads) every 5 s: a slow test
    confined = ProducerStore(cfg.run_uri, PRODUCER)
    before = files(store.local_path(""))
    stop = threading.Event()
    worker = ProducerThread(run_uri=cfg.run_uri, producer_id=PRODUCER, store=confined, stop=stop)
    worker.start()
    try:
        beat = lambda: H.read_heartbeat(store, PRODUCER)  # noqa: E731
        worker.wait_for(lambda: (b := beat()) is not None and b.groups_committed >= 2, "groups committed")
        write_feed(store, feed(cfg, weights(store, 1), 2, 0))  # the trainer's next version
        worker.wait_for(lambda: beat().version == 2, "the engines to load weights v2")
        write_status(store, FINISHED, last_step=0, segment=0)
        worker.join(timeout=WAIT_SECONDS)
    finally:
        stop.set()
        worker.join(timeout=STOPPED_SECONDS)
    r = worker.outcome
    assert isinstance(r, J.ProducerResult), r
    assert r.stop_reason == "the run finished" and r.groups_committed >= 2
    assert confined.refused == [] and confined.writer == r.writer
    after = files(store.local_path(""))
    changed = {p for p in after.keys() | before.keys() if before.get(p) != after.get(p)}
    changed -= {"STATUS.json", FEED_KEY} | {p for p in changed if p.startswith("weights/step_00000001/")}  # the test's
    own_trace = f"{trace.EVENTS_PREFIX}/{trace.PRODUCER_PROCESS}{PRODUCER}/"
    producers = {p for p in changed if p.startswith(("claims/", f"buffer/groups/{r.writer}/", own_trace))
                 or p == f"{H.HEARTBEATS}{PRODUCER}.json"}
    assert sorted(changed - producers) == [] and any(p.startswith("buffer/groups/") for p in changed)
    assert any(p.startswith(own_trace) for p in changed)  # its groups' spans, in its own prefix
    assert read_status(store).state == FINISHED and read_feed(store).version == 2  # as the "trainer" left them
    assert H.read_heartbeat(store, PRODUCER).state == H.STOPPED


def test_the_check_itself_refuses_a_write_to_trainer_state(tmp_path):
    """The store above can fail: a producer writing STATUS.json or a checkpoint is refused and recorded."""
    confined = ProducerStore(f"file://{tmp_path}/r", PRODUCER)
    confined.put_bytes("buffer/groups/w1/000000000000.arrow", b"x")
    for key in ("STATUS.json", "checkpoints/step_00000000/COMPLETE", "buffer/groups/w2/000000000000.arrow",
                "buffer/consumed/00000000.json", f"{H.HEARTBEATS}other.json"):
        with pytest.raises(WriteRefused):
            confined.put_bytes(key, b"x")
    assert len(confined.refused) == 5
