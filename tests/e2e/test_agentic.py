"""End to end: the builtin multi-turn environment learns under fully async training, and only when
its environment tokens are masked out of the loss (docs/agentic.md, docs/agentic.md).

The real `pyflyte run workflows/fully_async.py fully_async_rl` on CPU with
`--custom-generate-function-path miles_core.rollout.multiturn:reverse4_two_turns`: two model turns
per episode with a masked feedback token between them, sample granularity (the fully async
default), weight updates while episodes are in flight. The bar (from a plain-torch probe of the
same task): after 100 steps the mean reward of the last 10% of steps is >= 0.9 and >= 5x the first
5 steps. The control, `reverse4_two_turns_unmasked` (environment tokens in the loss, with
--no-use-rollout-logprobs since the engine gives no log-prob for them), must fail the same bar: the
bar catches a masking bug (a `calibration` test: run with -m calibration, not in CI). Why 100 steps:
in the probe the last 10% of the first 80 steps averaged 1.00 masked and 0.30-0.78 unmasked (4 seeds
each), <= 0.84 unmasked at 100-200 steps; this run, measured at 120 steps on an idle machine, was at
0.99 masked by step 80 (0.92 by step 60), but in CI's three saturated lanes a fully async run learns
slower per step (0.46 by step 80 once, on 2026-12-06), so the runs take 20 steps of margin.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_pyflyte_run import _reward_by_step, _run

AGENTIC_RUN_SECONDS = 1800  # a whole agentic run: multi-turn episodes with tool calls on the CPU engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 100
FN = "miles_core.rollout.multiturn:"
COMMON = f"--num-rollout {STEPS} --rollout-max-response-len 3 --eval-interval {STEPS} --save-interval {STEPS}"


def _curve(tmp_path, flags: str, run_id: str) -> tuple[float, float, dict[int, float]]:
    t0 = time.monotonic()
    _run(tmp_path, f"{COMMON} {flags} --run-id {run_id}", timeout=AGENTIC_RUN_SECONDS)
    rewards = _reward_by_step(f"file://{tmp_path / 'runs' / run_id}")
    assert sorted(rewards) == list(range(STEPS)), sorted(rewards)
    tail = max(1, STEPS // 10)
    first = sum(rewards[s] for s in range(5)) / 5
    last = sum(rewards[s] for s in range(STEPS - tail, STEPS)) / tail
    print(f"{run_id}: first-5 reward {first:.3f}, last-10% reward {last:.3f}, "
          f"wall {time.monotonic() - t0:.0f} s")
    return first, last, rewards


def test_builtin_multiturn_environment_learns_with_masked_environment_tokens(tmp_path):
    """Pins: a two-turn episode function learns by the bar (last 10% >= 0.9 and >= 5x the first 5
    steps) under fully async training with sample granularity.
    Guards: episodes losing tokens, versions or masks on the way from the engine to the loss."""
    first, last, _ = _curve(tmp_path, f"--custom-generate-function-path {FN}reverse4_two_turns", "masked")
    assert last >= 0.9 and last >= 5 * first, (first, last)


@pytest.mark.calibration
def test_environment_tokens_left_in_the_loss_fail_the_bar(tmp_path):
    """Pins: the bar catches a masking bug: the same run with the environment tokens in the loss
    stays below 0.9 (the probe: <= 0.78 over 4 seeds at 80 steps, <= 0.84 at 100-200).

    A calibration of the bar, not a check of the code (the control's own episodes are unit-tested in
    tests/unit/test_episodes.py): run it when the bar, the task or the loss changes
    (`./dev test -m calibration tests/e2e/test_agentic.py`); CI leaves it out."""
    first, last, _ = _curve(tmp_path, f"--custom-generate-function-path {FN}reverse4_two_turns_unmasked "
                                      "--no-use-rollout-logprobs", "unmasked")
    assert last < 0.9, (first, last)
