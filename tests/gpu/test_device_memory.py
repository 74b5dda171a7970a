"""A trainer rank's memory check against the real device (run on a GPU machine: `tests/gpu/check.sh`;
deselected in CI). The CPU tests (tests/unit/test_memory_estimate.py) replace the device probe; this
one reads the GPU's own total memory, in this process, with only config.json files (no model download).

SmolLM2-135M with 2 samples of 512 tokens per micro-batch (4.8 GiB by the estimate) fits any GPU of
8 GiB; a 7B Llama at TP 1 with the default 256 samples per micro-batch of 4096 tokens needs terabytes
and fits none.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import check_device_memory
from miles_core.prepare.memory import GIB, device_memory_bytes, estimate
from tests.unit.test_memory_estimate import LLAMA_7B, SMOLLM2_135M

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_present():
    if not torch.cuda.is_available():
        pytest.fail("the gpu suite needs CUDA (run it with tests/gpu/check.sh on a GPU machine)")


def _model(tmp_path, name, hf_config) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(hf_config))
    return f"file://{tmp_path / name}"


def test_the_device_check_reads_the_gpu_and_refuses_only_what_cannot_fit(tmp_path):
    allocated = torch.cuda.memory_allocated()  # what earlier tests in this process left (512 B after the NCCL ones)
    total = device_memory_bytes()
    assert total == torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory > 0
    small = parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang", "--max-seq-len", "512", "--micro-batch-size", "2"], check=False)
    assert estimate(SMOLLM2_135M, small).total < 5 * GIB
    check_device_memory(small, _model(tmp_path, "smollm2", SMOLLM2_135M))

    absurd = parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang", "--actor-num-gpus-per-node", "1"], check=False)
    with pytest.raises(ConfigError) as refused:
        check_device_memory(absurd, _model(tmp_path, "llama7b", LLAMA_7B))
    message = str(refused.value)
    assert f"GPU has {total / GIB:.1f} GiB" in message and "the trainer needs about" in message, message
    assert "Would fit: " in message or "add trainer GPUs" in message, message
    assert torch.cuda.memory_allocated() == allocated  # the check allocates nothing on the device
