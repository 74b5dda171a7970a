"""Collectives and batching over real gloo process groups, each rank its own process (tests/unit is
one process): the strict device rule on every rank, and DP=2 packed batches against DP=1 padded ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from miles_core.metrics import names as N
from tests.support.ranks import run_launcher
from tests.unit.test_collectives import _launch as _launch_collectives
from tests.unit.test_token_budget_batching import ATOL, DP, LOSS_KEYS, RTOL
from tests.unit.test_token_budget_batching import _launch as _launch_token_budget


def test_strict_mode_refuses_a_cpu_tensor_on_a_group_standing_for_nccl(tmp_path):
    """Pins the refusals and the routed collectives above, on every rank."""
    launcher = mp.get_context("spawn").Process(target=_launch_collectives, args=(str(tmp_path),))
    launcher.start()
    launcher.join(120)
    if launcher.is_alive():
        launcher.kill()
    errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
    assert launcher.exitcode == 0 and not errors, errors or f"the ranks' launcher exited with {launcher.exitcode}"


def test_dp2_packed_gradients_are_the_dp1_padded_ones(tmp_path):
    run_launcher(_launch_token_budget, str(tmp_path), 180, "the DP=2 trainer processes")
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DP)]
    one = saved[0]["dp1"]
    for r, rank in enumerate(saved):
        two = rank["dp2"]
        assert two["metrics"][N.PADDING_FRACTION] == 0.0 and two["metrics"][N.MICRO_BATCHES] >= 3
        for key in LOSS_KEYS:
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=RTOL, abs=1e-7), (r, key)
        for name, g in one["grads"].items():
            torch.testing.assert_close(two["grads"][name], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"{r} {name}: {m}")
