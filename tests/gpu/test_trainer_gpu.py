"""The trainer's CUDA-only paths (run on a GPU machine: `tests/gpu/check.sh`; deselected in CI).

What CPU tests cannot reach: bf16 Megatron DDP summing gradients over DP ranks over NCCL
(`calculate_per_token_loss`), Megatron's mixed-precision optimizer (a `ChainedOptimizer` in
megatron-core 0.16.1) and its checkpoint round trip through `state_dict()` / `load_state_dict()`,
and the distributed weight push over NCCL. Needs >= 2 GPUs for the two-rank cases.

Tolerances are bf16's: parameters within 2e-2 absolute after one step, losses within 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from safetensors.torch import load_file

from miles_core.cluster import TrainerGroup, ensure_ray
from miles_core.config import parse_flags
from miles_core.models.builtin import materialize_checkpoint
from tests.unit.test_train import make_groups

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module", autouse=True)
def ray_up():
    if not GPUS:
        pytest.fail("the gpu suite needs CUDA (run it with tests/gpu/check.sh on a GPU machine)")
    ensure_ray()


def _cfg(tmp, ranks, tp=1, save=""):
    return parse_flags(["--run-id", "gpu", "--storage-root", f"file://{tmp}", "--engine-backend", "sglang",
                        "--actor-num-gpus-per-node", str(ranks), "--tensor-model-parallel-size", str(tp),
                        "--save", save, "--save-interval", "none", "--eval-interval", "none",
                        "--eval-prompt-data"])


def _weights(group, out):
    group.call("export_hf", 0, f"file://{out}").result()
    return load_file(f"{out}/model.safetensors")


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl_matches_one_rank_and_checkpoint_resumes(tmp_path):
    hf = "file://" + materialize_checkpoint("builtin:tiny-llama", 5, str(tmp_path / "hf"))
    ckpt = f"file://{tmp_path}/ckpt"
    b0, b1 = make_groups(n_groups=4, seed=0), make_groups(n_groups=4, seed=1)
    one = TrainerGroup(_cfg(tmp_path, 1, save=ckpt), hf, [])
    try:
        m1 = one.call("train_step", 0, b0).result()
        w1 = _weights(one, tmp_path / "w1")
    finally:
        one.shutdown()
    two = TrainerGroup(_cfg(tmp_path, 2, save=ckpt), hf, [])
    try:
        m2 = two.call("train_step", 0, b0).result()
        w2 = _weights(two, tmp_path / "w2")
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-2)
        assert max(float((w1[k].float() - w2[k].float()).abs().max()) for k in w1) < 2e-2
        two.call("save_checkpoint", 0, {}).result()  # the ChainedOptimizer's state_dict, per TP rank
        loss_next = two.call("train_step", 1, b1).result()["train/loss"]
    finally:
        two.shutdown()
    again = TrainerGroup(_cfg(tmp_path, 2, save=ckpt), hf, [])
    try:
        assert again.call("restore_latest").result()[0] == 0
        assert again.call("train_step", 1, b1).result()["train/loss"] == pytest.approx(loss_next, rel=1e-2)
    finally:
        again.shutdown()


def test_one_gpu_rank_trains_and_its_checkpoint_resumes(tmp_path):
    """Megatron DDP + the ChainedOptimizer on one GPU: a step moves the weights, and a fresh rank
    restored from the checkpoint (optimizer `state_dict()` as safetensors + JSON) makes the same
    next step."""
    hf = "file://" + materialize_checkpoint("builtin:tiny-llama", 5, str(tmp_path / "hf"))
    ckpt = f"file://{tmp_path}/ckpt"
    b0, b1 = make_groups(n_groups=4, seed=0), make_groups(n_groups=4, seed=1)
    first = TrainerGroup(_cfg(tmp_path, 1, save=ckpt), hf, [])
    try:
        m0 = first.call("train_step", 0, b0).result()
        assert m0["train/grad_norm"] > 0
        first.call("save_checkpoint", 0, {}).result()
        loss_next = first.call("train_step", 1, b1).result()["train/loss"]
    finally:
        first.shutdown()
    again = TrainerGroup(_cfg(tmp_path, 1, save=ckpt), hf, [])
    try:
        assert again.call("restore_latest").result()[0] == 0
        assert again.call("train_step", 1, b1).result()["train/loss"] == pytest.approx(loss_next, rel=1e-3)
    finally:
        again.shutdown()
