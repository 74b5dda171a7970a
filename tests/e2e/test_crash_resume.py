"""Crash and resume: SIGKILL a training run mid-flight, resume it, and check exactly-once.

Pins docs/architecture.md "a sample trained twice or silently lost across a crash": the run is killed (driver,
local Ray, actors and engine server, with no chance to clean up) after a checkpoint, then resumed
from the same run root. The finished lineage must have consumed every step's batch once, no group
id twice and no prompt position twice; manifests of steps trained after the checkpoint but before
the kill are discarded on resume and rewritten.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.processes import kill_everything_under
from tests.support.timeouts import RUN_SECONDS, SLOW_RUN_SECONDS, WAIT_SECONDS, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ("import sys; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
          "run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]]))")


def _flags(storage: Path) -> list[str]:
    # The killed run's lease is taken over when it expires: a 10 s TTL keeps the resume from waiting a minute.
    return ["--storage-root", str(storage), "--run-id", "crash", "--num-rollout", "16", "--save-interval", "4",
            "--eval-prompt-data", "--eval-interval", "none", "--no-progress", "--lease-ttl-seconds", "10"]


def _latest_step(run: Path) -> int:
    latest = run / "checkpoints" / "LATEST"
    if not latest.exists():
        return -1
    m = re.search(r"step_(\d+)", latest.read_text())
    return int(m.group(1)) if m else -1


def _trained_past_checkpoint(run: Path) -> bool:
    """A consumed manifest of a step after the latest checkpoint: the resume has one to discard."""
    steps = [int(m.stem) for m in (run / "buffer" / "consumed").glob("*.json") if m.stem.isdigit()]
    return bool(steps) and max(steps) > _latest_step(run) >= 3


def test_sigkill_after_a_checkpoint_then_resume_trains_every_group_once(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's unix sockets live under it
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    run = tmp_path / "runs" / "crash"
    log1 = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, "-c", SCRIPT, *_flags(tmp_path)], cwd=ROOT, env=env,
                             stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def running() -> None:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-5000:]

        wait_until(lambda: _latest_step(run) >= 3, RUN_SECONDS, "checkpoint at step 3", check=running)
        # trained past the checkpoint, so there are manifests to discard
        wait_until(lambda: _trained_past_checkpoint(run), WAIT_SECONDS, "step trained after the checkpoint",
                   check=running)
    finally:
        kill_everything_under(ray_tmp, first)
    killed_at = _latest_step(run)
    status = json.loads((run / "STATUS.json").read_text())
    assert status["state"] == "running", status  # nobody got to write anything after the kill

    second = subprocess.run([sys.executable, "-c", SCRIPT, *_flags(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=SLOW_RUN_SECONDS)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    status = json.loads((run / "STATUS.json").read_text())
    assert status["state"] == "finished" and status["last_step"] == 15 and status["segment"] == 1, status

    manifests = sorted((run / "buffer" / "consumed").glob("*.json"))
    assert [int(m.stem) for m in manifests] == list(range(16))
    ids = [gid for m in manifests for gid in json.loads(m.read_text())["consumed"]]
    assert len(ids) == 16 * 32
    assert len(set(ids)) == len(ids), "a group was trained twice"
    positions = [re.match(r"(e\d+-p\d+)-a\d+", gid).group(1) for gid in ids]
    assert len(set(positions)) == len(positions), "a prompt was trained twice"
    assert 3 <= killed_at < 15
