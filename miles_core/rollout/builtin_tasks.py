"""Builtin verifiable tasks for the embedded default (docs/quickstart.md).

reverse4: prompt `d1 d2 d3 d4 <sep>`, answer the digits reversed then <eos>.
Reward = 0.8 x (fraction of the 4 digits right, by position) + 0.2 x (<eos> right after them).
copy4: the same with the digits in order. Of the 10,000 digit strings, 500 drawn at random (a fixed
seed) are held out: `builtin:reverse4-heldout` is the eval split, never trained on. The split is
i.i.d. on purpose: a structured split (e.g. every value ending in 07, 27, ...) tests compositional
generalization instead, which this tiny model passes only intermittently.

These digit datasets carry token ids of the digit vocabulary. `builtin:arith` (and its held-out
split) is for a real instruct model and carries text prompts (miles_core.rollout.arith); so do the
3-digit sums with and without a calculator (`builtin:calc3`, `builtin:sum3`: miles_core.rollout.sums3).
"""

from __future__ import annotations

import random

from miles_core.models.builtin import DIGIT_VOCAB, EOS_ID, SEP_ID
from miles_core.rollout import arith, sums3

DIGIT_DATASETS = ("builtin:reverse4", "builtin:reverse4-heldout", "builtin:copy4")
TEXT_BUILTIN_DATASETS = arith.DATASETS + sums3.DATASETS  # text prompts: tokenized at preparation, never by the digit tokenizer
BUILTIN_TASKS = DIGIT_DATASETS + TEXT_BUILTIN_DATASETS


HELDOUT_VALUES = frozenset(random.Random(20261130).sample(range(10_000), 500))


def _is_heldout(value: int) -> bool:
    return value in HELDOUT_VALUES


def builtin_rows(name: str) -> list[dict]:
    """Rows {prompt: [token ids], label: answer digits as a string, task: ...} of a builtin dataset
    (arith: {prompt: text, label: the sum, task: "arith", metadata})."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown builtin dataset {name!r}; known: {', '.join(BUILTIN_TASKS)}")
    if name in sums3.DATASETS:
        return sums3.sums3_rows(name)
    if name in TEXT_BUILTIN_DATASETS:
        return arith.arith_rows(name)
    heldout = name.endswith("-heldout")
    task = "copy4" if "copy4" in name else "reverse4"
    rows = []
    for value in range(10_000):
        if _is_heldout(value) != heldout:
            continue
        digits = [int(c) for c in f"{value:04d}"]
        answer = digits if task == "copy4" else digits[::-1]
        rows.append({"prompt": digits + [SEP_ID], "label": "".join(map(str, answer)), "task": task})
    return rows


def digits_reward(response_ids: list[int], label: str) -> float:
    """0.8 x digits right (by position) + 0.2 x <eos> directly after the answer."""
    answer = [int(c) for c in label]
    right = sum(1 for i, d in enumerate(answer) if i < len(response_ids) and response_ids[i] == d)
    eos_ok = len(response_ids) > len(answer) and response_ids[len(answer)] == EOS_ID
    return 0.8 * right / len(answer) + 0.2 * float(eos_ok)


def random_policy_reward(name: str, max_response_len: int, samples: int = 4000) -> float:
    """Mean reward of uniformly random tokens on builtin dataset `name` (generation stops at <eos>,
    as on the engines): the level a learning run has to beat. NaN for a dataset that is not a digit
    task (arith: random tokens of a real vocabulary say nothing useful)."""
    if name not in DIGIT_DATASETS:
        return float("nan")

    rng = random.Random(0)
    rows = builtin_rows(name)
    total = 0.0
    for _ in range(samples):
        row = rows[rng.randrange(len(rows))]
        response: list[int] = []
        while len(response) < max_response_len and (not response or response[-1] != EOS_ID):
            response.append(rng.randrange(len(DIGIT_VOCAB)))
        total += digits_reward(response, row["label"])
    return total / samples
