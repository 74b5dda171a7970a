"""`miles validate` refuses a dataset the model cannot read, naming its vocabulary and what reads it.

Pins: text prompts on a builtin tiny model's 13-token digit vocabulary (every word becomes <pad>),
token ids the vocabulary does not have, and rows that read as one repeated token are refused at
validate (exit 2) with the vocabulary (size, what it reads) and `--preset smollm2-arith` / the tiny
models' builtin:reverse4 and builtin:copy4 named; digit prompts pass; only the first rows of a large
file are read; a local HF model's tokenizer judges text the same way.
"""

from __future__ import annotations

import json
import time

import pytest

from miles_core.cli import main
from miles_core.config import parse_flags, replace_fields
from miles_core.prepare import readable
from miles_core.prepare.checks import validation_problems
from tests.unit.test_data_chat_template import save_tokenizer


def _jsonl(path, prompts, task="math"):
    path.write_text("".join(json.dumps({"prompt": p, "label": "1", "task": task}) + "\n" for p in prompts))
    return str(path)


def _problems(*argv):
    return validation_problems(parse_flags(["--preset", "tiny-reverse4", *list(argv)], check=False))


def test_text_on_the_digit_vocabulary_is_refused_at_validate(tmp_path, capsys):
    """Guards: text rows on builtin:tiny-gpt becoming all <pad> with `miles validate` exiting 0."""
    data = _jsonl(tmp_path / "gsm.jsonl", [f"Natalia sold {i} clips. How many?" for i in range(5)])
    assert main(["validate", "--preset", "tiny-reverse4", "--prompt-data", data]) == 2
    err = capsys.readouterr().err
    assert "holds text prompts" in err and "<pad> <pad> <pad>" in err
    assert "vocabulary of 13 digit tokens (0-9, <sep>, <eos>, <pad>)" in err
    assert "--preset smollm2-arith" in err and "builtin:reverse4" in err and "builtin:copy4" in err


def test_builtin_text_task_on_a_tiny_model_is_refused_at_validate():
    (problem,) = [p for p in _problems("--prompt-data", "builtin:arith", "--eval-prompt-data", "none")
                  if "text prompts" in p]
    assert "--prompt-data='builtin:arith'" in problem and "--preset smollm2-arith" in problem


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    data = _jsonl(tmp_path / "ids.jsonl", [[1, 2, 3], [40, 2, 50256]], task="reverse4")
    (problem,) = _problems("--prompt-data", data)
    assert "token ids the model does not have" in problem and "line 2: id 40" in problem and "ids 0-12" in problem


def test_rows_of_one_repeated_token_are_refused(tmp_path):
    data = _jsonl(tmp_path / "rep.jsonl", [[1, 2, 3, 4, 10], [7, 7, 7, 7]], task="reverse4")
    (problem,) = _problems("--prompt-data", data)
    assert "one repeated token" in problem and "line 2" in problem and "--input-key" in problem


def test_eval_datasets_are_read_too(tmp_path):
    data = _jsonl(tmp_path / "eval.jsonl", ["what is one plus one"])
    (problem,) = _problems("--eval-prompt-data", f"mine={data}")
    assert problem.startswith("--eval-prompt-data mine=") and "holds text prompts" in problem


def test_digit_prompts_pass(tmp_path, capsys):
    data = _jsonl(tmp_path / "digits.jsonl", ["1 2 3 4 <sep>", [4, 3, 2, 1, 10], "5"], task="reverse4")
    assert _problems("--prompt-data", data) == []
    assert main(["validate", "--preset", "tiny-reverse4", "--prompt-data", data]) == 0, capsys.readouterr().err


def test_only_the_first_rows_of_a_large_dataset_are_read(tmp_path, monkeypatch):
    rows = [[1, 2, 3, 4, 10]] * 50_000 + [[7, 7, 7]]  # the bad row lies past the sample
    data = _jsonl(tmp_path / "big.jsonl", rows, task="reverse4")
    start = time.monotonic()
    assert _problems("--prompt-data", data) == []
    assert time.monotonic() - start < 30
    monkeypatch.setattr(readable, "SAMPLE_ROWS", 60_000)
    assert len(_problems("--prompt-data", data)) == 1


def test_a_local_hf_tokenizer_judges_text(tmp_path):
    """A local HF directory: text its tokenizer reads as one repeated (unknown) token is refused,
    naming the vocabulary's size; text it reads passes."""
    model = save_tokenizer(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    cfg = replace_fields(parse_flags(["--preset", "tiny-reverse4"], check=False), hf_checkpoint=model, eval_prompt_data=[], eval_interval=None)
    hf_config = {"model_type": "llama", "vocab_size": 32, "pad_token_id": None}
    bad = replace_fields(cfg, prompt_data=_jsonl(tmp_path / "bad.jsonl", ["ÿÿ ÿÿ ÿÿ"]))
    (problem,) = readable.readability_problems(bad, hf_config)
    assert "one repeated token" in problem and "vocabulary of 32 tokens (llama)" in problem
    good = replace_fields(cfg, prompt_data=_jsonl(tmp_path / "good.jsonl", ["what is 1 + 2"]))
    assert readable.readability_problems(good, hf_config) == []
