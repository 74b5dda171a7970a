"""The trainer's CUDA-only paths (run on a GPU machine: `tests/gpu/check.sh`; deselected in CI).

What CPU tests cannot reach: bf16 Megatron DDP summing gradients over DP ranks over NCCL
(`calculate_per_token_loss`), Megatron's mixed-precision optimizer (a `ChainedOptimizer` of
`Float16OptimizerWithFloat16Params` in megatron-core 0.16.1) and its checkpoint round trip through
`state_dict()` / `load_state_dict()`, and the distributed weight push over NCCL.

The one-GPU case runs in-process (no Ray: the device machine has none) and fits one H200; the
two-rank case needs >= 2 GPUs and Ray. Tolerances are bf16's: parameters within 2e-2 absolute
after one step, losses within 1e-2 relative across rank counts, 1e-3 for a resume.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.config import parse_flags
from miles_core.models.builtin import materialize_checkpoint
from miles_core.models.safetensors_dir import load_safetensors_dir
from miles_core.weights.snapshot import seal_uri
from tests.unit.test_train import make_groups

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module", autouse=True)
def cuda_present():
    if not GPUS:
        pytest.fail("the gpu suite needs CUDA (run it with tests/gpu/check.sh on a GPU machine)")


def _cfg(tmp, ranks, tp=1, save="", extra=()):
    return parse_flags(["--preset", "tiny-reverse4", "--run-id", "gpu", "--storage-root", f"file://{tmp}", "--engine-backend", "sglang",
                        "--actor-num-gpus-per-node", str(ranks), "--tensor-model-parallel-size", str(tp),
                        "--save", save, "--save-interval", "none", "--eval-interval", "none", *extra,
                        "--eval-prompt-data"])


def _weights(group, out):
    """The exported weights (written in parts by the ranks holding the whole model; sealed as the driver does)."""
    if not group.export_hf(0, f"file://{out}").result():
        seal_uri(f"file://{out}")
    assert (out / ".complete").exists()
    return load_safetensors_dir(str(out))


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl_matches_one_rank_and_checkpoint_resumes(tmp_path):
    pytest.importorskip("ray")
    from miles_core.driver.placement import TrainerGroup, ensure_ray

    ensure_ray()
    hf = "file://" + materialize_checkpoint("builtin:tiny-llama", 5, str(tmp_path / "hf"))
    ckpt = f"file://{tmp_path}/ckpt"
    b0, b1 = make_groups(n_groups=4, seed=0), make_groups(n_groups=4, seed=1)
    one = TrainerGroup(_cfg(tmp_path, 1, save=ckpt), hf, [])
    try:
        m1 = one.train_step(0, b0).result()
        w1 = _weights(one, tmp_path / "w1")
    finally:
        one.shutdown()
    two = TrainerGroup(_cfg(tmp_path, 2, save=ckpt), hf, [])
    try:
        m2 = two.train_step(0, b0).result()
        w2 = _weights(two, tmp_path / "w2")
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-2)
        assert max(float((w1[k].float() - w2[k].float()).abs().max()) for k in w1) < 2e-2
        two.save_checkpoint(0, {}).result()  # the ChainedOptimizer's state_dict, per TP rank
        loss_next = two.train_step(1, b1).result()["train/loss"]
    finally:
        two.shutdown()
    again = TrainerGroup(_cfg(tmp_path, 2, save=ckpt), hf, [])
    try:
        assert again.restore_latest().result()[0] == 0
        assert again.train_step(1, b1).result()["train/loss"] == pytest.approx(loss_next, rel=1e-2)
    finally:
        again.shutdown()


@pytest.mark.parametrize("flags, inner", [((), "Float16OptimizerWithFloat16Params"),
                                          (("--use-distributed-optimizer",), "DistributedOptimizer")])
def test_one_gpu_rank_trains_and_its_checkpoint_resumes(tmp_path, flags, inner):
    """Megatron DDP + the ChainedOptimizer on one GPU, in this process: a step moves the weights,
    and a fresh trainer restored from the checkpoint (optimizer `state_dict()` as safetensors +
    JSON; with --use-distributed-optimizer the parameter state gathered onto DP rank 0, here a DP
    group of one) makes the same next two steps (the second one reads the restored Adam moments)."""
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.trainer import Trainer

    hf = materialize_checkpoint("builtin:tiny-llama", 5, str(tmp_path / "hf"))
    mgr = CheckpointManager(Store(f"file://{tmp_path}/ckpt"))
    train = _cfg(tmp_path, 1, extra=flags).train
    b0, b1, b2 = (make_groups(n_groups=4, seed=s) for s in range(3))
    with Trainer(train, hf, seed=1) as first:
        assert [type(o).__name__ for o in first.optimizer.chained_optimizers] == [inner]
        before = {k: v.detach().clone() for k, v in first.hf_state_dict().items()}
        assert first.train_step(0, b0)["train/grad_norm"] > 0
        after = first.hf_state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        mgr.save(0, first, {})
        expected = [first.train_step(1, b1)["train/loss"], first.train_step(2, b2)["train/loss"]]
    with Trainer(train, hf, seed=9) as again:
        assert mgr.load(mgr.latest(), again) is not None
        got = [again.train_step(1, b1)["train/loss"], again.train_step(2, b2)["train/loss"]]
    assert got == pytest.approx(expected, rel=1e-3)
