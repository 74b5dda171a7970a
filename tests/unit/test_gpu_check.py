"""bench/gpu_check.py's CPU smoke mode: every phase of the prepared GPU check runs in CI.

Pins: the script builds the trainer on a random Llama, trains, checkpoints, restores into a fresh
trainer with exactly the same next two losses (CPU: fp32, torch AdamW), times a transformers
baseline on the same batches, and writes its JSON summary. The CUDA-only parts (Megatron DDP, the
ChainedOptimizer) are what it adds on the device machine (tests/gpu/check.sh).
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    return runpy.run_path(str(ROOT / "bench" / "gpu_check.py"), run_name="gpu_check")


def test_cpu_smoke_runs_every_phase(gpu_check, tmp_path, capsys):
    assert gpu_check["main"](["--cpu-smoke", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["resume_ok"] and summary["resume_rel_diff"] <= 1e-6
    assert summary["losses_uninterrupted"] == pytest.approx(summary["losses_resumed"], rel=1e-6)
    assert summary["megatron_tokens_per_s"] > 0 and summary["transformers_tokens_per_s"] > 0
    assert summary["optimizer"] == "AdamW" and summary["device"] == "cpu"
    assert "ratio" in capsys.readouterr().out


def test_without_cuda_the_gpu_mode_refuses(gpu_check, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real check")
    assert gpu_check["main"]([]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err


def test_gpu_plan_is_about_half_a_billion_parameters(gpu_check):
    """The device check's model is the ~0.5B Llama the issue asks for (counted from its shapes)."""
    m = gpu_check["LLAMA_05B"]
    h, f, layers, v = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * v * h + h
    assert 0.4e9 < n < 0.6e9
