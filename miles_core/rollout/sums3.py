"""Builtin 3-digit sums for a small real instruct model, with and without a calculator tool.

    builtin:calc3, builtin:calc3-heldout    the tool task (`--preset smollm2-calculator`, docs/agentic.md)
    builtin:sum3,  builtin:sum3-heldout     the same questions without the tool (single-turn baseline)

Each row is one sum of two 3-digit numbers asked in one of several wordings ("forms"). The training
splits use TRAIN_FORMS, the held-out splits HELDOUT_FORMS, wordings the training never shows, on pairs
the training never shows either: the held-out score measures whether what was learned (call the
calculator with the question's two numbers, answer with its result) carries over to new wordings.

The calc3 prompts are chat messages (`--apply-chat-template`): a system message telling the tool's
call format, one demonstration exchange in that format (a plain "What is a + b?" question, the
call, the tool's answer, the final answer), then the question. Why this shape (a probe of
SmolLM2-135M-Instruct, greedy, plain transformers): told the format in the system message alone it
called the tool 0 times in 64 sampled answers; with the demonstration it calls it right for most
plain questions, and for 0 of 12 worded ones (it answers "Sam has 964 - 494 = 24 apples." instead):
the demonstration gives exploration something to start from, the worded forms give RL something
to teach. The sum3 prompts are the question and "Reply with only the number." (the arithmetic
preset's prompt), no system message, no tool.

Labels are the sum; rewards read the final answer (`miles_core.rollout.arith.arith_reward`: the
number after the first "=", else the last number), so the calculator's own output never scores.
"""

from __future__ import annotations

import json
import random

from miles_core.rollout.arith import TASK

CALC, CALC_HELDOUT = "builtin:calc3", "builtin:calc3-heldout"
SUM, SUM_HELDOUT = "builtin:sum3", "builtin:sum3-heldout"
DATASETS = (CALC, CALC_HELDOUT, SUM, SUM_HELDOUT)
TRAIN_SIZE, HELDOUT_SIZE = 20_000, 500
SEED = 20261207

TRAIN_FORMS = (
    "What is {a} + {b}?",
    "Sam has {a} apples and gets {b} more. How many apples does Sam have?",
    "Add {a} and {b}.",
    "A shelf holds {a} books and another shelf holds {b} books. How many books are there in total?",
    "What is the sum of {a} and {b}?",
)
HELDOUT_FORMS = (
    "A farm has {a} cows and buys {b} more. How many cows does the farm have now?",
    "What do you get when you add {a} to {b}?",
    "Tom walked {a} meters and then {b} meters more. How many meters did he walk in total?",
    "{a} plus {b} equals what?",
)
SYSTEM = ('You can use a calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}'
          '</tool_call> and it answers with the result.')
DEMONSTRATION = (
    {"role": "user", "content": "What is 205 + 617?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "205 + 617"}}'
                                     '</tool_call>'},
    {"role": "tool", "content": json.dumps({"result": 822})},
    {"role": "assistant", "content": "822"},
)
NO_TOOL_SUFFIX = " Reply with only the number."


def _pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training pairs, held-out pairs): disjoint, drawn once from a fixed seed."""
    rng = random.Random(SEED)
    seen: set[tuple[int, int]] = set()
    pairs = []
    while len(pairs) < TRAIN_SIZE + HELDOUT_SIZE:
        pair = (rng.randint(100, 999), rng.randint(100, 999))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs[HELDOUT_SIZE:], pairs[:HELDOUT_SIZE]


def question(form: str, a: int, b: int, tool: bool) -> str | list[dict]:
    """The prompt of one sum: chat messages with the tool's instructions, or the plain question."""
    text = form.format(a=a, b=b)
    if not tool:
        return text + NO_TOOL_SUFFIX
    return [{"role": "system", "content": SYSTEM}, *DEMONSTRATION, {"role": "user", "content": text}]


def sums3_rows(name: str) -> list[dict]:
    """Rows {prompt, label: the sum, task: "arith", metadata: {a, b, form}} of a split (module docstring)."""
    if name not in DATASETS:
        raise ValueError(f"unknown 3-digit sum dataset {name!r}; known: {', '.join(DATASETS)}")
    heldout = name.endswith("-heldout")
    train, held = _pairs()
    forms = HELDOUT_FORMS if heldout else TRAIN_FORMS
    tool = name.startswith(CALC)
    rows = []
    for i, (a, b) in enumerate(held if heldout else train):
        form = i % len(forms)
        rows.append({"prompt": question(forms[form], a, b, tool), "label": str(a + b), "task": TASK,
                     "metadata": {"a": a, "b": b, "form": form, "heldout_form": heldout}})
    return rows
