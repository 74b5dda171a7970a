"""End to end with a trainer of two ranks: the real `pyflyte run workflows/fully_async.py
fully_async_rl` with `--actor-num-gpus-per-node 2` (two CPU rank processes, DP=2 over gloo) and
`--weight-transport distributed` (SGLang's weight-update group, gloo on CPU, into the CPU engine).

Scale chosen for CI: the embedded default task at 150 steps (the smallest count DESIGN §10's bar
is defined for; ~4 min on two cores). Pins: the run learns by the §10 bar (the mean reward of the
last 10% of steps is >= 0.6 and >= 5x the mean of the first 5), every consumed group id is
consumed exactly once, and weights never went through the disk staging area (weights/).
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_pyflyte_run import _consumed_ids, _reward_by_step, _run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 150


def test_two_rank_trainer_with_distributed_weight_push_learns(tmp_path):
    flags = (f"--num-rollout {STEPS} --actor-num-gpus-per-node 2 --weight-transport distributed "
             "--num-cpus-trainer 0.5 --num-cpus-per-engine 0.5 --save-interval 50 --eval-interval none "
             "--eval-prompt-data --run-id dp2")
    _run(tmp_path, flags, timeout=1200)
    run = tmp_path / "runs" / "dp2"
    status = json.loads((run / "STATUS.json").read_text())
    assert status["state"] == "finished" and status["last_step"] == STEPS - 1, status

    rewards = _reward_by_step(f"file://{run}")
    assert sorted(rewards) == list(range(STEPS))
    first = sum(rewards[s] for s in range(5)) / 5
    tail = [rewards[s] for s in range(STEPS - STEPS // 10, STEPS)]
    last = sum(tail) / len(tail)
    print(f"reward: first 5 steps {first:.3f}, last {len(tail)} steps {last:.3f}")
    assert last >= 0.6 and last >= 5 * first, (first, last)

    ids = _consumed_ids(run)
    assert len(ids) == STEPS * 32 and len(set(ids)) == len(ids), "a group was consumed twice"
    assert not (run / "weights").exists() or not any((run / "weights").rglob("*.safetensors"))
