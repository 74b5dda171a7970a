"""Builtin two-digit addition (`builtin:arith`, `builtin:arith-heldout`), sized for a small real
instruct model (SmolLM2-135M-Instruct) to learn on CPU.

Why these choices (from a probe of that model, greedy, chat template applied):
- the prompt is "What is {a} + {b}? Reply with only the number.": the model answers it, at ~17%
  accuracy before training, so there is signal to learn from. About a quarter of the pairs get a
  word-problem wording instead (chosen by the pair, so deterministic); the plain form stays the
  majority since it is the one the probe measured;
- the model tends to answer "a + b = c", so the answer is the integer after the first "=" when
  the response has one, else its last integer ("91 + 94 is 185.", "The answer is 185."; commas
  in numbers ignored). Scoring the first integer instead would read back the operand `a` and
  give no signal at all.

Rows carry TEXT prompts, so `--apply-chat-template` and the model's tokenizer apply when the
dataset is prepared (miles_core.prepare.dataset); the builtin digit models cannot read them. Of the 90 x 90
ordered pairs of 2-digit numbers, a fixed seeded 500 are held out (`builtin:arith-heldout`, the
eval split, never trained on); both splits list pairs in (a, b) order.
"""

from __future__ import annotations

import random
import re

TRAIN, HELDOUT = "builtin:arith", "builtin:arith-heldout"
DATASETS = (TRAIN, HELDOUT)
TASK = "arith"
NUMBERS = range(10, 100)
HELDOUT_SIZE = 500

PLAIN = "What is {a} + {b}? Reply with only the number."
WORDED = (
    "Sam has {a} apples and gets {b} more. How many apples does Sam have? Reply with only the number.",
    "What is the sum of {a} and {b}? Reply with only the number.",
    "A shelf holds {a} books and another shelf holds {b} books. How many books are there in total? "
    "Reply with only the number.",
)
_TEMPLATE_CYCLE = 12  # of every 12 slots, the last len(WORDED) are worded: 75% plain


def _pair_index(a: int, b: int) -> int:
    return (a - NUMBERS.start) * len(NUMBERS) + (b - NUMBERS.start)


HELDOUT_PAIRS = frozenset(random.Random(20261201).sample(range(len(NUMBERS) ** 2), HELDOUT_SIZE))


def template_of(a: int, b: int) -> str:
    """The prompt template of the pair (a, b): a fixed function of the pair, mostly PLAIN."""
    slot = (a * 31 + b * 17) % _TEMPLATE_CYCLE
    worded = slot - (_TEMPLATE_CYCLE - len(WORDED))
    return WORDED[worded] if worded >= 0 else PLAIN


def arith_rows(name: str) -> list[dict]:
    """Rows {prompt: text, label: the sum, task: "arith", metadata: {a, b}} of a split."""
    if name not in DATASETS:
        raise ValueError(f"unknown arith dataset {name!r}; known: {', '.join(DATASETS)}")
    heldout = name == HELDOUT
    return [
        {"prompt": template_of(a, b).format(a=a, b=b), "label": str(a + b), "task": TASK,
         "metadata": {"a": a, "b": b}}
        for a in NUMBERS for b in NUMBERS
        if (_pair_index(a, b) in HELDOUT_PAIRS) == heldout
    ]


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> int | None:
    """The integer after the first "=" when the text has one, else the last integer; None when
    there is none (or it is not a whole number)."""
    text = _THOUSANDS.sub("", text)
    eq = text.find("=")
    if eq >= 0:
        match = _NUMBER.search(text, eq + 1)
    else:
        match = next(reversed(list(_NUMBER.finditer(text))), None)
    if match is None:
        return None
    value = float(match.group())
    return int(value) if value.is_integer() else None


def arith_reward(sample, text: str) -> float:
    """1.0 when the response's answer (see `extract_answer`) equals the label's sum, else 0.0."""
    answer = extract_answer(text)
    return float(answer is not None and answer == int(sample.label))


arith_reward.needs_text = True
