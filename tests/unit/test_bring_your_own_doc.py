"""The runnable example of docs/bring-your-own.md runs as the page says.

Its two files (`my_data.jsonl`, `my_rewards.py`) are written from the page's code blocks into a temporary
directory; the page's own commands are then checked there: `miles validate` exits 0 with the directory on
the path and names `--custom-rm-path` without it, and the flags of its local-run command validate. The
data goes through the real reader (prepare_dataset, the data source) and the reward scores samples built
from it, as a run would. The page's other snippets (a batched reward, a dynamic filter) are run too.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path

import pytest

from miles_core.cli import main as miles_main
from miles_core.config import parse_flags
from miles_core.prepare.checks import validate
from miles_core.prepare.dataset import prepare_dataset
from miles_core.rollout.data_source import DataSource
from miles_core.rollout.prompts import load_prompts
from miles_core.rollout.rewards import Rewarder, load_reward
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.storage import Store

DOC = (Path(__file__).resolve().parents[2] / "docs" / "bring-your-own.md").read_text()
PROSE = re.sub(r"^```.*?^```", "", DOC, flags=re.S | re.M)  # the page without its fenced blocks
MODULE = "my_rewards"


def file_block(name: str) -> str:
    """The fenced block right after the line "`name`:"."""
    return re.search(rf"^`{re.escape(name)}`:\n\n```\w*\n(.*?)^```", DOC, re.S | re.M).group(1)


def python_block_defining(function: str) -> str:
    return next(b for b in re.findall(r"```python\n(.*?)```", DOC, re.S) if f"def {function}(" in b)


def inline_command(program_words: str) -> list[str]:
    """The words of the page's inline `...` command that runs the example with `program_words` (env words kept)."""
    text = " ".join(PROSE.split())  # the command wraps across lines in the prose
    code = next(c for c in re.findall(r"`([^`]+)`", text) if program_words in c and f"{MODULE}:capital_reward" in c)
    return shlex.split(code)


@pytest.fixture
def example(tmp_path, monkeypatch):
    """The page's two files in tmp_path/byo, the working directory at tmp_path, `my_rewards` importable."""
    byo = tmp_path / "byo"
    byo.mkdir()
    (byo / "my_data.jsonl").write_text(file_block("my_data.jsonl"))
    (byo / f"{MODULE}.py").write_text(file_block(f"{MODULE}.py"))
    sys.modules.pop(MODULE, None)
    yield byo
    sys.modules.pop(MODULE, None)


def test_the_validate_command_passes_with_the_module_on_the_path(example, monkeypatch, capsys):
    """Pins: the page's `PYTHONPATH=$PWD miles validate ...`, run in the example's directory, exits 0; without the
    directory on the path it exits 2 with the error the page quotes. Guards: an example that does not validate,
    and a quoted error that is not what a reader sees."""
    words = inline_command("miles validate")
    assert words[0] == "PYTHONPATH=$PWD" and words[1] == "miles"
    monkeypatch.chdir(example)
    assert miles_main(words[2:]) == 2
    prose = " ".join(PROSE.split())
    quoted = re.search(r"`(--custom-rm-path='my_rewards:capital_reward': module .*?)`", prose).group(1)
    err = " ".join(capsys.readouterr().err.split())
    assert all(part.strip() in err for part in quoted.split("(...)")), (quoted, err)
    monkeypatch.syspath_prepend(str(example))
    assert miles_main(words[2:]) == 0, capsys.readouterr().err


def test_the_local_run_flags_validate_from_the_repository_root(example, monkeypatch):
    """Pins: the flags of the page's `./dev run --flags "..."` validate with the example directory as byo/ under the
    working directory and on the path. Guards: a local-run command whose paths or module names drifted."""
    words = inline_command("./dev run")
    assert words[0] == "PYTHONPATH=$PWD/byo"
    flags = shlex.split(words[words.index("--flags") + 1])
    monkeypatch.chdir(example.parent)
    monkeypatch.syspath_prepend(str(example))
    validate(parse_flags(flags))


def _rows(example: Path, tmp_path: Path) -> list[dict]:
    """The example's rows as the run reads them: normalized into a run root, tokenized (bytes as ids)."""
    store = Store(str(tmp_path / "run"))
    prepare_dataset(str(example / "my_data.jsonl"), store, tokenizer=lambda text: list(text.encode()))
    return load_prompts(store)


def _scored(fn, rows: list[dict], answers: list[str]) -> list[float | None]:
    """Each row served by the data source as a run serves it, answered with `answers[i]`, scored by `fn`."""
    source = DataSource(rows, 1, seed=1, shuffle=False)
    samples = []
    for answer in answers:
        sample = source.next_group().samples[0]
        sample.response_ids, sample.status = list(answer.encode()), SampleStatus.COMPLETED
        samples.append(sample)
    rewarder = Rewarder(fn, lambda ids: bytes(ids).decode())
    try:
        asyncio.run(rewarder.score_group(Group("g", 0, samples)))
    finally:
        rewarder.close()
    return [s.reward for s in samples]


def test_the_reward_scores_the_example_rows_as_described(example, tmp_path, monkeypatch):
    """Pins: the example data normalizes with its task and metadata; capital_reward takes the label or an alias on
    the first line, and leaves the arith row to the builtin scorer. Guards: a doc example whose reward silently
    scores 0 (metadata lost, wrong signature attributes) or fails the rows it does not own."""
    rows = _rows(example, tmp_path)
    assert [r["task"] for r in rows] == ["capital", "capital", "capital", "arith"]
    monkeypatch.syspath_prepend(str(example))
    fn = load_reward(f"{MODULE}:capital_reward")
    answers = ["Paris.\nIt is in France.", "Kyoto", "La Paz", "17 + 25 = 42"]
    assert _scored(fn, rows, answers) == [1.0, 0.0, 1.0, 1.0]
    assert _scored(fn, rows, ["paris", "Tokyo!", "Lima", "41"]) == [1.0, 1.0, 0.0, 0.0]


def test_the_other_snippets_do_what_the_page_says():
    """Pins: the batched reward scores each sample of a group, and the zero-std filter drops a group of equal
    rewards with reason zero_std. Guards: snippets that do not run or do not match their description."""
    space: dict = {}
    exec(python_block_defining("exact_group"), space)  # noqa: S102 - the page's own code
    exec(python_block_defining("nonzero_std"), space)  # noqa: S102
    samples = [Sample("g", 0, i, [1], response_ids=list(t.encode()), status=SampleStatus.COMPLETED, label="Paris")
               for i, t in enumerate([" paris ", "Rome"])]
    rewarder = Rewarder(space["exact_group"], lambda ids: bytes(ids).decode())
    try:
        asyncio.run(rewarder.score_group(Group("g", 0, samples)))
    finally:
        rewarder.close()
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert space["nonzero_std"](Group("g", 0, samples)) == (True, "zero_std")
    samples[1].reward = 1.0
    assert space["nonzero_std"](Group("g", 0, samples)) == (False, "zero_std")


def test_a_reward_without_its_attribute_is_refused_naming_the_flag(example, monkeypatch):
    """Pins: the page's claim that the signature is checked against the declared attributes: capital_reward
    without `needs_text` takes (sample, text) where (sample) is declared. Guards: a page promising a check
    that does not exist."""
    source = file_block(f"{MODULE}.py").replace("capital_reward.needs_text = True\n", "")
    (example / f"{MODULE}.py").write_text(source)
    monkeypatch.syspath_prepend(str(example))
    with pytest.raises(ValueError, match="--custom-rm-path"):
        Rewarder(load_reward(f"{MODULE}:capital_reward"))
