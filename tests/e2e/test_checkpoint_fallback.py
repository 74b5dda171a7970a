"""A damaged newest checkpoint: the continued run falls back to the previous one and keeps exactly-once.

A run trains steps 0..3 (checkpoints at 1 and 3) and finishes; step 3's model.safetensors is then
truncated (its COMPLETE still says it is there). Continuing the run to 6 steps must warn that step 3
does not verify, resume from step 1, and train steps 2..5. The independent reader
(tests/chaos/checker.py) then finds every step's manifest once, no group consumed twice in the final
lineage, and the groups the lost steps 2..3 had consumed consumed again (their manifests rewritten).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.chaos import checker
from tests.support.timeouts import RUN_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ("import sys; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
          "run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]]))")


def _run(storage: Path, num_rollout: int, env: dict) -> subprocess.CompletedProcess:
    flags = ["--storage-root", str(storage), "--run-id", "fallback", "--num-rollout", str(num_rollout),
             "--save-interval", "2", "--rollout-batch-size", "8",
             "--n-samples-per-prompt", "4", "--eval-prompt-data", "--eval-interval", "none", "--no-progress"]
    done = subprocess.run([sys.executable, "-c", SCRIPT, *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_SECONDS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _consumed(run: Path, steps) -> dict[int, list[str]]:
    return {s: json.loads((run / "buffer" / "consumed" / f"{s:08d}.json").read_text())["consumed"] for s in steps}


def test_a_damaged_newest_checkpoint_falls_back_and_trains_the_lost_steps_again(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's unix sockets live under it
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    run = tmp_path / "runs" / "fallback"
    try:
        _run(tmp_path, 4, env)
        lost = _consumed(run, range(2, 4))
        model = run / "checkpoints" / "step_00000003" / "model.safetensors"
        model.write_bytes(model.read_bytes()[:-100])
        committed = set(checker.committed_groups(run))
        second = _run(tmp_path, 6, env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = second.stdout + second.stderr
    assert "step_00000003" in log and "does not verify" in log and "model.safetensors: size" in log, log[-3000:]
    assert checker.check(run, 6, 8, committed) == []
    again = {gid for ids in _consumed(run, range(6)).values() for gid in ids}
    assert {gid for ids in lost.values() for gid in ids} <= again, "a group of a lost step was not trained again"
    assert json.loads((run / "STATUS.json").read_text())["last_step"] == 5
