"""--use-distributed-optimizer and --bf16 on CPU: the GPU trainer's Megatron DDP + optimizer classes
(megatron-core 0.16.1's `DistributedOptimizer`, `Float16OptimizerWithFloat16Params`), run by the
real Trainer on two gloo DP ranks under NCCL's device rule (the strict device harness), through
`cpu_shim.megatron_on_cpu` and nothing else.

Pins:
- the distributed optimizer makes the fp32 CPU trainer's update (torch AdamW, this project's DP
  reduce and clip): the same metrics and weights after three steps at DP=2;
- a checkpoint of it (state gathered onto DP rank 0, `get_parameter_state_dp_zero`) restores to the
  same next steps: a fresh DP=2 trainer restored from step 0 trains steps 1 and 2 to the same
  metrics and weights as the uninterrupted one, and so does a DP=1 trainer (another DP size);
- the optimizer state matters: restoring only the weights gives another step 2;
- --bf16 on CPU: bf16 weights, fp32 main weights in the optimizer, a checkpoint round trip that
  makes the same step 2, losses close to fp32's;
- weights loaded into a built trainer (HF weights of --ref-load) survive its next step: the main
  weights are refreshed (`reload_model_params`), else the step writes the initial weights back.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import exit_launcher, fork_ranks, run_launcher
from tests.support import strict_device as strict
from tests.support.timeouts import RANKS_SECONDS

pytestmark = pytest.mark.slow
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6  # fp32: the reduce order differs between the layouts


def _groups(step: int):
    """Prompt groups of uneven response lengths, different each step."""
    from miles_core.models.builtin import SEP_ID
    from miles_core.samples import Group, Sample, SampleStatus

    rng = random.Random(100 + step)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(10) for _ in range(4)] + [SEP_ID]
        samples = []
        for i in range(4):
            resp = [rng.randrange(13) for _ in range(rng.randint(1, 6))]
            samples.append(Sample(f"s{step}g{g}", g, i, prompt, resp, [-2.5] * len(resp), [1] * len(resp),
                                  [1] * len(resp), reward=rng.random(), status=SampleStatus.COMPLETED))
        groups.append(Group(f"s{step}g{g}", g, samples))
    return groups


def _weights(tr) -> dict[str, torch.Tensor]:
    from miles_core.train import hf_convert
    from miles_core.train.megatron_model import unwrap

    return {k: v.detach().float().clone() for k, v in hf_convert.megatron_state(unwrap(tr.model)).items()}


def _metrics(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.endswith("_seconds")}


def _cfg(**kw):
    from miles_core.config.sections import TrainSection

    return dataclasses.replace(TrainSection(), **{"lr": 1e-2, "micro_batch_size": 3, **kw})


def _run(tr, steps) -> dict:
    return {"metrics": [_metrics(tr.train_step(k, _groups(k))) for k in steps], "weights": _weights(tr)}


def _dp2(rank: int, hf_dir: str, other_dir: str, tmp: str) -> None:
    """DP=2: the torch-path trainer, the distributed-optimizer trainer with a checkpoint after step 0,
    a restored one, a weights-only one; bf16 with a checkpoint and a restored one; bf16 trainers
    given other HF weights after they were built."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg2", rank=rank, world_size=2)
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.optimizer_state import distributed_parts
    from miles_core.train.trainer import Trainer

    out = {}
    with Trainer(_cfg(), hf_dir) as tr:
        assert not tr.megatron_optimizer
        out["torch"] = _run(tr, range(STEPS))
    dist_ckpt = CheckpointManager(Store(f"file://{tmp}/dist"))
    with Trainer(_cfg(use_distributed_optimizer=True), hf_dir) as tr:
        assert tr.dp_size == 2 and len(distributed_parts(tr.optimizer)) == 1
        first = _run(tr, [0])
        dist_ckpt.save(0, tr)
        rest = _run(tr, range(1, STEPS))
        out["dist"] = {"metrics": first["metrics"] + rest["metrics"], "weights": rest["weights"]}
    with Trainer(_cfg(use_distributed_optimizer=True), hf_dir) as tr:
        dist_ckpt.load(0, tr)
        out["dist_resumed"] = _run(tr, range(1, STEPS))
    with Trainer(_cfg(use_distributed_optimizer=True), hf_dir) as tr:
        tensors, meta, _ = dist_ckpt.read(0)
        tr.load_model_state(tensors["model"], meta)  # the weights, not the Adam moments
        out["weights_only"] = _run(tr, range(1, STEPS))
    bf16_ckpt = CheckpointManager(Store(f"file://{tmp}/bf16"))
    with Trainer(_cfg(bf16=True), hf_dir) as tr:
        assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
        first = _run(tr, [0])
        bf16_ckpt.save(0, tr)
        out["bf16"] = _run(tr, range(1, STEPS))
        out["bf16"]["metrics"] = first["metrics"] + out["bf16"]["metrics"]
    with Trainer(_cfg(bf16=True), hf_dir) as tr:
        bf16_ckpt.load(0, tr)
        out["bf16_resumed"] = _run(tr, range(1, STEPS))
    for kw in ({"bf16": True}, {"use_distributed_optimizer": True, "bf16": True}):
        with Trainer(_cfg(lr=0.0, **kw), hf_dir) as tr:  # lr 0: a step only writes the main weights back
            before = _weights(tr)
            tr.load_hf_weights(other_dir)
            loaded = _weights(tr)
            tr.train_step(0, _groups(0))
            out.setdefault("reload", []).append({"before": before, "loaded": loaded, "after": _weights(tr)})
    torch.save(out, os.path.join(tmp, f"dp2_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _dp1(hf_dir: str, tmp: str) -> None:
    """DP=1: restores the DP=2 distributed-optimizer checkpoint and trains steps 1 and 2."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg1", rank=0, world_size=1)
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.trainer import Trainer

    with Trainer(_cfg(use_distributed_optimizer=True), hf_dir) as tr:
        assert tr.dp_size == 1
        CheckpointManager(Store(f"file://{tmp}/dist")).load(0, tr)
        torch.save(_run(tr, range(1, STEPS)), os.path.join(tmp, "dp1.pt"))
    dist.destroy_process_group()


def _launch(tmp: str) -> None:
    """In a fresh (spawned) process: import Megatron and write the checkpoint once, then fork the
    DP=2 ranks, then the DP=1 one. Exits without interpreter teardown."""
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    import miles_core.train.trainer  # noqa: F401
    from miles_core.models.builtin import materialize_checkpoint

    hf_dir = materialize_checkpoint("builtin:tiny-gpt", 1, os.path.join(tmp, "tiny-gpt"))
    other_dir = materialize_checkpoint("builtin:tiny-gpt", 2, os.path.join(tmp, "tiny-gpt-2"))
    os.environ.update(strict.ENV)  # NCCL's device rule on the ranks' gloo groups
    fork_ranks(_dp2, [(r, hf_dir, other_dir, tmp) for r in range(2)], timeout=RANKS_SECONDS)
    fork_ranks(_dp1, [(hf_dir, tmp)], timeout=RANKS_SECONDS)
    exit_launcher(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distopt")
    run_launcher(_launch, str(tmp), 600, "the trainer processes")
    return [torch.load(tmp / f"dp2_rank{r}.pt") for r in range(2)], torch.load(tmp / "dp1.pt")


def _same(a: dict, b: dict, rtol=RTOL, atol=ATOL, weights_atol=None) -> None:
    assert len(a["metrics"]) == len(b["metrics"])
    for ma, mb in zip(a["metrics"], b["metrics"]):
        assert set(ma) == set(mb)
        for k in ma:
            assert mb[k] == pytest.approx(ma[k], rel=rtol, abs=atol), (k, ma[k], mb[k])
    for k, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][k], w, rtol=rtol, atol=weights_atol or atol, msg=lambda m: f"{k}: {m}")


def _tail(run: dict) -> dict:
    """Steps 1.. of an uninterrupted run (what a resumed run trains)."""
    return {"metrics": run["metrics"][1:], "weights": run["weights"]}


def test_distributed_optimizer_makes_the_torch_path_update(runs):
    dp2, _ = runs
    for rank in dp2:  # Adam turns a near-zero gradient's rounding into a step of up to lr (1e-2) x its sign
        _same(rank["torch"], rank["dist"], weights_atol=1e-4)
    assert dp2[0]["dist"]["metrics"][-1]["train/grad_norm"] > 0


def test_distributed_optimizer_checkpoint_resumes_to_the_same_steps_at_dp2_and_dp1(runs):
    dp2, dp1 = runs
    for rank in dp2:
        _same(_tail(rank["dist"]), rank["dist_resumed"], rtol=1e-6, atol=1e-7)
    per_rank = ("train/micro_batches", "train/padding_fraction")  # one rank's layout: DP=1 runs twice as many
    strip = lambda run: {**run, "metrics": [{k: v for k, v in m.items() if k not in per_rank} for m in run["metrics"]]}
    _same(strip(_tail(dp2[0]["dist"])), strip(dp1), weights_atol=1e-4)  # the reduce order differs (Adam, above)


def test_the_restored_optimizer_state_matters(runs):
    dp2, _ = runs
    want, got = dp2[0]["dist"]["weights"], dp2[0]["weights_only"]["weights"]
    assert max(float((got[k] - want[k]).abs().max()) for k in want) > 1e-4


def test_bf16_on_cpu_checkpoint_round_trip_and_close_to_fp32(runs):
    dp2, _ = runs
    for rank in dp2:
        _same(_tail(rank["bf16"]), rank["bf16_resumed"], rtol=1e-6, atol=1e-7)
    fp32, bf16 = dp2[0]["torch"]["metrics"][0], dp2[0]["bf16"]["metrics"][0]
    for k in ("train/loss", "train/grad_norm"):
        assert bf16[k] == pytest.approx(fp32[k], rel=3e-2, abs=1e-3), (k, fp32[k], bf16[k])


def test_weights_loaded_after_build_are_what_the_next_step_keeps(runs):
    """Megatron's fp32 main weights follow weights loaded into a built trainer (--ref-load's HF
    weights, a --load of another run's weights): an lr=0 step keeps them, not the initial ones."""
    dp2, _ = runs
    for rank in dp2:
        for case in rank["reload"]:
            moved = max(float((case["loaded"][k] - case["before"][k]).abs().max()) for k in case["before"])
            assert moved > 1e-2  # another checkpoint
            for k, w in case["loaded"].items():
                torch.testing.assert_close(case["after"][k], w, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
