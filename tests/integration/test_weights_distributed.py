"""The distributed weight transport (SGLang's protocol over gloo) from an in-process Trainer to real CPU
engine server processes.

Pins: after `WeightSync.push` with `DistributedWeightTransport`, every engine's greedy log-probs on a
fixed prompt equal the trainer's on the new weights (within 1e-4; they agree to ~1e-6) and /model_info
reports the new version; with a small bucket size several buckets go out, none over the limit unless a
lone tensor is, and only the last carries `weight_version` (an engine reports the old version until the
last bucket landed); the group is formed once and reused; an engine killed between pushes and restarted
by its monitor rejoins before the next push; an engine that dies (SIGKILL) or hangs (SIGSTOP) mid-push
does not hang the push: it fails within the timeout, the engine is restarted, and the retry lands; a
second failure raises `WeightPushError` naming the engine. The error answers of the CPU engine's
endpoints are pinned in tests/integration/test_engine_server.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer
from miles_core.models.builtin import SEP_ID, materialize_checkpoint
from miles_core.samples import Sample
from miles_core.train.trainer import Trainer
from miles_core.weights.distributed import DistributedWeightTransport, WeightPushError, buckets
from miles_core.weights.sync import WeightSync
from tests.support.timeouts import ENGINE_START_SECONDS, WAIT_SECONDS, wait_until
from tests.unit.test_train import make_groups

PUSH_TIMEOUT_SECONDS = 6.0  # the transport's timeout_seconds: a dead or stopped engine fails the attempt within it

torch.set_num_threads(1)
PROMPT = [1, 2, 3, 4, SEP_ID]
ATOL = 1e-4  # float32 on both sides, same weights: the CPU engine matches a float32 forward to ~1e-6
BUCKET = 64 << 10  # the tiny model is 1.5 MiB in 20 tensors: ~17 buckets


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    path = materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path_factory.mktemp("tiny-gpt")))
    with Trainer(TrainSection(), path) as tr:
        tr.train_step(0, make_groups())  # the engines start from the checkpoint: the weights differ
        yield tr


@pytest.fixture(scope="module")
def engines(trainer):
    servers = [EngineServer(EngineLaunchSpec("cpu", trainer.hf_dir, startup_timeout_seconds=ENGINE_START_SECONDS,
                                             health_interval_seconds=0.5), f"engine-{i}") for i in range(2)]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


def transport(trainer, fleet, cls=DistributedWeightTransport, **kw):
    kw = {"bucket_bytes": BUCKET, "timeout_seconds": 20.0, **kw}
    return cls(trainer.hf_state_dict, [s.url for s in fleet], master_address="127.0.0.1", backend="gloo",
               engine_generations=lambda: [s.restarts for s in fleet],
               restart_engine=lambda i: fleet[i].restart(), **kw)


async def push(transport_, servers, step: int, version_before: int = 0):
    """One WeightSync.push through a client over all engines; returns (result, versions, greedy results)."""
    async with EngineClient([s.url for s in servers]) as client:
        sync = WeightSync([client], transport_, pause_mode="retract")
        res = await sync.push(step, version_before + 1)
        versions = {s.url: (await client.model_info(s.url))["weight_version"] for s in servers}
        outs = [await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                                      url=s.url) for s in servers]
        return res, versions, outs


def assert_serves_trainer_weights(trainer, outs):
    for out in outs:
        assert not out.aborted and len(out.output_ids) == 6
        ours = trainer.logprobs([Sample("p", 0, 0, PROMPT, out.output_ids)])[0]
        diff = (torch.tensor(ours) - torch.tensor(out.output_logprobs)).abs().max().item()
        assert diff < ATOL, f"{out.engine_url}: engine log-probs differ from the trainer's by {diff}"


class Recording(DistributedWeightTransport):
    """Records each bucket's weight_version and the engines' reported versions before each bucket."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent: list[tuple[list[str], str | None, list[str]]] = []

    async def _send_bucket(self, clients, bucket, weight_version):
        seen = [(await c.model_info(c.urls[0]))["weight_version"] for c in clients]
        self.sent.append(([n for n, _ in bucket], weight_version, seen))
        await super()._send_bucket(clients, bucket, weight_version)


def test_push_lands_on_two_engines_in_buckets_with_the_version_on_the_last(trainer, engines):
    """Two engines, ~17 buckets: log-probs equal the trainer's, /model_info says "1", only the last bucket
    carries the version and the engines report the old one until then; a second push (after a train
    step) reuses the group and lands as version 2."""
    tp = transport(trainer, engines, Recording)
    try:
        res, versions, outs = asyncio.run(push(tp, engines, 1))
        assert res.version == 1 and set(versions.values()) == {"1"}
        assert_serves_trainer_weights(trainer, outs)
        names = [names for names, _, _ in tp.sent]
        assert len(names) > 3 and [n for b in names for n in b] == list(trainer.hf_state_dict())
        sizes = {n: t.numel() * t.element_size() for n, t in trainer.hf_state_dict().items()}
        assert all(sum(sizes[n] for n in b) <= BUCKET or len(b) == 1 for b in names)
        assert [v for _, v, _ in tp.sent] == [None] * (len(names) - 1) + ["1"]
        first = tp.sent[0][2]
        assert "1" not in first and all(seen == first for _, _, seen in tp.sent)  # old version until the last bucket
        assert tp.history[-1]["formed"] == 1 and tp.history[-1]["attempts"] == 1

        trainer.train_step(1, make_groups())
        tp.sent.clear()
        res, versions, outs = asyncio.run(push(tp, engines, 2, version_before=1))
        assert res.version == 2 and set(versions.values()) == {"2"}
        assert_serves_trainer_weights(trainer, outs)
        assert tp.history[-1]["formed"] == 0  # the group formed by the first push is reused
    finally:
        asyncio.run(tp.close())


def test_bucketing_rules():
    """Buckets keep the order, stay within the limit, and a tensor over the limit goes alone."""
    t = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(5)}
    assert [[n for n, _ in b] for b in buckets(t, 80)] == [["a", "b"], ["big"], ["c"]]
    assert [[n for n, _ in b] for b in buckets(t, 10_000)] == [["a", "b", "big", "c"]]


def test_engine_restarted_between_pushes_rejoins(trainer, engines):
    """SIGKILL engine 0 after a push: its monitor restarts it (initial weights, version 0); the next push
    sees the new generation, forms the group again and lands on both engines."""
    tp = transport(trainer, engines)
    try:
        asyncio.run(push(tp, engines, 1))
        before = engines[0].restarts
        os.kill(engines[0].pid(), signal.SIGKILL)
        wait_until(lambda: engines[0].restarts != before, WAIT_SECONDS, "restart of the engine by the monitor")
        assert asyncio.run(_version(engines[0].url)) == "0"  # the restarted engine serves its launch weights

        trainer.train_step(2, make_groups())
        res, versions, outs = asyncio.run(push(tp, engines, 3, version_before=1))
        assert res.version == 2 and set(versions.values()) == {"2"}
        assert_serves_trainer_weights(trainer, outs)
        assert tp.history[-1]["formed"] == 1 and tp.history[-1]["attempts"] == 1
    finally:
        asyncio.run(tp.close())


class FailingMidPush(DistributedWeightTransport):
    """On the first attempt, hurts engine `victim` with `sig` just before bucket `at` goes out."""

    def __init__(self, *a, servers, victim: int, sig: int, at: int = 2, **kw):
        super().__init__(*a, **kw)
        self.servers, self.victim, self.sig, self.at = servers, victim, sig, at
        self.count, self.done = 0, False

    async def _send_bucket(self, clients, bucket, weight_version):
        self.count += 1
        if not self.done and self.count == self.at:
            self.done = True
            os.kill(self.servers[self.victim].pid(), self.sig)
        await super()._send_bucket(clients, bucket, weight_version)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_engine_failing_mid_push_is_restarted_and_the_retry_lands(trainer, engines, sig):
    """Engine 1 dies (SIGKILL) or hangs (SIGSTOP) after the first bucket: the attempt fails within the
    timeout instead of hanging, engine 1 is restarted, the group is formed again, and the whole push is
    retried once and lands on both engines (version and log-probs)."""
    timeout = PUSH_TIMEOUT_SECONDS
    pid = engines[1].pid()
    tp = transport(trainer, engines, FailingMidPush, servers=engines, victim=1, sig=sig, timeout_seconds=timeout)
    try:
        trainer.train_step(4, make_groups())
        t0 = time.monotonic()
        res, versions, outs = asyncio.run(push(tp, engines, 5))
        elapsed = time.monotonic() - t0
        assert res.version == 1 and set(versions.values()) == {"1"}
        assert_serves_trainer_weights(trainer, outs)
        h = tp.history[-1]
        assert h["attempts"] == 2 and h["formed"] == 2 and "engine 1" in h["failures"][0]
        assert engines[1].pid() != pid
        # one timeout for the failed attempt at most, a restart (a few seconds), and the retry
        assert elapsed < 2 * timeout + 30, f"the push took {elapsed:.1f}s"
    finally:
        asyncio.run(tp.close())


def test_second_failure_raises_naming_the_engine(trainer, engines):
    """An engine that fails again after its restart: WeightPushError names it; the engines are resumed
    (WeightSync's contract) and keep serving their old version."""

    class AlwaysKill(DistributedWeightTransport):
        async def _send_bucket(self, clients, bucket, weight_version):
            os.kill(engines[0].pid(), signal.SIGKILL)
            await super()._send_bucket(clients, bucket, weight_version)

    tp = transport(trainer, engines, AlwaysKill, timeout_seconds=PUSH_TIMEOUT_SECONDS)
    try:
        with pytest.raises(WeightPushError, match=r"engine 0 \(http://127\.0\.0\.1:\d+\)"):
            asyncio.run(push(tp, engines, 6))
        for s in engines:  # wait for the monitor to bring the last victim back for the next tests
            wait_until(lambda: asyncio.run(_version(s.url)) is not None, WAIT_SECONDS, f"{s.url} serving again")
    finally:
        asyncio.run(tp.close())


async def _version(url: str) -> str | None:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/model_info",
                                                        timeout=aiohttp.ClientTimeout(total=5)) as r:
            return (await r.json())["weight_version"] if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


@pytest.mark.slow  # Ray start-up plus two engine actors and their restarts: about a minute on two busy cores
def test_fleet_wiring_restart_and_generations(trainer, ray_local):
    """The wiring the driver uses: `EngineFleet.restart_counts` as the generations and `EngineFleet.restart`
    as the restarter. A push lands on both actors' engines; `fleet.restart(0)` restarts engine 0 (new pid,
    same URL, count 1, its launch weights) and the next push forms the group again and lands; an engine
    killed mid-push is back (monitor or restart) and the retry lands."""
    from miles_core.engines.launcher import EngineFleet

    spec = EngineLaunchSpec("cpu", f"file://{trainer.hf_dir}", startup_timeout_seconds=ENGINE_START_SECONDS,
                            health_interval_seconds=0.5)
    with EngineFleet(spec, 2, num_cpus_per_engine=0.5) as fleet:
        urls = fleet.urls()
        assert len(fleet.actor_handles()) == 2

        def make(cls=DistributedWeightTransport, **kw):
            return cls(trainer.hf_state_dict, urls, master_address="127.0.0.1", backend="gloo",
                       bucket_bytes=BUCKET, timeout_seconds=PUSH_TIMEOUT_SECONDS,
                       engine_generations=fleet.restart_counts,
                       restart_engine=fleet.restart, **kw)

        class Servers:  # what FailingMidPush needs: the pid of each engine
            def __init__(self, i):
                self.i = i

            def pid(self):
                return fleet.pids()[self.i]

        tp = make(FailingMidPush, servers=[Servers(0), Servers(1)], victim=1, sig=signal.SIGKILL, at=10**9)
        proxies = [type("E", (), {"url": u})() for u in urls]
        try:
            trainer.train_step(7, make_groups())
            res, versions, outs = asyncio.run(push(tp, proxies, 8))
            assert set(versions.values()) == {"1"} and tp.history[-1]["formed"] == 1
            assert_serves_trainer_weights(trainer, outs)

            pid0 = fleet.pids()[0]
            assert fleet.restart(0) == urls[0]
            assert fleet.restart_counts()[0] == 1 and fleet.pids()[0] != pid0
            assert asyncio.run(_version(urls[0])) == "0"
            trainer.train_step(9, make_groups())
            res, versions, outs = asyncio.run(push(tp, proxies, 10, version_before=1))
            assert set(versions.values()) == {"2"} and tp.history[-1]["formed"] == 1
            assert_serves_trainer_weights(trainer, outs)

            tp.at, tp.count = tp.count + 2, tp.count  # kill engine 1 before the 2nd bucket of the next push
            res, versions, outs = asyncio.run(push(tp, proxies, 11, version_before=2))
            assert set(versions.values()) == {"3"} and tp.history[-1]["attempts"] == 2
            assert fleet.restart_counts()[1] >= 1
            assert_serves_trainer_weights(trainer, outs)
        finally:
            asyncio.run(tp.close())
