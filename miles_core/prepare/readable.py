"""Can the model read the run's datasets? Checked by `validate` before anything starts.

    readability_problems(cfg, hf_config)    # one problem per dataset the model cannot read

A dataset is read (its first `SAMPLE_ROWS` rows, as stored: validation stays fast on a large file)
when it is on this machine (--prompt-data and each --eval-prompt-data, as a path or file://), and
the model's vocabulary is known here (`hf_config`: a builtin tiny model's, or a local HF
directory's config.json). Refused, naming the model's vocabulary and what reads such data:
- text prompts on the builtin tiny models' 13-token digit vocabulary (0-9, <sep>, <eos>, <pad>):
  every word that is not one of those becomes <pad> (also the builtin text task, builtin:arith);
- token-id prompts with an id the vocabulary does not have;
- rows the model reads as one repeated token (or a lone pad/unknown token), or as nothing (text
  with a local HF tokenizer, loaded only when a text row is met).
Datasets in object storage are normalized by the data step, which names rows that tokenize to
nothing. Rows that are not JSON objects, or lack the prompt column, are the other checks' to name.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from miles_core.config import RunConfig
from miles_core.config.sections import ModelSection
from miles_core.models.builtin import DIGIT_VOCAB, PAD_ID
from miles_core.models.source import is_builtin
from miles_core.prepare.dataset import columns, source_rows
from miles_core.prepare.scoring import local_datasets
from miles_core.rollout.builtin_tasks import TEXT_BUILTIN_DATASETS
from miles_core.rollout.prompts import DatasetError

SAMPLE_ROWS = 300  # rows read per dataset: enough to see what the data is, fast on any file
_SHOWN = 2  # rows named per problem

DIGITS_READ = ("the builtin tiny models read space-separated digits and <sep>/<eos>/<pad> as text, or token "
               f"ids below {len(DIGIT_VOCAB)}, like builtin:reverse4 and builtin:copy4")
TEXT_MODELS = ("text needs a model with a text tokenizer: --preset smollm2-arith (SmolLM2-135M-Instruct, text "
               "math) or --hf-checkpoint an HF model directory (docs/bring-your-own.md)")


def readability_problems(cfg: RunConfig, hf_config: dict | None) -> list[str]:
    """Every dataset of the run the model cannot read (see the module docstring)."""
    if not hf_config or not hf_config.get("vocab_size"):
        return []
    model = cfg.model.hf_checkpoint
    digits = is_builtin(model)
    problems = []
    if digits:
        for flag, source in _builtin_text(cfg):
            problems.append(f"{flag}={source!r} holds text prompts, but --hf-checkpoint={model!r} reads "
                            f"{_vocabulary(cfg.model, hf_config)}: every word becomes <pad>. {_cap(TEXT_MODELS)}; "
                            f"{DIGITS_READ}.")
    reader = _Reader(cfg, hf_config)
    for flag, source in local_datasets(cfg):
        problems += reader.problems(flag, source)
    return problems


def _builtin_text(cfg: RunConfig) -> list[tuple[str, str]]:
    named = [("--prompt-data", cfg.data.prompt_data)]
    named += [(f"--eval-prompt-data {item.partition('=')[0]}", item.partition("=")[2])
              for item in cfg.eval.eval_prompt_data]
    return [(flag, source) for flag, source in named if source in TEXT_BUILTIN_DATASETS]


def _vocabulary(model: ModelSection, hf_config: dict) -> str:
    n = hf_config["vocab_size"]
    if is_builtin(model.hf_checkpoint):
        return f"a vocabulary of {n} digit tokens (0-9, <sep>, <eos>, <pad>)"
    return f"a vocabulary of {n} tokens ({hf_config.get('model_type', 'its tokenizer')})"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


class _Reader:
    """Reads sampled rows the way the model will (the digit vocabulary, or the local tokenizer)."""

    def __init__(self, cfg: RunConfig, hf_config: dict):
        self.cfg = cfg
        self.hf_config = hf_config
        self.vocab_size = int(hf_config["vocab_size"])
        self.digits = is_builtin(cfg.model.hf_checkpoint)
        self._tok: Any = None

    def problems(self, flag: str, source: str) -> list[str]:
        text_rows, beyond, degenerate = [], [], []
        try:
            key = columns(source, self.cfg.data.input_key, self.cfg.data.label_key)[0]
            for where, row in islice(source_rows(source), SAMPLE_ROWS):
                value = row.get(key) if isinstance(row, dict) else None
                text = _text_of(value)
                if text is not None:
                    ids = self._ids(text)
                    if ids is None:
                        return []  # no tokenizer here: the data step reads the rows
                    if self.digits and PAD_ID in ids and text.strip():
                        text_rows.append(f"{where}: {_short(text)} reads as {_digit_words(text)}")
                    elif _degenerate(ids, self._unreadable_ids()):
                        degenerate.append(f"{where}: {_short(text)} -> {_short(ids)}")
                elif _is_ids(value):
                    big = [v for v in value if v >= self.vocab_size]
                    if big:
                        beyond.append(f"{where}: id {big[0]}")
                    elif _degenerate(list(value), self._unreadable_ids()):
                        degenerate.append(f"{where}: {_short(list(value))}")
        except DatasetError:
            return []  # named by the scoring check
        vocab = _vocabulary(self.cfg.model, self.hf_config)
        model = f"--hf-checkpoint={self.cfg.model.hf_checkpoint!r}"
        out = []
        if text_rows:
            out.append(f"{flag}={source!r} holds text prompts ({_rows(text_rows)}), but {model} reads {vocab}: "
                       f"every word that is not one of them becomes <pad>. {_cap(TEXT_MODELS)}; {DIGITS_READ}.")
        if beyond:
            out.append(f"{flag}={source!r}: token ids the model does not have ({_rows(beyond)}): {model} reads "
                       f"{vocab}, ids 0-{self.vocab_size - 1}. Token-id prompts must come from the model's own "
                       "tokenizer: set --hf-checkpoint to the model whose tokenizer made them, or give the "
                       "prompts as text" + ("" if not self.digits else f" ({DIGITS_READ})") + ".")
        if degenerate:
            out.append(f"{flag}={source!r}: rows the model reads as one repeated token or nothing "
                       f"({_rows(degenerate)}): {model} reads {vocab}. Check that --input-key "
                       f"({self.cfg.data.input_key!r}) names the prompt column and that the prompts are in a "
                       "language the model's tokenizer covers; "
                       + (f"{TEXT_MODELS}." if self.digits else "use a model whose tokenizer reads them."))
        return out

    def _ids(self, text: str) -> list[int] | None:
        if self.digits:
            return [DIGIT_VOCAB.get(w, PAD_ID) for w in text.split()]
        if self._tok is None:
            self._tok = _local_tokenizer(self.cfg.model.hf_checkpoint)
        if self._tok is False:
            return None
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def _unreadable_ids(self) -> set[int]:
        if self.digits:
            return {PAD_ID}
        ids = {self.hf_config.get("pad_token_id"), getattr(self._tok, "unk_token_id", None) if self._tok else None}
        return {i for i in ids if isinstance(i, int)}


def _local_tokenizer(path: str):
    """The local HF directory's tokenizer, or False when it cannot be loaded here (no tokenizer files:
    an import, or a broken directory, is the data step's to report)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path.removeprefix("file://"))
    except Exception:  # noqa: BLE001 - not this check's finding
        return False


def _text_of(value: Any) -> str | None:
    """A text prompt's text (a chat message list: its contents), else None."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        return " ".join(str(m.get("content", "")) for m in value)
    return None


def _is_ids(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _degenerate(ids: list[int], unreadable: set[int]) -> bool:
    """Nothing, one token repeated, or a lone pad/unknown token."""
    return not ids or (len(set(ids)) == 1 and (len(ids) > 1 or ids[0] in unreadable))


def _digit_words(text: str) -> str:
    words = text.split()
    shown = " ".join(w if w in DIGIT_VOCAB else "<pad>" for w in words[:8])
    return shown + (" ..." if len(words) > 8 else "")


def _short(value: Any, n: int = 40) -> str:
    s = repr(value)
    return s if len(s) <= n else s[:n - 4] + "...'" if isinstance(value, str) else s[:n - 4] + " ...]"


def _rows(found: list[str]) -> str:
    more = f"; ... {len(found)} of the first {SAMPLE_ROWS} rows" if len(found) > _SHOWN else ""
    return "; ".join(found[:_SHOWN]) + more
