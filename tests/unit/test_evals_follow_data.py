"""Eval datasets follow --prompt-data: a builtin task's held-out split for that task, nothing for yours.

Pins: `miles validate --prompt-data mine.jsonl` (no --eval-prompt-data) runs no eval set, and no
--eval-interval is needed; builtin:reverse4 (the default) and builtin:arith keep their held-out
splits; `--preset smollm2-arith` keeps its eval set, and drops it with your own --prompt-data;
`--eval-prompt-data none` disables evals, as does the flag with no value; an explicit eval set or
interval always wins; the lineage command line (`flags_of`) round-trips each of these.
"""

from __future__ import annotations

import json

import pytest

from miles_core.cli import main
from miles_core.config import ConfigError, parse_flags
from miles_core.lineage.command import flags_of
from miles_core.prepare.checks import validate

REVERSE = ["heldout=builtin:reverse4-heldout"]
ARITH = ["heldout=builtin:arith-heldout"]


@pytest.fixture
def mine(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": [1, 2, 3, 4, 10], "label": "4321", "task": "reverse4"}) + "\n"
                            for _ in range(4)))
    return str(path)


def _evals(argv):
    cfg = parse_flags(["--preset", "tiny-reverse4", *argv])
    return cfg.eval.eval_prompt_data, cfg.eval.eval_interval


def test_your_prompt_data_has_no_builtin_eval_set(mine, capsys):
    """Guards: the default heldout=builtin:reverse4-heldout staying with a user's own data, where the
    user's reward scored it 0.000."""
    assert _evals(["--prompt-data", mine]) == ([], None)
    assert main(["validate", "--preset", "tiny-reverse4", "--prompt-data", mine]) == 0
    printed = json.loads(capsys.readouterr().out)["eval"]
    assert printed["eval_prompt_data"] == [] and printed["eval_interval"] is None


def test_builtin_tasks_keep_their_own_heldout_split():
    assert _evals([]) == (REVERSE, 40)
    assert _evals(["--prompt-data", "builtin:arith", "--hf-checkpoint", "import:smollm2-135m-instruct"]) == (ARITH, 40)
    assert _evals(["--prompt-data", "builtin:copy4"]) == ([], None)  # reverse4's split is not copy4's


def test_preset_keeps_its_eval_set_unless_the_data_changes(mine):
    assert _evals(["--preset", "smollm2-arith"]) == (ARITH, 20)
    assert _evals(["--preset", "smollm2-arith", "--prompt-data", mine]) == ([], None)
    assert _evals(["--preset", "smollm2-arith", "--prompt-data", mine, "--eval-prompt-data", "a=" + mine]) == (
        ["a=" + mine], 20)


@pytest.mark.parametrize("flag", [["--eval-prompt-data", "none"], ["--eval-prompt-data", "NONE"],
                                  ["--eval-prompt-data"]], ids=["none", "NONE", "no value"])
def test_none_disables_evals(flag, capsys):
    """Guards: `--eval-prompt-data none` refused as 'expected name=uri' though the help offers it."""
    assert _evals(flag) == ([], None)
    assert main(["validate", "--preset", "tiny-reverse4", *flag]) == 0, capsys.readouterr().err


def test_explicit_values_win(mine):
    assert _evals(["--prompt-data", mine, "--eval-prompt-data", *REVERSE]) == (REVERSE, 40)
    assert _evals(["--prompt-data", mine, "--eval-prompt-data", "a=" + mine, "--eval-interval", "5"]) == (
        ["a=" + mine], 5)
    with pytest.raises(ConfigError, match="--eval-interval needs eval datasets"):
        parse_flags(["--preset", "tiny-reverse4", "--eval-interval", "5", "--eval-prompt-data", "none"])
    with pytest.raises(ConfigError, match="none means no values"):
        parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", "none", *REVERSE])


def test_a_fork_base_keeps_an_explicit_eval_set_and_follows_a_default_one(mine):
    explicit = parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", "a=builtin:copy4"])
    assert parse_flags(["--prompt-data", mine], base=explicit).eval.eval_prompt_data == ["a=builtin:copy4"]
    followed = parse_flags(["--preset", "tiny-reverse4"])
    assert parse_flags(["--prompt-data", mine], base=followed).eval.eval_prompt_data == []
    no_evals = parse_flags(["--preset", "tiny-reverse4", "--prompt-data", mine])  # evals appear with an interval where the base had none
    assert _evals_of(parse_flags(["--eval-prompt-data", "a=" + mine], base=no_evals)) == (["a=" + mine], 40)


def _evals_of(cfg):
    return cfg.eval.eval_prompt_data, cfg.eval.eval_interval


@pytest.mark.parametrize("argv", [
    [], ["--prompt-data", "MINE"], ["--prompt-data", "MINE", "--eval-prompt-data", *REVERSE],
    ["--prompt-data", "MINE", "--eval-prompt-data", *REVERSE, "--eval-interval", "none"],
    ["--eval-prompt-data", "none"], ["--preset", "smollm2-arith"], ["--preset", "smollm2-arith", "--prompt-data", "MINE"],
])
def test_lineage_flags_round_trip(argv, mine):
    """Guards: `flags_of` leaving out an eval set equal to the old fixed default, which a replay of
    the command line would then drop (it follows the data)."""
    cfg = validate(parse_flags(["--preset", "tiny-reverse4", *(mine if a == "MINE" else a for a in argv)]))
    again = parse_flags(["--preset", "tiny-reverse4", *flags_of(cfg)])
    assert _evals_of(again) == _evals_of(cfg) and again.data == cfg.data
