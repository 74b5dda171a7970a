"""End to end: the real `pyflyte run workflows/fully_async.py fully_async_rl` on CPU.

Real parts only: local Ray, the CPU engine server, the durable buffer on file://, Megatron-core on
CPU, the eval follower on exported snapshots, the report task. Pins that the product works as a
whole: the run learns (the reward rises well above the first steps), the run root holds every
artifact DESIGN §3 lists, and a second segment resumes from the checkpoint without training any
group twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))


# Each run's local Ray lives here (RAY_TMPDIR; short, since Ray's unix sockets live under it), so its logs
# are this run's and not those of a Ray started by a test running beside it.
RAY_TMP = tempfile.mkdtemp(prefix="mr", dir="/tmp")


def _run(storage: Path, flags: str, segment_steps: int = 0, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [PYFLYTE, "run", "workflows/fully_async.py", "fully_async_rl", "--flags", flags,
           "--storage_root", str(storage)]
    if segment_steps:
        cmd += ["--segment_steps", str(segment_steps)]
    env = dict(os.environ, RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", RAY_TMPDIR=RAY_TMP, **CANARIES)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"pyflyte run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    _assert_no_canary(proc.stdout + proc.stderr, "the pyflyte run's console")
    return proc


# Secrets in the run's environment (the engine token is live: every engine requires it, so every caller
# must send it). None may appear in the console, logs, metrics, configs, reports or anything in the run root.
CANARIES = {"MILES_ENGINE_API_KEY": "canary-engine-5be1d0", "AWS_SECRET_ACCESS_KEY": "canary-aws-9c2e77",
            "WANDB_API_KEY": "canary-wandb-41f8aa"}


def _assert_no_canary(text: str, where: str) -> None:
    leaked = [v for v in CANARIES.values() if v in text]
    assert not leaked, f"{where} shows the secret(s) {leaked}"


def _assert_no_canary_under(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            _assert_no_canary(f.read_bytes().decode("latin-1"), str(f))


def _reward_by_step(run_uri: str) -> dict[int, float]:
    from miles_core.metrics.sink import read_metrics

    return {e["step"]: e["value"] for e in read_metrics(run_uri, "trainer") if e["name"] == "rollout/reward/mean"}


def _consumed_ids(run: Path) -> list[str]:
    ids = []
    for f in sorted((run / "buffer" / "consumed").glob("*.json")):
        ids += json.loads(f.read_text())["consumed"]
    return ids


def test_fully_async_rl_learns_and_leaves_a_complete_run_root(tmp_path):
    """A short fully async run learns (last-5-step reward >= 2x the first 5 and >= 0.25), writes
    config, prompts, buffer objects, per-step consumed manifests, checkpoints with COMPLETE and
    LATEST, eval snapshots with .complete, eval results, metrics and the report; then a second
    segment continues from the checkpoint and no group id is consumed twice across segments."""
    started = time.time()
    flags = ("--num-rollout 50 --save-interval 20 --eval-interval 25 "
             "--eval-prompt-data heldout=builtin:reverse4-heldout --run-id e2e")
    _run(tmp_path, flags, segment_steps=30)
    run = tmp_path / "runs" / "e2e"
    status = json.loads((run / "STATUS.json").read_text())
    assert status["state"] == "segment_done" and status["last_step"] == 29, status

    _run(tmp_path, flags)  # second segment: steps 30..49
    status = json.loads((run / "STATUS.json").read_text())
    assert status["state"] == "finished" and status["last_step"] == 49, status

    rewards = _reward_by_step(f"file://{run}")
    assert sorted(rewards) == list(range(50)), sorted(rewards)
    first, last = [rewards[s] for s in range(5)], [rewards[s] for s in range(45, 50)]
    assert sum(last) / 5 >= max(0.25, 2 * sum(first) / 5), (first, last)

    for rel in ("config.json", "config_segment_0001.json", "data/prompts.arrow", "checkpoints/LATEST",
                "checkpoints/step_00000019/COMPLETE", "checkpoints/step_00000049/COMPLETE",
                "snapshots/step_00000024/.complete", "snapshots/step_00000049/.complete",
                "eval/step_00000049/heldout.json", "report.html"):
        assert (run / rel).exists(), rel
    assert list((run / "buffer" / "groups").rglob("*.arrow"))
    assert len(list((run / "buffer" / "consumed").glob("*.json"))) == 50
    assert list((run / "metrics" / "trainer").glob("*.jsonl"))
    ids = _consumed_ids(run)
    assert len(ids) == 50 * 32 and len(set(ids)) == len(ids), "a group was consumed twice"
    _assert_no_canary_under(run)  # logs, metrics, configs, report, buffer, checkpoints
    _assert_no_canary_under(Path(RAY_TMP))  # the driver's, actors' and raylet's logs
    # This run's engine logs (a test running beside it may have engines of its own): the token was live.
    engine_logs = [f for d in Path(tempfile.gettempdir()).glob("miles-engine-*") if d.stat().st_mtime >= started
                   for f in d.glob("*.log") if str(run) in f.read_text()]
    assert len(engine_logs) >= 2, "no engine log of this run (rollout and eval engines)"
    for f in engine_logs:
        _assert_no_canary(f.read_text(), str(f))
        assert "API token required" in f.read_text(), f"{f}: the engine ran without the token"
