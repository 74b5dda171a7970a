"""Real segments on a tiny run: finished is final, retries resume, one writer per run root (docs/training.md).

Each `run_training` runs in its own process with its own local Ray (as the Flyte task would), on a
file:// run root, at a tiny scale (4 groups of 2 samples per step).
Pins:
- a finished run's next segment returns at once without starting Ray, and STATUS.json and the
  lease stay byte-identical; raising --num-rollout continues it as the next segment;
- a segment whose trainer actors are killed (`ray.kill`) after a checkpoint fails with
  ActorDiedError, which the Flyte mapping makes FlyteRecoverableException; it releases its lease,
  so the retry (with a 600 s lease TTL, which it would otherwise wait out) resumes from the
  latest checkpoint at once, and every step's batch is consumed exactly once across both;
- while a run trains, a second `pyflyte run` of the same run id exits non-zero naming the holder (the
  error alone, last on its console, no traceback);
  after the holder is SIGKILLed, the next segment takes the run over once the lease expires.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.processes import kill_everything_under
from tests.support.timeouts import RUN_SECONDS, wait_until

FIRST_CHECKPOINT_SECONDS = 300  # a run's start to its first checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
RUN = ("import sys, ray; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
       "r = run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]])); print('RESULT', r.state, r.steps_run, 'ray', ray.is_initialized())")
TINY = ["--preset", "tiny-reverse4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--eval-prompt-data", "--eval-interval", "none",
        "--no-progress", "--save-interval", "1"]

KILL_TRAINER_AFTER_STEP_2 = """
import sys, ray
from miles_core.config import parse_flags
from miles_core.driver.segment import run_training
from miles_core.driver.roles import Checkpointer
from miles_core.failures import is_infrastructure
from tasks.failures import recoverable_infrastructure

save = Checkpointer.save
def save_then_lose_the_trainer(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if step == 2:
        for actor in self.trainer.actors:
            ray.kill(actor)
Checkpointer.save = save_then_lose_the_trainer
try:
    with recoverable_infrastructure():
        run_training(parse_flags(["--preset", "tiny-reverse4", *sys.argv[1:]]))
except Exception as e:
    print("FAILED", type(e).__name__, type(e.__cause__).__name__, is_infrastructure(e.__cause__), flush=True)
    sys.exit(3)
"""


@pytest.fixture
def ray_env():
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's unix sockets live under it
    yield dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1"), ray_tmp
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _segment(env, storage: Path, *flags: str, script: str = RUN, timeout: int = RUN_SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, "--storage-root", str(storage), "--run-id", "r", *TINY, *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _status(run: Path) -> dict:
    return json.loads((run / "STATUS.json").read_text())


def _consumed(run: Path) -> tuple[list[int], list[str]]:
    files = sorted((run / "buffer" / "consumed").glob("*.json"))
    return [int(f.stem) for f in files], [g for f in files for g in json.loads(f.read_text())["consumed"]]


def test_a_finished_run_stays_finished_and_a_raised_num_rollout_continues(tmp_path, ray_env):
    env, _ = ray_env
    run = tmp_path / "runs" / "r"
    assert "RESULT finished 3" in _ok(_segment(env, tmp_path, "--num-rollout", "3"))
    status_before, lease_before = (run / "STATUS.json").read_bytes(), (run / "LEASE.json").read_bytes()

    t0 = time.monotonic()
    out = _ok(_segment(env, tmp_path, "--num-rollout", "3"))
    assert "RESULT finished 0 ray False" in out  # nothing trained, Ray never started
    assert time.monotonic() - t0 < 30
    assert (run / "STATUS.json").read_bytes() == status_before
    assert (run / "LEASE.json").read_bytes() == lease_before
    assert not (run / "config_segment_0001.json").exists()

    assert "RESULT finished 2" in _ok(_segment(env, tmp_path, "--num-rollout", "5"))
    status = _status(run)
    assert (status["state"], status["last_step"], status["segment"]) == ("finished", 4, 1)
    steps, ids = _consumed(run)
    assert steps == list(range(5)) and len(ids) == 5 * 4 and len(set(ids)) == len(ids)


def test_a_retried_segment_resumes_from_the_latest_checkpoint(tmp_path, ray_env):
    env, _ = ray_env
    run = tmp_path / "runs" / "r"
    flags = ("--num-rollout", "6", "--lease-ttl-seconds", "600")
    failed = _segment(env, tmp_path, *flags, script=KILL_TRAINER_AFTER_STEP_2)
    assert failed.returncode == 3, failed.stdout[-3000:] + failed.stderr[-5000:]
    assert "FAILED FlyteRecoverableException ActorDiedError True" in failed.stdout
    status = _status(run)
    assert status["state"] == "failed" and status["last_step"] == 2 and "ActorDiedError" in status["message"]
    assert json.loads((run / "LEASE.json").read_text())["released"]

    t0 = time.monotonic()
    assert "RESULT finished 3" in _ok(_segment(env, tmp_path, *flags))  # steps 3..5: resumed after step 2
    assert time.monotonic() - t0 < 300  # not held up by the failed attempt's 600 s lease
    status = _status(run)
    assert (status["state"], status["last_step"], status["segment"]) == ("finished", 5, 1)
    steps, ids = _consumed(run)
    assert steps == list(range(6)) and len(ids) == 6 * 4 and len(set(ids)) == len(ids), "a group trained twice"


def test_a_second_pyflyte_run_is_refused_and_a_killed_holder_is_taken_over(tmp_path, ray_env):
    env, ray_tmp = ray_env
    run = tmp_path / "runs" / "r"
    flags = ["--num-rollout", "100000", "--lease-ttl-seconds", "10"]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, "-c", RUN, "--storage-root", str(tmp_path), "--run-id", "r", *TINY, *flags],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def running() -> None:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-5000:]

        wait_until((run / "checkpoints" / "LATEST").exists, FIRST_CHECKPOINT_SECONDS, "first checkpoint",
                   check=running, details=lambda: (tmp_path / "first.log").read_text()[-5000:])
        second = subprocess.run(
            [PYFLYTE, "run", "workflows/fully_async.py", "fully_async_rl", "--flags", " ".join(TINY + flags),
             "--storage_root", str(tmp_path), "--run_id", "r"],
            cwd=ROOT, env={**{k: v for k, v in env.items() if k != "FLYTECTL_CONFIG"}, "COLUMNS": "2000"},
            capture_output=True, text=True, timeout=RUN_SECONDS)
        output = second.stdout + second.stderr
        assert second.returncode != 0, output[-5000:]
        assert "LeaseHeld" in output and f"pid{first.pid}/" in output, output[-5000:]
        # the command line shows the error alone, last, not the frames that raised it
        last = [line for line in second.stderr.splitlines() if line.strip(" ─╭╰╮╯│")][-1]
        assert "Traceback" not in output and "LeaseHeld: " in last and f"pid{first.pid}/" in last, output[-3000:]
        assert first.poll() is None  # the holder trains on
    finally:
        kill_everything_under(ray_tmp, first)
    killed = json.loads((run / "LEASE.json").read_text())
    assert not killed["released"] and f"pid{first.pid}/" in killed["holder"]

    out = _ok(_segment(env, tmp_path, *flags, "--segment-steps", "2"))
    assert "RESULT segment_done 2" in out
    lease = json.loads((run / "LEASE.json").read_text())
    assert lease["released"] and lease["acquired_at"] >= killed["expires_at"] - 1.0  # took over once it expired
    steps, ids = _consumed(run)
    assert steps == list(range(len(steps))) and len(set(ids)) == len(ids)
