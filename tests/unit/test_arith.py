"""The builtin addition task (miles_core.rollout.arith): splits, prompts, answer extraction, reward.

Pins: train and held-out splits partition the 90 x 90 pairs (500 held out), deterministically; the
plain "What is a + b?" wording stays the majority; the answer is the integer after the first "="
(else the first integer), as the probe of SmolLM2-135M-Instruct needs; task_reward dispatches
"arith" here; the digit tasks' random-policy level is not computed for it.
"""

from __future__ import annotations

import math

import pytest

from miles_core.rollout import arith
from miles_core.rollout.builtin_tasks import BUILTIN_TASKS, builtin_rows, random_policy_reward
from miles_core.rollout.rewards import task_reward
from miles_core.samples import Sample


def pairs(rows) -> set[tuple[int, int]]:
    return {(r["metadata"]["a"], r["metadata"]["b"]) for r in rows}


def test_splits_are_disjoint_complete_and_deterministic():
    train, held = builtin_rows("builtin:arith"), builtin_rows("builtin:arith-heldout")
    assert (len(train), len(held)) == (7600, 500)
    assert not pairs(train) & pairs(held)
    assert pairs(train) | pairs(held) == {(a, b) for a in range(10, 100) for b in range(10, 100)}
    assert builtin_rows("builtin:arith") == train
    assert [(r["metadata"]["a"], r["metadata"]["b"]) for r in train] == sorted(pairs(train))
    assert {"builtin:arith", "builtin:arith-heldout"} <= set(BUILTIN_TASKS)


def test_rows_are_text_prompts_labelled_with_the_sum():
    for r in builtin_rows("builtin:arith-heldout"):
        a, b = r["metadata"]["a"], r["metadata"]["b"]
        assert r["task"] == "arith" and r["label"] == str(a + b)
        assert isinstance(r["prompt"], str) and str(a) in r["prompt"] and str(b) in r["prompt"]
        assert r["prompt"].endswith("Reply with only the number.")


def test_the_plain_wording_is_the_majority_and_fixed_per_pair():
    train = builtin_rows("builtin:arith")
    plain = sum(r["prompt"] == arith.PLAIN.format(**r["metadata"]) for r in train)
    assert plain / len(train) > 0.7
    assert len({arith.template_of(a, b) for a in range(10, 100) for b in range(10, 100)}) == 1 + len(arith.WORDED)
    assert arith.template_of(23, 45) == arith.template_of(23, 45)


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="unknown arith dataset"):
        arith.arith_rows("builtin:arith-test")


@pytest.mark.parametrize("text, answer", [
    ("63 + 11 = 74", 74),
    ("74", 74),
    ("The answer is 1,024.", 1024),
    ("= -5", -5),
    ("no number here", None),
    ("23 + 45 =", None),             # an "=" with nothing after it: no answer
    ("Sam has 68 apples.", 68),
    ("91 + 94 is 185.", 185),        # no "=": the last integer
    ("To add 91 and 94, we", 94),
    ("68.0", 68),
    ("68.5", None),
    ("23 + 45 = 68, and 68 = 68", 68),
    ("", None),
])
def test_extract_answer(text, answer):
    assert arith.extract_answer(text) == answer


def sample(label: str) -> Sample:
    return Sample(group_id="g", prompt_index=0, sample_index=0, prompt_ids=[1], label=label,
                  metadata='{"task": "arith"}')


def test_reward_is_one_for_the_right_sum_only():
    assert arith.arith_reward(sample("68"), "23 + 45 = 68") == 1.0
    assert arith.arith_reward(sample("68"), "23 + 45 = 67") == 0.0
    assert arith.arith_reward(sample("68"), "23") == 0.0  # the first integer is an operand, not the sum
    assert arith.arith_reward(sample("68"), "I don't know") == 0.0
    assert arith.arith_reward.needs_text is True


def test_task_reward_dispatches_arith():
    assert task_reward(sample("1024"), "The answer is 1,024.") == 1.0
    assert task_reward(sample("1024"), "1023") == 0.0


def test_no_random_policy_level_for_arith():
    assert math.isnan(random_policy_reward("builtin:arith", 5))
