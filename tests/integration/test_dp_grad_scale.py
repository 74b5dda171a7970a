"""Data parallelism makes exactly the DP=1 gradient (miles_core.train.trainer + data_parallel), not a
rescaled one: the real CPU Trainer on builtin:tiny-gpt at DP=2 (two processes, torch.distributed over
gloo) and at DP=1 (the same trainer with its DP state set to one rank, before the DP=2 step; lr=0
so both gradients are taken at the same weights), on the same global batch.

Pins: after one `train_step`, every parameter's gradient on each DP=2 rank equals the DP=1
gradient (the loss of each micro-batch is divided by the *global* token count and gradients are
*summed* over DP ranks), and `train/grad_norm` at DP=2 equals DP=1's; both DP ranks hold the same
gradients. The clip is set far above the norm so the gradients compared are the raw reduced ones.

Guards: gradients averaged over DP ranks instead of summed (DP=2 norm half of DP=1's), or any
other uniform scale (each rank normalising by its own shard's token count, a reduce that divides
by the world size). The DP comparison in tests/integration/test_trainer_ranks.py checks parameters
after one AdamW step, which is nearly invariant to a uniform gradient scale, so it misses these.
The batch has uneven sample lengths, so the two shards hold different token counts. The ranks run
under the strict device harness, so a DP collective handed a CPU tensor that NCCL would refuse on GPU
fails here too (miles_core.train.collectives).
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.ranks import exit_launcher, run_launcher
from tests.support import strict_device as strict

DP = 2
RTOL, ATOL = 1e-5, 1e-7  # fp32 on CPU; only the order of summation differs between layouts


def _groups():
    """A global batch of 4 prompt groups x 4 samples with response lengths 1..6 (uneven shards)."""
    from miles_core.models.builtin import SEP_ID
    from miles_core.samples import Group, Sample, SampleStatus

    rng = random.Random(7)
    groups = []
    for g in range(4):
        prompt = [rng.randrange(10) for _ in range(4)] + [SEP_ID]
        samples = []
        for i in range(4):
            resp = [rng.randrange(13) for _ in range(rng.randint(1, 6))]
            samples.append(Sample(f"g{g}", g, i, prompt, resp, [-2.5] * len(resp), [1] * len(resp),
                                  [1] * len(resp), reward=rng.random(), status=SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def _grads(tr) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


def _worker(rank: int, hf_dir: str, tmp: str) -> None:
    """One rank of a DP=2 trainer. It first trains the batch as a DP=1 trainer would (the Trainer's
    data-parallel state is exactly dp_size/dp_rank/dp_group: 1, 0, None at DP=1), then as DP rank
    `rank` of 2. lr=0 leaves the weights unchanged, so both gradients are taken at the same point."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=DP)
    from miles_core.config.sections import TrainSection
    from miles_core.train import collectives
    from miles_core.train.trainer import Trainer

    cfg = dataclasses.replace(TrainSection(), lr=0.0, clip_grad=1e9, micro_batch_size=3)
    with Trainer(cfg, hf_dir) as tr:
        assert (tr.dp_size, tr.dp_rank) == (DP, rank) and tr.dp_group is not None
        assert collectives.standing_device(tr.dp_group) == "cuda"  # the DP group stands for NCCL
        dp_state = tr.dp_size, tr.dp_rank, tr.dp_group
        tr.dp_size, tr.dp_rank, tr.dp_group = 1, 0, None
        one = {"metrics": tr.train_step(0, _groups()), "grads": _grads(tr)}
        tr.dp_size, tr.dp_rank, tr.dp_group = dp_state
        two = {"metrics": tr.train_step(0, _groups()), "grads": _grads(tr)}
    torch.save({"dp1": one, "dp2": two}, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp: str) -> None:
    """In a fresh (spawned) process: import Megatron and write the checkpoint once (the slow part),
    single-threaded, then fork the DP ranks, which inherit both. No process group exists before the
    fork. Exits without interpreter teardown (seconds of it) once the ranks are done."""
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    import miles_core.train.trainer  # noqa: F401
    from miles_core.models.builtin import materialize_checkpoint

    hf_dir = materialize_checkpoint("builtin:tiny-gpt", 1, os.path.join(tmp, "tiny-gpt"))
    os.environ.update(strict.ENV)  # NCCL's device rule on the ranks' gloo groups
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=_worker, args=(r, hf_dir, tmp)) for r in range(DP)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    codes = [p.exitcode for p in ranks]
    for p in ranks:
        if p.is_alive():
            p.kill()
    if codes != [0] * DP:
        raise RuntimeError(f"DP rank processes exited with {codes}")
    exit_launcher(0)


def test_dp2_gradient_is_the_dp1_gradient_not_a_rescaled_one(tmp_path):
    """Pins DP=2 gradients and grad norm == DP=1's on the same global batch; guards against
    gradients averaged (or otherwise uniformly rescaled) over DP ranks instead of summed."""
    run_launcher(_launch, str(tmp_path), 180, "the DP=2 trainer processes")
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DP)]
    one, ranks = saved[0]["dp1"], [s["dp2"] for s in saved]

    from miles_core.rank_batches import shard

    samples = [s for g in _groups() for s in g.samples]  # every one trainable, all tokens in the loss
    shard_tokens = [sum(len(s.response_ids) for s in shard(samples, DP, r, False)) for r in range(DP)]
    assert shard_tokens[0] != shard_tokens[1], shard_tokens  # a per-shard normalisation would show
    for name, g in one["grads"].items():  # the DP=1 reference is the same on both ranks
        assert torch.equal(saved[1]["dp1"]["grads"][name], g)

    n1 = one["metrics"]["train/grad_norm"]
    assert n1 > 0 and one["metrics"]["train/samples"] == 16
    for r, two in enumerate(ranks):
        n2 = two["metrics"]["train/grad_norm"]
        assert n2 == pytest.approx(n1, rel=RTOL), (
            f"DP=2 rank {r} grad norm {n2:.6g} vs DP=1 {n1:.6g} (ratio {n2 / n1:.4f}; 0.5 = averaged over DP)")
        assert set(two["grads"]) == set(one["grads"])
        for name, g1 in one["grads"].items():
            torch.testing.assert_close(two["grads"][name], g1, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    for name in ranks[0]["grads"]:  # the reduce leaves every rank with the same gradient
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name])
