"""Fork and replay on a real run (issue 16 item 8, docs/deployment.md).

One real tiny run per module (its own process and private Ray: 4 steps of 4 groups x 2 samples,
a checkpoint every step), then in the same process `miles fork` at step 1 with a changed loss flag
(the prepared root is copied aside as it was) and the continuation of the fork with exactly the
flags the fork printed. Pins:
- the fork's root holds the origin record, step 1's checkpoint byte for byte as LATEST, the shared
  history (manifests 0..1) and exactly the source's groups not consumed or rejected through step 1
  (checked with pyarrow against the source, independently of miles_core); the source is unchanged;
- the printed command continues it from step 2 with the changed flag, every group trained once
  across the lineage, step 2 served from the carried groups;
- `miles replay` retrains steps 0..3 from the recorded groups without Ray or engines and
  reproduces every recorded train/* metric within 1e-6 (measured: bit-identical on CPU); on the
  fork it reproduces the continuation from the copied checkpoint and, reading the shared history's
  groups from the source, steps 0..1; with a changed loss flag it writes elsewhere and the
  source's files are untouched;
- bad inputs (missing run, step without checkpoint, existing id, model/dataset flags, flags a
  replay cannot honour) exit != 0 with a message naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest

from miles_core import cli

from tests.support.timeouts import RUN_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny-reverse4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--eval-prompt-data", "--eval-interval", "none",
        "--no-progress", "--save-interval", "1"]
# The source run, the fork (through the CLI), a copy of the prepared fork, then the printed command.
SCRIPT = """
import contextlib, io, json, shlex, shutil, sys
from miles_core import cli
from miles_core.config import parse_flags
from miles_core.driver.segment import run_training
storage = sys.argv[1]
run_training(parse_flags(["--storage-root", storage, "--run-id", "src", "--num-rollout", "4", *sys.argv[2:]]))
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = cli.main(["fork", f"file://{storage}/runs/src", "--at-step", "1", "--new-run", "fork",
                   "--eps-clip", "0.1", "--num-rollout", "5"])
print(out.getvalue(), flush=True)
assert rc == 0, rc
shutil.copytree(f"{storage}/runs/fork", f"{storage}/forked")
command = out.getvalue().strip().splitlines()[-1]
run_training(parse_flags(shlex.split(shlex.split(command)[-1])))
print("LINEAGE-DONE", command)
"""


@pytest.fixture(scope="module")
def lineage(tmp_path_factory):
    storage = tmp_path_factory.mktemp("lineage")
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's unix sockets live under it
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(storage), *TINY], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=RUN_SECONDS)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0 and "LINEAGE-DONE" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    return storage, proc.stdout


def _json(path: Path):
    return json.loads(path.read_text())


def _groups_by_object(run: Path) -> dict[str, set[str]]:
    """object path (relative to the run) -> its group ids, read with pyarrow alone."""
    out = {}
    for f in sorted((run / "buffer" / "groups").rglob("*.arrow")):
        table = pa.ipc.open_stream(pa.py_buffer(f.read_bytes())).read_all()
        out[str(f.relative_to(run))] = set(table.column("group_id").to_pylist())
    return out


def _consumed(run: Path, through: int | None = None) -> dict[int, dict]:
    by_step = {int(f.stem): _json(f) for f in (run / "buffer" / "consumed").glob("*.json")}
    return {s: m for s, m in sorted(by_step.items()) if through is None or s <= through}


def _tree_digest(run: Path) -> dict[str, str]:
    return {str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(run.rglob("*")) if f.is_file() and "replays" not in f.parts and "LEASE" not in f.name}


def test_fork_prepares_a_root_with_origin_checkpoint_and_unconsumed_groups(lineage):
    storage, out = lineage
    src, forked = storage / "runs" / "src", storage / "forked"
    origin = _json(forked / "FORK.json")
    assert origin["source_run"] == f"file://{src}" and origin["at_step"] == 1
    assert origin["overrides"]["--eps-clip"] == [0.2, 0.1] and origin["overrides"]["--num-rollout"] == [4, 5]
    status = _json(forked / "STATUS.json")
    assert (status["state"], status["last_step"], status["segment"]) == ("segment_done", 1, 0)
    cfg = _json(forked / "config.json")["config"]
    assert (cfg["run"]["run_id"], cfg["train"]["eps_clip"]) == ("fork", 0.1)

    assert (forked / "checkpoints" / "LATEST").read_text() == "step_00000001"
    assert sorted(p.name for p in (forked / "checkpoints").iterdir()) == ["LATEST", "step_00000001"]
    for f in (src / "checkpoints" / "step_00000001").iterdir():
        assert (forked / "checkpoints" / "step_00000001" / f.name).read_bytes() == f.read_bytes()

    history = _consumed(src, through=1)
    assert _consumed(forked) == history  # the shared history: manifests 0..1, verbatim
    taken = {g for m in history.values() for g in m["consumed"] + m["rejected"]}
    source_objects = _groups_by_object(src)
    unconsumed = set().union(*source_objects.values()) - taken
    fork_objects = _groups_by_object(forked)
    carried = set().union(*fork_objects.values()) - taken
    assert carried == unconsumed and origin["groups_carried"] == len(unconsumed) > 0
    assert all(ids - taken for ids in fork_objects.values())  # no object copied without a group to serve
    assert all(source_objects[k] == ids for k, ids in fork_objects.items())  # copies of the source's objects
    assert "continue it with:" in out and "--eps-clip=0.1" in out and "--run-id=fork" in out


def test_the_printed_command_continues_the_fork_from_step_k_plus_1(lineage):
    storage, _ = lineage
    src, fork = storage / "runs" / "src", storage / "runs" / "fork"
    status = _json(fork / "STATUS.json")
    assert (status["state"], status["last_step"], status["segment"]) == ("finished", 4, 1)
    assert _json(fork / "config_segment_0001.json")["config"]["train"]["eps_clip"] == 0.1
    by_step = _consumed(fork)
    assert sorted(by_step) == list(range(5)) and all(len(m["consumed"]) == 4 for m in by_step.values())
    ids = [g for m in by_step.values() for g in m["consumed"]]
    assert len(set(ids)) == len(ids), "a group was trained twice across the fork"
    assert {s: m["consumed"] for s, m in by_step.items() if s <= 1} == \
        {s: m["consumed"] for s, m in _consumed(src, through=1).items()}
    forked_groups = set().union(*_groups_by_object(storage / "forked").values())
    assert set(by_step[2]["consumed"]) <= forked_groups  # the carried backlog is served first
    steps = {json.loads(line)["step"] for f in (fork / "metrics" / "trainer").glob("*.jsonl")
             for line in f.read_text().splitlines()}
    assert steps == set(range(5))  # the history 0..1 carried over, 2..4 trained by the fork


def test_replay_reproduces_the_recorded_losses(lineage):
    """Tolerance 1e-6 absolute on every train/* metric (the same CPU kernels, threads and inputs
    give identical floats; measured 0.0)."""
    from miles_core.lineage.replay import replay_run
    from miles_core.metrics.sink import read_metrics

    storage, _ = lineage
    src = storage / "runs" / "src"
    before = _tree_digest(src)
    result = replay_run(f"file://{src}", steps=4)
    assert [s.step for s in result.losses] == [0, 1, 2, 3] and result.overrides == {}
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-6, result.losses
    out = Path(result.out_uri[len("file://"):])
    assert out.parent == src / "replays"
    recorded = {(e["step"], e["name"]): e["value"] for e in read_metrics(f"file://{src}", "trainer")}
    replayed = {(e["step"], e["name"]): e["value"] for e in read_metrics(result.out_uri, "trainer")}
    compared = [k for k in replayed if k[1].startswith("train/") and not k[1].endswith("_seconds")]
    assert len(compared) > 4 * 5
    for key in compared:
        assert replayed[key] == pytest.approx(recorded[key], abs=1e-6, nan_ok=True), key
    assert _json(out / "REPLAY.json")["max_abs_loss_diff"] == result.max_abs_diff
    assert _tree_digest(src) == before  # the source's own data untouched


def test_replay_of_the_fork_reproduces_its_continuation_and_its_shared_history(lineage):
    """From the copied checkpoint of step 1, steps 2..4 as the fork trained them (so the fork resumed
    the very state it copied); from step 0 with the source's --eps-clip, steps 0..1 as the source
    trained them, their groups read from the source run through FORK.json."""
    from miles_core.lineage.replay import replay_run

    storage, _ = lineage
    fork = f"file://{storage}/runs/fork"
    continued = replay_run(fork, from_step=1)
    assert [s.step for s in continued.losses] == [2, 3, 4]
    assert continued.max_abs_diff is not None and continued.max_abs_diff <= 1e-6, continued.losses
    history = replay_run(fork, steps=2, flags=["--eps-clip", "0.2"])
    assert [s.step for s in history.losses] == [0, 1]
    assert history.max_abs_diff is not None and history.max_abs_diff <= 1e-6, history.losses


def test_replay_with_a_changed_loss_flag_writes_elsewhere(lineage, capsys):
    storage, _ = lineage
    src = storage / "runs" / "src"
    before = _tree_digest(src)
    out = storage / "ablation"
    assert cli.main(["replay", f"file://{src}", "--steps", "1", "--out", str(out), "--entropy-coef", "0.05"]) == 0
    report = _json(out / "REPLAY.json")
    assert report["overrides"] == {"--entropy-coef": [0.0, 0.05]} and report["steps"] == 1
    step0 = report["losses"][0]
    assert step0["replayed"] != pytest.approx(step0["recorded"], abs=1e-6)  # the entropy bonus enters the loss
    assert "written to" in capsys.readouterr().out
    assert _tree_digest(src) == before


@pytest.mark.parametrize("argv,needle", [
    (["fork", "file:///nonexistent/runs/x", "--at-step", "0", "--new-run", "y"], "no run at file:///nonexistent/runs/x"),
    (["fork", "{src}", "--at-step", "7", "--new-run", "y"], "complete checkpoints: 0, 1, 2, 3"),
    (["fork", "{src}", "--at-step", "1", "--new-run", "fork"], "already exists"),
    (["fork", "{src}", "--at-step", "1", "--new-run", "y", "--tiny-hidden-size", "64"], "--tiny-hidden-size"),
    (["fork", "{src}", "--at-step", "1", "--new-run", "y", "--prompt-data", "x.jsonl"], "--prompt-data"),
    (["fork", "{src}", "--at-step", "1", "--new-run", "y", "--run-id", "z"], "--new-run"),
    (["fork", "{src}", "--at-step", "3", "--new-run", "y"], "nothing left to train"),
    (["fork", "{src}", "--new-run", "y"], "--at-step and --new-run are required"),
    (["fork", "{src}", "--at-step", "1", "--new-run", "../y"], "--new-run"),
    (["replay", "file:///nonexistent/runs/x"], "no run at"),
    (["replay", "{src}", "--steps", "9"], "at most 4"),
    (["replay", "{src}", "--rollout-batch-size", "8"], "--rollout-batch-size"),
    (["replay", "{src}", "--from-step", "9"], "complete checkpoints: 0, 1, 2, 3"),
])
def test_bad_inputs_exit_nonzero_naming_the_problem(lineage, capsys, argv, needle):
    storage, _ = lineage
    argv = [a.replace("{src}", f"file://{storage}/runs/src") for a in argv]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (storage / "runs" / "y").exists()
