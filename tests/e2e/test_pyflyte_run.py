"""End to end: the real `pyflyte run workflows/fully_async.py fully_async_rl` on CPU.

Real parts only: local Ray, the CPU engine server, the durable buffer on file://, Megatron-core on
CPU, the eval follower on exported snapshots, the report task. Pins that the product works as a
whole: the run learns (the reward rises well above the first steps), the run root holds every
artifact docs/quickstart.md#where-the-run-lives lists, and a second segment resumes from the checkpoint without training any
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

from tests.support.timeouts import SLOW_COMMAND_SECONDS, SLOW_RUN_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))


# Each run's local Ray lives here (RAY_TMPDIR; short, since Ray's unix sockets live under it), so its logs
# are this run's and not those of a Ray started by a test running beside it.
RAY_TMP = tempfile.mkdtemp(prefix="mr", dir="/tmp")


def _run(storage: Path, flags: str, segment_steps: int = 0, timeout: int = SLOW_RUN_SECONDS) -> subprocess.CompletedProcess:
    if "--preset" not in flags:  # the embedded default's settings, as `./dev run` names them
        flags = f"--preset tiny-reverse4 {flags}"
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


# Start-up noise a run's console used to show, none of it the user's to act on: Ray's notice that it
# enabled its default token authentication, the plugin's second ray.init, Megatron's deprecation of its
# own default, transformers' progress bar for one shard; and no traceback in a run that succeeded.
NOISE = ("Token authentication is enabled for this Ray cluster", "Calling ray.init() again",
         "full scope is deprecated", "UserWarning", "Writing model shards", "Traceback")


def _assert_quiet(console: str) -> None:
    found = [n for n in NOISE if n in console]
    assert not found, f"the console of a successful run shows {found}:\n{console[-3000:]}"


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


def _miles(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("miles")), *args], capture_output=True, text=True,
                          timeout=SLOW_COMMAND_SECONDS)


def _assert_runs_show_and_lineage(run: Path, consumed: list[str]) -> None:
    """`miles runs show` and `miles lineage` on this real run agree with its run root."""
    shown = _miles("runs", "show", str(run), "--json")
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["status"]["state"] == "finished" and [g["segment"] for g in summary["segments"]] == [0, 1]
    assert summary["checkpoints"]["latest"] == 49 and 19 in summary["checkpoints"]["steps"]
    assert summary["lease"]["released"] and summary["buffer"]["consumed"] == len(consumed)
    assert [r["step"] for r in summary["eval"]["heldout"]][-1] == 49 and 49 in summary["snapshots"]
    text = _miles("runs", "show", str(run))
    assert text.returncode == 0 and "finished" in text.stdout and "LATEST 49" in text.stdout, text.stdout

    manifest = json.loads((run / "buffer" / "consumed" / "00000021.json").read_text())  # second segment's step 21
    group = manifest["consumed"][0]
    traced = _miles("lineage", str(run), group, "--json")
    assert traced.returncode == 0, traced.stderr
    t = json.loads(traced.stdout)
    assert t["fate"] == {"step": 21, "outcome": "consumed"} and t["checkpoint"] == 29 and t["snapshot"] == 24  # 29: the first segment ended there
    assert len(t["samples"]) == 8 and all(sum(s["versions"].values()) == s["response_tokens"] for s in t["samples"])
    assert t["eval"]["heldout"]["before"] is None and t["eval"]["heldout"]["after"]["step"] == 24
    assert "trained at step 21" in _miles("lineage", str(run), group).stdout
    unknown = _miles("lineage", str(run), "e9-p9-a9")
    assert unknown.returncode == 1 and "no group 'e9-p9-a9'" in unknown.stderr, unknown.stderr
    missing = _miles("runs", "show", str(run.parent / "nope"))
    assert missing.returncode == 1 and "no run at" in missing.stderr, missing.stderr


def _assert_mirrored(run: Path, wandb_dir: Path, rewards: dict[int, float]) -> None:
    """Both segments' events reached TensorBoard (event files in the run root) and W&B (offline runs
    of one run id), every step once, with the values of the run root's metrics."""
    from tests.support.sinks import scalars, wandb_history

    tb = dict(scalars(str(run / "tensorboard"))["rollout/reward/mean"])
    assert tb.keys() == rewards.keys() and all(abs(tb[s] - rewards[s]) < 1e-6 for s in rewards)
    segments = sorted(wandb_dir.glob("wandb/offline-run-*"))
    assert len(segments) == 2 and len({d.name.split("-", 3)[3] for d in segments}) == 1, segments  # one run id
    logged = [(row["step"], row["rollout/reward/mean"]) for d in segments for row in wandb_history(str(d))
              if "rollout/reward/mean" in row]
    assert sorted(s for s, _ in logged) == sorted(rewards)


def test_fully_async_rl_learns_and_leaves_a_complete_run_root(tmp_path):
    """A short fully async run learns (last-5-step reward >= 2x the first 5 and >= 0.25), writes
    config, prompts, buffer objects, per-step consumed manifests, checkpoints with COMPLETE and
    LATEST, eval snapshots with .complete, eval results, metrics and the report; then a second
    segment continues from the checkpoint and no group id is consumed twice across segments."""
    started = time.time()
    flags = ("--num-rollout 50 --save-interval 20 --eval-interval 25 "
             "--eval-prompt-data heldout=builtin:reverse4-heldout --run-id e2e "
             f"--use-tensorboard --use-wandb --wandb-mode offline --wandb-dir {tmp_path / 'wb'}")
    first = _run(tmp_path, flags, segment_steps=30)
    _assert_quiet(first.stdout + first.stderr)
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
    _assert_mirrored(run, tmp_path / "wb", rewards)
    _assert_runs_show_and_lineage(run, ids)
    _assert_no_canary_under(run)  # logs, metrics, configs, report, buffer, checkpoints, TensorBoard files
    _assert_no_canary_under(tmp_path / "wb")  # W&B's offline files
    _assert_no_canary_under(Path(RAY_TMP))  # the driver's, actors' and raylet's logs
    # This run's engine logs (a test running beside it may have engines of its own): the token was live.
    engine_logs = [f for d in Path(tempfile.gettempdir()).glob("miles-engine-*") if d.stat().st_mtime >= started
                   for f in d.glob("*.log") if str(run) in f.read_text()]
    assert len(engine_logs) >= 2, "no engine log of this run (rollout and eval engines)"
    for f in engine_logs:
        _assert_no_canary(f.read_text(), str(f))
        assert "API token required" in f.read_text(), f"{f}: the engine ran without the token"
