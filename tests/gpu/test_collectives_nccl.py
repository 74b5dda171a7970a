"""NCCL's device rule on a real NCCL group (run on a GPU machine: `tests/gpu/check.sh`; deselected in CI):
the one-GPU case, a world of one in this process.

Pins: NCCL refuses a CPU tensor handed straight to `dist.all_reduce` (the rule strict mode simulates
on CPU, tests/unit/test_collectives.py); `miles_core.train.collectives` moves a CPU float64 tensor
(the DP metric sums) to the rank's CUDA device and back, gathers a CPU bf16 tensor back onto the
CPU, and a barrier names the rank's device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from miles_core.train import collectives

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_world(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("the gpu suite needs CUDA (run it with tests/gpu/check.sh on a GPU machine)")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_move_cpu_tensors_to_the_nccl_device_and_back(nccl_world):
    assert collectives.group_device() == torch.device("cuda", 0)
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(2, dtype=torch.float64))  # NCCL takes only CUDA tensors

    sums = torch.tensor([1.5, 2.5], dtype=torch.float64)
    assert collectives.all_reduce(sums) is sums and sums.device.type == "cpu"
    assert sums.tolist() == [1.5, 2.5]

    mine = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    parts = collectives.all_gather(mine)
    assert len(parts) == 1 and parts[0].device.type == "cpu" and torch.equal(parts[0], mine)

    collectives.barrier()
