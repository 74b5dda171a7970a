"""The distributed transport's failures on NCCL's terms (tests/support/strict_device.py's watchdog emulation).

Real CPU engine servers; the trainer's side in rank processes of their own, its groups standing for NCCL:
- a push made again after an engine was lost mid-push (the driver's retry, `WeightPusher._pushed`, to the
  engines left) delivers the weights gathered for that version the first time: rank 0 gathers once per
  version and its TP peer joins that one gather, so neither waits in a gather the other never makes
  (with producer jobs, `--allow-rollout-producers`, the run-root snapshot comes from the same gather);
  on the old code rank 0 gathered again, and with producers its TP peer was left in a gather of its own;
- a broadcast that passes its bound (an engine stopped mid-push) fails the push with `WeightPushError`,
  an infrastructure failure a retried segment resumes from, instead of the weight group's timeout reaching
  NCCL's watchdog, which tears rank 0's process down (exit 134) on GPU.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer
from miles_core.models.builtin import materialize_checkpoint
from tests.support import strict_device as strict
from tests.support.timeouts import ENGINE_START_SECONDS

BUCKET = 64 << 10  # the tiny model in ~17 buckets
# The trainer's groups: a gather no peer joins is torn down after it. Rank 1 waits this long in the all-reduce
# after the push made again while rank 0 delivers to the engine left and writes its part: 15 s tripped in a
# CI run on a saturated 2-core machine, with no rank in a wrong collective.
WORLD_TIMEOUT = timedelta(seconds=40)
PUSH_TIMEOUT = 2.0  # the transport's timeout_seconds
RANKS_TIMEOUT = 120.0  # seconds a test waits for its processes


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path_factory.mktemp("tiny-gpt")))


@pytest.fixture
def engines(tiny_gpt):
    servers = [EngineServer(EngineLaunchSpec("cpu", tiny_gpt, startup_timeout_seconds=ENGINE_START_SECONDS,
                                             health_interval_seconds=0.5), f"engine-{i}") for i in range(2)]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        try:
            os.kill(s.pid(), signal.SIGCONT)
        except (OSError, TypeError):
            pass
        s.stop()


def _run(target, args_list: list[tuple]) -> list[int | None]:
    """Spawn one process per entry, wait for all; their exit codes (None: killed past RANKS_TIMEOUT)."""
    procs = [mp.get_context("spawn").Process(target=target, args=args) for args in args_list]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANKS_TIMEOUT
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


def _stderr_to(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    torch.set_num_threads(1)


# ---------------------------------------------------------------- a push made again after an engine was lost

class _TPTrainer:
    """What a push asks of the trainer, on two TP ranks: `hf_state_dict` is the TP gather (a collective
    on the world, standing for NCCL, that rank 0's peer joins through `join_export`)."""

    exports_with_peers = True
    cuda = False

    def __init__(self, state: dict[str, torch.Tensor], rank: int):
        self.state, self.gathers = state, 0
        self.aux_files = {"config.json": b"{}"}
        self.export_writer = (rank, 2)  # each TP rank writes its part of a published snapshot

    def hf_state_dict(self, dtype=None) -> dict[str, torch.Tensor]:
        from miles_core.train import collectives

        self.gathers += 1
        collectives.all_reduce(torch.ones(1))  # the gather: every TP rank takes part
        return dict(self.state)

    def join_export(self) -> None:
        self.hf_state_dict()


def _lost(i: int) -> None:
    raise RuntimeError(f"engine {i}'s actor died")  # what restarting a lost engine's Ray actor raises


def _worker(rank: int, trainer: _TPTrainer, tmp: str, publish: bool):
    """A TrainerWorker around `trainer` (its constructor builds a Megatron model; the push needs none)."""
    from miles_core.storage import Store
    from miles_core.storage.weight_versions import PartWriter
    from miles_core.train.worker import TrainerWorker

    class Worker(TrainerWorker):
        def _connect_engines(self, engine_urls, engine_actors):  # no Ray: the engines are this machine's
            self._connect(engine_urls, "127.0.0.1", engine_generations=lambda: [0] * len(engine_urls),
                          restart_engine=_lost, control_retries=0)

    w = Worker.__new__(Worker)
    engine = SimpleNamespace(update_weight_buffer_size=BUCKET, rollout_num_gpus_per_engine=1, engine_backend="cpu")
    w.cfg = SimpleNamespace(engine=engine, rollout=SimpleNamespace(pause_generation_mode="retract"))
    w.rank, w.trainer, w.run_store = rank, trainer, Store(f"file://{tmp}/run")
    w.loop = w.engines = w.sync = None
    w.publish, w.distributed = publish, True
    w._superseded, w._last_key, w._closed = {}, None, threading.Event()
    w._versions = PartWriter()
    return w


def _tp_rank(rank: int, tmp: str, urls: list[str], victim_pid: int, hf_dir: str, publish: bool) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles_core.train import collectives
    from miles_core.weights import distributed

    out: dict = {}
    try:
        _stderr_to(f"{tmp}/rank{rank}.stderr")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2, timeout=WORLD_TIMEOUT)
        strict.enforce_device_rule("cuda", [None])  # the world is the TP group and stands for NCCL
        strict.watch_weight_groups()
        trainer = _TPTrainer(load_file(f"{hf_dir}/model.safetensors"), rank)
        worker = _worker(rank, trainer, tmp, publish)
        if rank == 0:
            worker.set_engines(urls, [None] * len(urls))
            real, sent = distributed.DistributedWeightTransport._send_bucket, []

            async def send(self, clients, bucket, weight_version):  # engine 1 dies after the first bucket
                sent.append(1)
                if len(sent) == 2:
                    os.kill(victim_pid, signal.SIGKILL)
                await real(self, clients, bucket, weight_version)

            distributed.DistributedWeightTransport._send_bucket = send
        collectives.barrier()
        try:
            worker.push_weights(0, 1)
            out["first"] = "delivered"
        except Exception as e:  # noqa: BLE001 - rank 0's push fails: engine 1 is gone
            out["first"] = f"{type(e).__name__}: {e}"
        worker.set_engines(urls[:1], [None])  # what the driver does once the fleet dropped the lost engine
        out["second"] = worker.push_weights(0, 1)  # ... and the push made again (WeightPusher._pushed)
        out["gathers"] = trainer.gathers
        total = torch.tensor([float(trainer.gathers)])
        collectives.all_reduce(total)  # both ranks are still in step: nobody waits in a gather
        out["gathers_both"] = float(total)
        if rank == 0:
            worker._disconnect_engines()
    except BaseException:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out, default=str))
    os._exit(0)


@pytest.mark.parametrize("publish", [False, True], ids=["engines", "with-producers"])
def test_a_push_made_again_after_a_lost_engine_reuses_the_gathered_weights(tmp_path, tiny_gpt, engines, publish):
    """TP 2: engine 1 dies mid-push; rank 0's push fails; the push made again to engine 0 delivers version 1
    with no second gather on either rank (one each, and the ranks still in step)."""
    urls = [s.url for s in engines]
    t0 = time.monotonic()
    codes = _run(_tp_rank, [(r, str(tmp_path), urls, engines[1].pid(), tiny_gpt, publish) for r in range(2)])
    elapsed = time.monotonic() - t0
    outs = {r: json.loads(p.read_text()) for r in range(2) if (p := tmp_path / f"rank{r}.json").exists()}
    stderr = {r: (tmp_path / f"rank{r}.stderr").read_text()[-3000:] for r in range(2)
              if (tmp_path / f"rank{r}.stderr").exists()}
    assert codes == [0, 0], (codes, outs, stderr)
    assert not any("error" in o for o in outs.values()), (outs, stderr)
    assert "engine 1" in outs[0]["first"] or "actor died" in outs[0]["first"], outs
    assert outs[0]["second"]["delivered"] is True, outs
    assert (outs[0]["gathers"], outs[1]["gathers"], outs[0]["gathers_both"]) == (1, 1, 2.0), outs
    if publish:
        assert outs[0]["second"]["snapshot"].endswith("weights/step_00000000"), outs
        # each TP rank wrote its part (rank 1 in its one call, rank 0 in the push made again); the driver seals
        version_dir = tmp_path / "run" / "weights" / "step_00000000"
        assert outs[0]["second"]["sealed"] is False and not (version_dir / ".complete").exists()
        assert sorted(p.name for p in version_dir.glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]

    async def version() -> str:
        async with EngineClient([urls[0]]) as c:
            return (await c.model_info(urls[0]))["weight_version"]

    assert asyncio.run(version()) == "1"
    assert elapsed < 60, f"took {elapsed:.1f}s"


# ---------------------------------------------------------------- a broadcast past its bound

def _stopping_push(tmp: str, url: str, pid: int, hf_dir: str) -> None:
    from safetensors.torch import load_file

    from miles_core.failures import is_infrastructure
    from miles_core.weights.distributed import DistributedWeightTransport

    _stderr_to(f"{tmp}/push.stderr")
    strict.watch_weight_groups()  # the weight group stands for NCCL's: its watchdog watches it
    state = load_file(f"{hf_dir}/model.safetensors")

    class StopMidPush(DistributedWeightTransport):
        sent = 0

        async def _send_bucket(self, clients, bucket, weight_version):  # the engine hangs after one bucket
            self.sent += 1
            if self.sent == 2:
                os.kill(pid, signal.SIGSTOP)
            await super()._send_bucket(clients, bucket, weight_version)

    transport = StopMidPush(lambda: state, [url], master_address="127.0.0.1", backend="gloo", bucket_bytes=BUCKET,
                            timeout_seconds=PUSH_TIMEOUT)
    out: dict = {}
    t0 = time.monotonic()
    try:
        transport.prepare(0)
        asyncio.run(transport.load(None, 1))
        out["raised"] = None
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out |= {"raised": type(e).__name__, "message": str(e), "infrastructure": is_infrastructure(e)}
    out["seconds"] = time.monotonic() - t0
    Path(tmp, "push.json").write_text(json.dumps(out))
    os._exit(0)


def test_a_broadcast_past_its_bound_fails_the_push_instead_of_tripping_the_watchdog(tmp_path, tiny_gpt, engines):
    """An engine stopped (SIGSTOP) mid-push: rank 0's broadcast never completes. The push fails with
    WeightPushError (infrastructure: the segment's retry resumes) within a few bounds; the process lives."""
    victim = engines[0]
    codes = _run(_stopping_push, [(str(tmp_path), victim.url, victim.pid(), tiny_gpt)])
    err = (tmp_path / "push.stderr").read_text()[-3000:] if (tmp_path / "push.stderr").exists() else ""
    assert codes == [0], (codes, err)
    out = json.loads((tmp_path / "push.json").read_text())
    assert out["raised"] == "WeightPushError" and out["infrastructure"], out
    assert "engine 0" in out["message"], out
    assert out["seconds"] < 8 * PUSH_TIMEOUT, out
