"""A trainer of many ranks (docs/training.md), for real: Ray actors, torch.distributed over gloo, Megatron
parallel state, on CPU.

Pins: DP=2 makes the same update as DP=1 on the same batch (the loss is normalised by the global
token count and gradients are summed over DP), with and without --balance-data; TP=2 computes the
same log-probs as TP=1 and, gathered, the same parameters after a step; a DP=2 checkpoint resumes
at DP=2 and at DP=1 with the same next-step loss; a TP=2 checkpoint is refused at TP=1 with an
error naming the flag; a TP=2 trainer pushes its gathered weights over the distributed transport
(gloo, several buckets) into a real CPU engine, whose greedy log-probs then equal the trainer's.
Every rank runs under the strict device harness: a trainer collective handed a tensor NCCL would refuse
on GPU fails here too (miles_core.train.collectives).

Tolerances (fp32 on CPU; only the order of summation differs between layouts): parameters after one
AdamW step (lr 2e-3) agree within 2e-5 absolute, log-probs within 1e-4, losses within 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles_core.config import parse_flags
from miles_core.driver.placement import TrainerGroup
from miles_core.models.builtin import materialize_checkpoint
from miles_core.models.safetensors_dir import load_safetensors_dir
from miles_core.weights.snapshot import seal_uri
from miles_core.train import collectives
from tests.support import strict_device as strict
from tests.support.timeouts import ENGINE_START_SECONDS
from tests.unit.test_train import make_groups

UNPLACEABLE_SECONDS = 2  # a placement that cannot fit: the bound passing is the answer under test

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("strict_device", "ray_local")]

PARAM_ATOL, LOGP_ATOL, LOSS_RTOL = 2e-5, 1e-4, 1e-5


def _cfg(tmp, ranks: int, tp: int = 1, save: str = "", balance: bool = False, extra: tuple = ()):
    flags = [*extra, "--run-id", "ranks", "--storage-root", f"file://{tmp}", "--actor-num-gpus-per-node", str(ranks),
             "--tensor-model-parallel-size", str(tp), "--num-cpus-trainer", "0.25", "--micro-batch-size", "3",
             "--save", save or "", "--save-interval", "none"]
    return parse_flags(["--preset", "tiny-reverse4", *flags + (["--balance-data"] if balance else [])])


def _weights(group: TrainerGroup, out) -> dict[str, torch.Tensor]:
    """The exported weights (written in parts by the ranks holding the whole model; sealed as the driver does)."""
    if not group.export_hf(0, f"file://{out}").result():
        seal_uri(f"file://{out}")
    assert (out / ".complete").exists()
    return load_safetensors_dir(str(out))


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def strict_device():
    """NCCL's device rule on the ranks' gloo groups (tests/support/strict_device.py, through the rank
    setup hook): set before Ray starts, so every rank process inherits it."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in strict.ENV.items():
            mp.setenv(k, v)
        yield


def _assert_strict(group: TrainerGroup) -> None:
    """Every rank enforces the rule on its world, DP and TP groups (a CPU tensor there is refused)."""
    import ray

    def declared(worker) -> list:
        tr = worker.trainer
        mine = [g for g in (tr.dp_group, tr.tp_group) if g is not None]
        return [collectives.standing_device(g) for g in [None, *mine]]  # None: the world

    found = ray.get([a.__ray_call__.remote(declared) for a in group.actors])
    assert all(set(f) == {"cuda"} for f in found), (
        f"declared devices per rank {found}: {strict.RANK_SETUP_ENV} did not reach the ranks (Ray started earlier?)")


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return "file://" + materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path_factory.mktemp("tiny-gpt")))


@pytest.fixture(scope="module")
def tiny_llama16(tmp_path_factory):
    """A Llama (RoPE, GQA, SwiGLU) whose vocabulary and heads divide by 2, for TP=2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    out = str(tmp_path_factory.mktemp("llama16"))
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return f"file://{out}"


def test_data_parallel_matches_one_rank_and_checkpoints_resume_at_any_dp_size(tmp_path, tiny_gpt):
    ckpt = f"file://{tmp_path}/ckpt"
    batch0, batch1 = make_groups(n_groups=5, seed=0), make_groups(n_groups=5, seed=1)
    one = TrainerGroup(_cfg(tmp_path, 1, save=ckpt), tiny_gpt, [])
    two = TrainerGroup(_cfg(tmp_path, 2, save=ckpt), tiny_gpt, [])
    balanced = TrainerGroup(_cfg(tmp_path, 2, save=ckpt, balance=True), tiny_gpt, [])
    try:
        _assert_strict(two)
        m1 = one.train_step(0, batch0).result()
        m2 = two.train_step(0, batch0).result()
        mb = balanced.train_step(0, batch0).result()
        w1 = _weights(one, tmp_path / "w1")
        d2, db = _max_diff(w1, _weights(two, tmp_path / "w2")), _max_diff(w1, _weights(balanced, tmp_path / "wb"))
        print(f"DP=2 vs DP=1 max |param diff| {d2:.2e}, with --balance-data {db:.2e}")
        assert d2 < PARAM_ATOL and db < PARAM_ATOL
        # Each DP rank (a whole replica) wrote half of the export, at once; one rank wrote it whole.
        parts = {p.name: p.stat().st_size for p in (tmp_path / "w2").glob("*.safetensors")}
        assert sorted(parts) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], parts
        assert max(parts.values()) < 0.75 * sum(parts.values())
        assert [p.name for p in (tmp_path / "w1").glob("*.safetensors")] == ["model.safetensors"]
        for m in (m2, mb):  # metrics are global sums over DP, not rank 0's shard
            assert m["train/loss"] == pytest.approx(m1["train/loss"], rel=LOSS_RTOL)
            assert m["train/samples"] == m1["train/samples"] and m["train/tokens"] == m1["train/tokens"]

        two.save_checkpoint(0, {"weight_version": 1}).result()
        loss_next = two.train_step(1, batch1).result()["train/loss"]
        assert one.restore_latest().result()[0] == 0  # DP=2 checkpoint -> DP=1
        assert one.train_step(1, batch1).result()["train/loss"] == pytest.approx(loss_next, rel=LOSS_RTOL)
        assert _max_diff(_weights(one, tmp_path / "w1b"), _weights(two, tmp_path / "w2b")) < PARAM_ATOL
        # DP=2 -> DP=2 in other processes (the balanced group's: they never saw the checkpoint's state)
        assert balanced.restore_latest().result()[0] == 0
        assert balanced.train_step(1, batch1).result()["train/loss"] == pytest.approx(loss_next, rel=LOSS_RTOL)
    finally:
        for g in (one, two, balanced):
            g.shutdown()


def test_tensor_parallel_matches_one_rank_and_refuses_a_tp_change(tmp_path, tiny_llama16):
    from miles_core.samples import Sample

    ckpt = f"file://{tmp_path}/ckpt"
    batch = make_groups(n_groups=4, seed=2)
    probe = [Sample("p", 0, 0, [1, 2, 3, 4, 10], [5, 6, 7, 11], [], [], [1] * 4)]
    one = TrainerGroup(_cfg(tmp_path, 1, save=ckpt), tiny_llama16, [])
    tp2 = TrainerGroup(_cfg(tmp_path, 2, tp=2, save=ckpt), tiny_llama16, [])
    try:
        _assert_strict(tp2)
        lp1 = one.logprobs(probe).result()[0]
        lp2 = tp2.logprobs(probe).result()[0]
        dl = max(abs(a - b) for a, b in zip(lp1, lp2))
        assert dl < LOGP_ATOL
        m1 = one.train_step(0, batch).result()
        m2 = tp2.train_step(0, batch).result()
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-4)
        dp = _max_diff(_weights(one, tmp_path / "w1"), _weights(tp2, tmp_path / "w2"))
        print(f"TP=2 vs TP=1 max |logprob diff| {dl:.2e}, max |param diff| after a step {dp:.2e}")
        assert dp < PARAM_ATOL
        tp2.save_checkpoint(0, {}).result()
        listed = json.loads((tmp_path / "ckpt" / "step_00000000" / "COMPLETE").read_text())["files"]
        assert {f"{part}.tp{r:02d}.{ext}" for r in (0, 1) for part, ext in
                (("model", "safetensors"), ("optimizer", "safetensors"), ("trainer", "json"), ("files", "json"))} \
            <= set(listed)  # every TP rank's files, with their sizes and checksums
        with pytest.raises(Exception, match="tensor-model-parallel-size"):
            one.restore_latest().result()
    finally:
        for g in (one, tp2):
            g.shutdown()


def test_tp2_trainer_pushes_gathered_weights_to_an_engine_over_the_distributed_transport(tmp_path, tiny_llama16):
    import asyncio

    from miles_core.engines.client import EngineClient
    from miles_core.engines.launcher import EngineFleet, EngineLaunchSpec
    from miles_core.samples import Sample

    fleet = EngineFleet(EngineLaunchSpec("cpu", tiny_llama16, startup_timeout_seconds=ENGINE_START_SECONDS), 1,
                        num_cpus_per_engine=0.25).start()
    cfg = _cfg(tmp_path, 2, tp=2, extra=("--weight-transport", "distributed", "--update-weight-buffer-size", "16384"))
    group = TrainerGroup(cfg, tiny_llama16, fleet.urls(), fleet.actor_handles())
    url = fleet.urls()[0]

    async def greedy():
        async with EngineClient([url]) as c:
            res = await c.generate([1, 2, 3, 4, 10], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
            return res, (await c.model_info(url))["weight_version"]

    try:
        group.train_step(0, make_groups(n_groups=4, seed=2)).result()
        assert group.push_weights(0, 1).result()["delivered"]
        res, version = asyncio.run(greedy())
        assert version == "1"
        probe = [Sample("p", 0, 0, [1, 2, 3, 4, 10], list(res.output_ids), [], [], [1] * len(res.output_ids))]
        trainer_lp = group.logprobs(probe).result()[0]
        assert max(abs(a - b) for a, b in zip(trainer_lp, res.output_logprobs)) < LOGP_ATOL
    finally:
        group.shutdown()
        fleet.shutdown()


def test_a_trainer_that_cannot_be_placed_is_refused_with_what_is_free(tmp_path, tiny_gpt):
    from miles_core.driver.placement import TrainerPlacementError

    cfg = parse_flags(["--preset", "tiny-reverse4", "--run-id", "big", "--storage-root", f"file://{tmp_path}", "--actor-num-gpus-per-node", "8",
                       "--num-cpus-trainer", "1", "--save", "", "--save-interval", "none"])
    with pytest.raises(TrainerPlacementError, match="8 ranks .* could not be placed within 2 s"):
        TrainerGroup(cfg, tiny_gpt, [], placement_timeout_seconds=UNPLACEABLE_SECONDS)


class _FirstPortTaken(TrainerGroup):
    """Rank 0's first rendezvous port is one another process listens on (as when it takes the port between
    the driver picking it free and rank 0 binding it)."""

    taken: int = 0
    tried: list

    def _rendezvous(self, rank0_options, rendezvous_address):
        where = super()._rendezvous(rank0_options, rendezvous_address)
        self.tried = [*getattr(self, "tried", []), where if getattr(self, "tried", None) else (where[0], self.taken)]
        return self.tried[-1]


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_replaced(tmp_path, tiny_gpt):
    """The ranks start again on another port (before, every rank died with EADDRINUSE and the run failed)."""
    import socket

    with socket.socket() as other:
        other.bind(("", 0))
        other.listen()
        _FirstPortTaken.taken = other.getsockname()[1]
        group = _FirstPortTaken(_cfg(tmp_path, 2), tiny_gpt, [])
        try:
            assert [port for _, port in group.tried][0] == _FirstPortTaken.taken and len(group.tried) == 2
            assert group.restore_latest().result() is None  # every rank serves calls (no checkpoint yet)
        finally:
            group.shutdown()


MEMORY_FLAGS = ("--use-distributed-optimizer", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64")


def test_memory_flags_in_ray_ranks_make_the_same_update_and_resume(tmp_path, tiny_gpt):
    """The memory-saving flags in the real rank actors (Megatron's DDP and distributed optimizer on CPU
    through cpu_shim.megatron_on_cpu, packed micro-batches): DP=2 makes the default DP=1 step, and its
    checkpoint, restored by fresh rank processes, makes the same next step."""
    ckpt = f"file://{tmp_path}/ckpt-mem"
    batch0, batch1 = make_groups(n_groups=5, seed=0), make_groups(n_groups=5, seed=1)
    one = TrainerGroup(_cfg(tmp_path, 1), tiny_gpt, [])
    two = TrainerGroup(_cfg(tmp_path, 2, save=ckpt, extra=MEMORY_FLAGS), tiny_gpt, [])
    try:
        m1 = one.train_step(0, batch0).result()
        m2 = two.train_step(0, batch0).result()
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=LOSS_RTOL)
        assert m2["train/padding_fraction"] == 0.0
        two.save_checkpoint(0, {"weight_version": 1}).result()
        loss_next = two.train_step(1, batch1).result()["train/loss"]
        weights = _weights(two, tmp_path / "mem-w")
    finally:
        one.shutdown()
        two.shutdown()
    again = TrainerGroup(_cfg(tmp_path, 2, save=ckpt, extra=MEMORY_FLAGS), tiny_gpt, [])
    try:
        assert again.restore_latest().result()[0] == 0
        assert again.train_step(1, batch1).result()["train/loss"] == pytest.approx(loss_next, rel=1e-6)
        assert _max_diff(weights, _weights(again, tmp_path / "mem-w2")) < 1e-6
    finally:
        again.shutdown()


def test_tp2_sequence_parallel_with_recompute_and_the_distributed_optimizer(tmp_path, tiny_llama16):
    """TP=2 ranks with --sequence-parallel, full recompute and Megatron's optimizer compute the TP=1 step."""
    batch = make_groups(n_groups=3, seed=4)
    extra = ("--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", "--use-distributed-optimizer")
    one = TrainerGroup(_cfg(tmp_path, 1), tiny_llama16, [])
    tp2 = TrainerGroup(_cfg(tmp_path, 2, tp=2, extra=extra), tiny_llama16, [])
    try:
        m1 = one.train_step(0, batch).result()
        m2 = tp2.train_step(0, batch).result()
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=LOSS_RTOL)
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-4)
        assert _max_diff(_weights(one, tmp_path / "t1"), _weights(tp2, tmp_path / "t2")) < PARAM_ATOL
    finally:
        one.shutdown()
        tp2.shutdown()
