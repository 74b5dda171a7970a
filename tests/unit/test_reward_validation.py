"""Validation refuses a run its reward cannot score, before anything starts (miles_core.prepare.scoring).

Pins: a --custom-rm-path whose signature is not the reward contract (shutil:copy; a required
keyword-only parameter; (sample, text) without needs_text) is a ConfigError naming the flag, exit 2
from `miles validate`, while the contract's shapes pass; a local dataset whose rows lack the prompt
or label column, or (with the builtin reward) carry a task it does not score, is refused naming
the flag, the rows and the fix; a custom reward or a custom generate function lifts the task rule.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from miles_core.cli import main
from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import validate
from miles_core.rollout.rewards import signature_problem

MODULE = "reward_validation_mod"


@pytest.fixture
def rewards(monkeypatch):
    mod = types.ModuleType(MODULE)
    mod.per_sample = lambda sample: 1.0
    mod.keyword_only = lambda sample, *, scale: 1.0

    def with_text(sample, text):
        return 1.0

    def batched(samples, texts, extra=None):
        return [1.0] * len(samples)

    batched.batched = batched.needs_text = True
    mod.with_text, mod.batched = with_text, batched
    mod.with_text_declared = types.FunctionType(with_text.__code__, {}, "with_text_declared")
    mod.with_text_declared.needs_text = True
    monkeypatch.setitem(sys.modules, MODULE, mod)
    return mod


def _problems(flags: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(parse_flags(["--preset", "tiny-reverse4", *flags]))
    return str(info.value)


def test_shutil_copy_is_refused_by_validate(capsys):
    """Guards: `--custom-rm-path shutil:copy` passing validate and failing only at run start."""
    assert main(["validate", "--preset", "tiny-reverse4", "--custom-rm-path", "shutil:copy"]) == 2
    err = capsys.readouterr().err
    assert "--custom-rm-path: 'shutil:copy' must take (sample)" in err and "(src, dst" in err


@pytest.mark.parametrize("name,ok", [("per_sample", True), ("with_text_declared", True), ("batched", True),
                                     ("keyword_only", False), ("with_text", False)])
def test_the_signature_rule(rewards, name, ok):
    flags = ["--custom-rm-path", f"{MODULE}:{name}"]
    if ok:
        validate(parse_flags(["--preset", "tiny-reverse4", *flags]))
        assert signature_problem(getattr(rewards, name)) is None
    else:
        assert f"--custom-rm-path: '{MODULE}:{name}' must take" in _problems(flags)


def _write(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_the_builtin_reward_cannot_score_are_refused(tmp_path):
    data = _write(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1", "task": "math"},
                                          {"prompt": "b", "label": "2"}, {"prompt": "c", "label": "3", "task": "poem"}])
    message = _problems(["--prompt-data", data])
    assert f"--prompt-data='{data}': rows with a task the builtin reward does not score" in message
    assert "line 2: task ''; line 3: task 'poem'" in message and "--custom-rm-path" in message
    heldout = _problems(["--eval-prompt-data", f"mine={data}"])
    assert f"--eval-prompt-data mine='{data}'" in heldout


def test_a_custom_reward_or_generate_function_lifts_the_task_rule(tmp_path, rewards):
    data = _write(tmp_path / "p.jsonl", [{"prompt": "1 2", "label": "1", "task": "poem"}, {"prompt": "3 4", "label": "2"}])
    validate(parse_flags(["--preset", "tiny-reverse4", "--prompt-data", data, "--custom-rm-path", f"{MODULE}:per_sample"]))
    validate(parse_flags(["--preset", "tiny-reverse4", "--prompt-data", data, "--custom-generate-function-path",
                          "miles_core.rollout.calculator_tool:calculator_episode"]))


def test_rows_without_the_prompt_or_label_column_are_refused(tmp_path, rewards):
    data = _write(tmp_path / "p.jsonl", [{"question": "1 2", "answer": "1"}] * 5)  # digits: what the tiny model reads
    message = _problems(["--prompt-data", data, "--custom-rm-path", f"{MODULE}:per_sample"])
    assert "rows with no prompt column 'prompt' (line 1; line 2; line 3, ... (5 rows)): set --input-key" in message
    assert "no label column 'label'" in message and "--label-key" in message
    validate(parse_flags(["--preset", "tiny-reverse4", "--prompt-data", data, "--custom-rm-path", f"{MODULE}:per_sample", "--input-key", "question",
                          "--label-key", "answer"]))
