"""Eval tasks ask for what the run's engine needs: SGLang's GPUs, nothing for the CPU engine."""

from __future__ import annotations

from miles_core.config import parse_flags
from tasks.eval import eval_resources


def test_sglang_evals_request_the_engines_gpus_and_cpu_evals_none():
    sized = eval_resources(parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang", "--rollout-num-gpus-per-engine", "2"]).engine)
    assert sized["requests"].gpu == "2" and sized["limits"].gpu == "2"
    cpu = eval_resources(parse_flags(["--preset", "tiny-reverse4"]).engine)
    assert cpu["requests"].gpu is None and "limits" not in cpu
