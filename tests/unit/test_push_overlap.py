"""A weight push that does not wait (`TrainerWorker.push_weights(step, wait=False)`, the fully async driver):
the store transport's export happens in the call, the delivery (pause, load, resume, tell the rollout side)
on the worker's delivery thread while the next step trains; every later call that touches the engines
waits for it, and its failure is raised by the next push.

The worker is the real one (its event loop, store transport, delivery thread, lost-engine handling) on a
stand-in trainer (its weights, one tensor) and a stand-in engine whose load the test holds.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from miles_core.config.flags import parse_flags
from miles_core.metrics import names as N


class StubTrainer:
    cuda, tp = False, 1

    def __init__(self, *args, **kw):
        self.aux_files = {"config.json": b"{}"}
        self.weight = torch.zeros(4)

    def hf_state_dict(self, dtype=None):
        return {"w": self.weight.clone()}

    def join_export(self):
        pass

    def close(self):
        pass


class HeldEngine:
    """Loads only when the test lets it (`release`); records what it did, in order."""

    def __init__(self, fail_version: int | None = None):
        self.events: list[tuple[str, object]] = []
        self.gate = threading.Event()
        self.fail_version = fail_version
        self.failed = False

    async def pause_generation(self, mode: str) -> None:
        self.events.append(("pause", mode))

    async def continue_generation(self) -> None:
        self.events.append(("resume", None))

    async def update_weights_from_disk(self, model_path, weight_version, *, flush_cache=False,
                                       abort_all_requests=False) -> None:
        await asyncio.to_thread(self.gate.wait, 60)
        if weight_version == self.fail_version:
            self.failed = True
            raise RuntimeError(f"engine refused v{weight_version}")
        self.events.append(("load", weight_version))

    def loaded(self) -> list[int]:
        return [v for what, v in self.events if what == "load"]


@pytest.fixture
def worker(tmp_path, monkeypatch):
    import miles_core.train.trainer as trainer_module
    from miles_core.train.worker import TrainerWorker

    monkeypatch.setattr(trainer_module, "Trainer", StubTrainer)
    (tmp_path / "model").mkdir()
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r", "--save", "", "--save-interval", "none"])
    w = TrainerWorker(cfg, f"file://{tmp_path / 'model'}", 0, 1, ("127.0.0.1", 1), ["http://127.0.0.1:9"])
    w.told = []  # the versions the rollout side was told
    w.publish_version = w.told.append
    yield w
    for engine in w.sync.engines if w.sync is not None else ():
        if isinstance(engine, HeldEngine):
            engine.gate.set()
    w.close()


def held(worker, **kw) -> HeldEngine:
    engine = HeldEngine(**kw)
    worker.sync.engines = [engine]
    return engine


def test_a_push_that_does_not_wait_returns_before_the_engines_load_and_the_next_push_waits_for_them(worker):
    engine = held(worker)
    out = worker.push_weights(0, wait=False)
    assert out["version"] == 1 and out["published"] is True and N.WEIGHT_EXPORT_SECONDS in out
    assert N.WEIGHT_UPDATE_SECONDS not in out  # delivered later: logged with the next push
    assert worker.run_store.exists("weights/step_00000000/.complete")  # exported within the call
    time.sleep(0.2)
    assert engine.loaded() == [] and worker.told == []  # the rollout side hears of v1 only once it is served
    assert engine.events == [("pause", "retract")]

    worker.trainer.weight += 1  # the next step trains meanwhile: the delivery reads only the exported snapshot
    engine.gate.set()
    out = worker.push_weights(1, wait=True)
    assert out["version"] == 2 and engine.loaded() == [1, 2] and worker.told == [1, 2]
    assert out[N.WEIGHT_DELIVERY_WAIT_SECONDS] >= 0 and out[N.WEIGHT_UPDATE_SECONDS] > 0
    assert [e for e, _ in engine.events] == ["pause", "load", "resume", "pause", "load", "resume"]


@pytest.mark.parametrize("call", ["delivered", "staged_weights", "set_version"])
def test_calls_that_touch_the_engines_wait_for_the_delivery_in_flight(worker, call):
    engine = held(worker)
    worker.push_weights(0, wait=False)
    done, answers = threading.Event(), []
    args = {"set_version": (1,)}.get(call, ())
    t = threading.Thread(target=lambda: (answers.append(getattr(worker, call)(*args)), done.set()))
    t.start()
    assert not done.wait(0.5)  # held behind the delivery
    engine.gate.set()
    assert done.wait(30) and engine.loaded() == [1]
    t.join()
    if call == "delivered":
        assert answers == [1]  # the version its engines hold now
    out = worker.push_weights(1, wait=True)  # the settled delivery's timings come with the next push
    assert out[N.WEIGHT_DELIVERY_WAIT_SECONDS] > 0.3


def test_a_failed_delivery_is_raised_by_the_next_push_and_leaves_the_engines_resumed(worker):
    engine = held(worker, fail_version=1)
    assert worker.push_weights(0, wait=False)["version"] == 1  # the failure is still to come
    engine.gate.set()
    with pytest.raises(RuntimeError, match="engine refused v1"):
        worker.push_weights(1, wait=False)
    assert engine.events[-1] == ("resume", None) and worker.told == []


def test_check_delivery_raises_a_failed_delivery_and_does_not_wait_for_one_in_flight(worker):
    """The driver asks while it waits for a batch of the pushed version (only a delivered version is told to
    the rollout side): a delivery in flight answers at once, a failed one raises."""
    engine = held(worker, fail_version=1)
    worker.push_weights(0, wait=False)
    t0 = time.monotonic()
    worker.check_delivery()
    assert time.monotonic() - t0 < 0.5 and engine.loaded() == []
    engine.gate.set()
    deadline = time.monotonic() + 30
    while not worker._delivering.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="engine refused v1"):
        worker.check_delivery()
    worker.check_delivery()  # raised once; nothing in flight now


def test_an_engine_lost_during_a_delivery_is_dropped_on_the_delivery_thread(worker, monkeypatch):
    """The lost-engine path (drop it, deliver again to the rest) runs on the delivery thread itself: with no
    engine left the version is still told to the rollout side, and the next push, with no engine, leaves the
    telling to the driver."""
    import miles_core.train.worker as worker_module

    engine = held(worker, fail_version=1)
    monkeypatch.setattr(worker_module, "lost_actors", lambda actors: [0] if engine.failed else [])
    worker.push_weights(0, wait=False)
    engine.gate.set()
    answers: list = []
    t = threading.Thread(target=lambda: answers.append(worker.push_weights(1, wait=False)), daemon=True)
    t.start()
    t.join(30)
    assert answers, "the next push did not come back: the delivery thread waited for itself"
    assert worker.told == [1] and worker.sync is None
    assert answers[0]["version"] == 2 and "published" not in answers[0]


def test_without_the_store_transport_a_push_always_waits(worker, monkeypatch):
    import miles_core.train.worker as worker_module

    class OtherTransport(worker_module.StoreWeightTransport):
        pass

    monkeypatch.setattr(worker_module, "StoreWeightTransport", OtherTransport)  # the worker's check no longer matches
    engine = held(worker)
    engine.gate.set()
    out = worker.push_weights(0, wait=False)
    assert engine.loaded() == [1] and N.WEIGHT_UPDATE_SECONDS in out
