"""The 3-digit sums of the calculator preset (miles_core.rollout.sums3) and the preset itself.

Pins: the held-out splits share no pair and no wording with the training splits (so the held-out score
is about carrying a skill to new wordings, not recall); the tool splits are chat messages with the
tool's format and one demonstration whose call the calculator answers with the demonstration's own
answer; the no-tool splits are the same questions in plain text; the preset runs miles' agentic
recipe shape (fully async, sample-granular submission, engines paused in place, chat template, the
calculator episode) and evaluates on the held-out split.
"""

from __future__ import annotations

import json

from miles_core.config import parse_flags
from miles_core.rollout import sums3
from miles_core.rollout.builtin_tasks import builtin_rows
from miles_core.rollout.calculator_tool import find_call, tool_result


def test_heldout_splits_share_no_pair_and_no_wording_with_training():
    train, held = builtin_rows("builtin:calc3"), builtin_rows("builtin:calc3-heldout")
    assert (len(train), len(held)) == (sums3.TRAIN_SIZE, sums3.HELDOUT_SIZE)
    pair = lambda r: (r["metadata"]["a"], r["metadata"]["b"])  # noqa: E731
    assert not {pair(r) for r in train} & {pair(r) for r in held}
    assert not set(sums3.TRAIN_FORMS) & set(sums3.HELDOUT_FORMS)
    for rows, forms in ((train, sums3.TRAIN_FORMS), (held, sums3.HELDOUT_FORMS)):
        assert {r["metadata"]["form"] for r in rows} == set(range(len(forms)))
        assert all(r["prompt"][-1]["content"] == forms[r["metadata"]["form"]].format(a=r["metadata"]["a"],
                   b=r["metadata"]["b"]) for r in rows)
    assert all(100 <= r["metadata"]["a"] <= 999 and r["label"] == str(r["metadata"]["a"] + r["metadata"]["b"])
               for r in train + held)


def test_tool_rows_are_messages_with_the_format_and_a_demonstration_the_tool_confirms():
    row = builtin_rows("builtin:calc3-heldout")[0]
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert "<tool_call>" in row["prompt"][0]["content"]
    call = find_call(row["prompt"][2]["content"])
    assert tool_result(call) == json.loads(row["prompt"][3]["content"]) == {"result": int(row["prompt"][4]["content"])}
    a, b = row["metadata"]["a"], row["metadata"]["b"]
    assert row["prompt"][-1]["content"] == sums3.HELDOUT_FORMS[row["metadata"]["form"]].format(a=a, b=b)


def test_no_tool_rows_are_the_same_questions_as_text():
    tool, plain = builtin_rows("builtin:calc3-heldout"), builtin_rows("builtin:sum3-heldout")
    assert [r["label"] for r in tool] == [r["label"] for r in plain]
    assert all(p["prompt"] == t["prompt"][-1]["content"] + sums3.NO_TOOL_SUFFIX for t, p in zip(tool, plain))
    assert all(p["task"] == "arith" for p in plain)


def test_the_calculator_preset_is_miles_agentic_recipe_shape():
    cfg = parse_flags(["--preset", "smollm2-calculator"])
    r = cfg.rollout
    assert r.custom_generate_function_path == "miles_core.rollout.calculator_tool:calculator_episode"
    assert cfg.run.fully_async and cfg.data.apply_chat_template and r.pause_generation_mode == "in_place"
    assert cfg.submission_granularity == "sample" and cfg.data.prompt_data == "builtin:calc3"
    assert cfg.eval.eval_prompt_data == ["heldout=builtin:calc3-heldout"]
    assert parse_flags(["--preset", "smollm2-arith", "--prompt-data", "builtin:sum3"]).eval.eval_prompt_data == [
        "heldout=builtin:sum3-heldout"]
