"""Faults a real run must ride out (issue 16 item 2; docs/engines.md).

Each test runs `run_training` as tests/chaos/runner.py does (driver, private Ray, actors, CPU engine
server), injects one fault, and lets tests/chaos/checker.py (no project code) audit the run root.
- S3 outage: the SeaweedFS server is SIGKILLed mid-run and restarted on the same data after 10 s;
  the run waits with logged retries (miles_core.storage: backoff to a 60 s deadline) and finishes;
  nothing partial is visible (no temporary key; every object decodes).
- Engine SIGKILLed mid-generation: its requests come back aborted, their groups are rejected and go
  to the unused-samples handler (retry: counted as recycled), the actor restarts the engine (requests
  sent meanwhile wait for it rather than abort), the run finishes, exactly once.
- Trainer rank 0 SIGKILLed in a 2-rank run: the segment fails as recoverable (exit 75:
  miles_core.failures.is_infrastructure), and the retried segment resumes and finishes (two
  segments of a 2-rank run, ~2 min). Rank 0 is killed while a push that did not wait for its delivery
  is held inside that delivery (the rollout side's, engines paused): the driver, waiting for a batch
  that can no longer come, learns it from the ranks' pending `alive` calls in its one wait
  (miles_core.driver.switchboard), with no polling.
Timings are printed (`FAULT ...` lines; `pytest -s` shows them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.chaos.checker import check, metric_total
from tests.chaos.runner import RECOVERABLE, Segment
from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, start_seaweed

OUTAGE_SECONDS = 10  # how long the S3 server stays down: the outage is the fault under test
MILESTONE_SECONDS = 300  # the segment's start to a milestone (2 trained steps, an engine inside a /generate)
RECOVERY_SECONDS = 120  # the fault's end to the run going on (a step trained, an engine restarted)
FINISH_SECONDS = 300  # the recovered segment, to its end
DELIVERY_SECONDS = 400  # a segment's start to its 5th weight delivery; also a retried segment to its end
FAILED_SECONDS = 180  # a segment whose trainer rank was killed, to its exit as a retryable failure

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, BATCH = 10, 8


def _flags(storage: str, run_id: str, *extra: str) -> list[str]:
    return ["--storage-root", storage, "--run-id", run_id, "--num-rollout", str(STEPS), "--rollout-batch-size",
            str(BATCH), "--save-interval", "3", "--eval-prompt-data", "--eval-interval", "none", "--no-progress",
            "--lease-ttl-seconds", "60", *extra]


def _manifests(run: Path) -> int:
    d = run / "buffer" / "consumed"
    return len(list(d.glob("*.json"))) if d.exists() else 0



def test_s3_outage_of_10_seconds_is_waited_out(tmp_path):
    import s3fs

    server = start_seaweed()
    fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key=ACCESS_KEY, secret=SECRET_KEY, skip_instance_cache=True,
                           use_listings_cache=False)
    root = f"miles-chaos/outage-{uuid.uuid4().hex[:8]}"
    seg = None
    try:
        fs.mkdir("miles-chaos")
        seg = Segment(_flags(f"s3://{root}", "s3fault"), tmp_path / "segment.log", dict(os.environ, **server.env()))
        started = seg.wait_for(lambda: len(fs.ls(f"{root}/runs/s3fault/buffer/consumed", refresh=True)
                                          if fs.exists(f"{root}/runs/s3fault/buffer/consumed") else []) >= 2,
                               MILESTONE_SECONDS, "2 trained steps")
        fs.invalidate_cache()
        before = len(fs.ls(f"{root}/runs/s3fault/buffer/consumed", refresh=True))
        t0 = time.monotonic()
        server.kill()
        time.sleep(OUTAGE_SECONDS)  # the behaviour under test: S3 down for this long
        server.restart()
        outage = time.monotonic() - t0
        fs.invalidate_cache()
        recovered = seg.wait_for(lambda: len(fs.ls(f"{root}/runs/s3fault/buffer/consumed", refresh=True)) > before,
                                 RECOVERY_SECONDS, "a step trained after the outage") - started - outage
        assert seg.finish(FINISH_SECONDS) == 0, seg.text()[-4000:]
        total = time.monotonic() - seg.started
        fs.invalidate_cache()
        keys = fs.find(root)
        assert not [k for k in keys if ".tmp-" in k], "a temporary (partial) object is visible"
        fs.get(f"{root}/runs/s3fault", str(tmp_path / "copy"), recursive=True)
    finally:
        left = seg.close() if seg else []
        server.stop()
    retries = [line for line in seg.text().splitlines() if "failed" in line and "retry" in line]
    print(f"FAULT s3 outage: {outage:.1f} s down; first step after it {recovered:.1f} s after the restart; "
          f"run {total:.1f} s; {len(retries)} logged retries")
    assert retries, "nothing retried during the outage: the fault was not exercised"
    assert "StorageUnavailable" not in seg.text()
    assert check(tmp_path / "copy", STEPS, BATCH, set()) == []
    assert not left, left


def test_engine_killed_mid_generation_is_restarted_and_the_run_completes(tmp_path):
    run = tmp_path / "runs" / "engfault"
    # The engine's 40th /generate holds its event loop once streaming (miles_core/failures/chaos.py): every
    # request on it is in flight when the test SIGKILLs it. The restarted engine does not stop again.
    env = dict(os.environ, MILES_CHAOS_POINT="engine.generate:40", MILES_CHAOS_DIR=str(tmp_path))
    marker = tmp_path / "reached-engine.generate"
    seg = Segment(_flags(str(tmp_path), "engfault", "--async-unused-samples-handler", "retry"), tmp_path / "segment.log",
                  env)
    try:
        seg.wait_for(lambda: marker.exists() and marker.read_text().strip(), MILESTONE_SECONDS,
                     "the engine inside a /generate")
        pid, t0 = int(marker.read_text()), time.monotonic()
        with contextlib.suppress(psutil.NoSuchProcess):  # its actor's health check may have killed it first
            psutil.Process(pid).send_signal(signal.SIGKILL)
        restarted = seg.wait_for(lambda: any(p.pid != pid for p in seg.descendants("miles_core.engines.cpu_server")),
                                 RECOVERY_SECONDS, "a restarted engine") - (t0 - seg.started)
        assert seg.finish(FINISH_SECONDS) == 0, seg.text()[-4000:]
        total = time.monotonic() - seg.started
    finally:
        left = seg.close()
    aborted = metric_total(run, "rollout/fully_async/aborted_groups_filtered")
    recycled = metric_total(run, "rollout/fully_async/unused_recycled")
    print(f"FAULT engine kill: new engine process {restarted:.1f} s after the kill; {aborted:g} aborted groups, "
          f"{recycled:g} recycled; run {total:.1f} s")
    assert "restarting" in seg.text(), "the engine actor did not report a restart"
    # The requests in flight at the kill came back aborted and their groups went to the retry handler;
    # requests sent while the engine restarted waited for it (EngineClient.refused_wait_seconds)
    # instead of aborting at once (before that wait: ~1000 aborted groups in this run).
    assert recycled >= 1 and aborted + recycled < 50, (aborted, recycled)
    assert check(run, STEPS, BATCH, set()) == []
    assert not left, left


def test_trainer_rank_0_killed_fails_recoverable_and_a_retry_resumes(tmp_path):
    run = tmp_path / "runs" / "rankfault"
    flags = _flags(str(tmp_path), "rankfault", "--actor-num-gpus-per-node", "2", "--num-cpus-trainer", "0.5",
                   "--num-cpus-per-engine", "0.5", "--lease-ttl-seconds", "10", "--max-weight-staleness", "1")
    # The 5th delivery (after step 3) stops inside, the engines paused (miles_core/failures/chaos.py writes
    # the id of the process delivering: the rollout manager's). With a staleness of 1 the rollout side
    # starts at most one batch beyond the version it was told: the driver trains step 4 and then waits
    # for step 5's batch, which only that delivery would let start. Rank 0 is killed then.
    marker = tmp_path / "reached-weights.push"
    env = dict(os.environ, MILES_CHAOS_POINT="weights.push:5", MILES_CHAOS_DIR=str(tmp_path))
    seg = Segment(flags, tmp_path / "segment1.log", env=env)
    try:
        seg.wait_for(lambda: marker.exists() and marker.read_text().strip(), DELIVERY_SECONDS,
                     "the 5th delivery, engines paused")
        assert int(marker.read_text()) in {p.pid for p in seg.descendants("RolloutManager")}
        ranks = sorted(seg.descendants("TrainerWorker"), key=lambda p: p.create_time())
        rank0 = ranks[0].pid
        t0 = time.monotonic()
        os.kill(rank0, signal.SIGKILL)
        rc = seg.finish(FAILED_SECONDS)
        failed_after = time.monotonic() - t0
    finally:
        left = seg.close()
    assert rc == RECOVERABLE, f"rc={rc}:\n{seg.text()[-4000:]}"
    assert not left, left
    retry = Segment(flags, tmp_path / "segment2.log")
    try:
        rc = retry.finish(DELIVERY_SECONDS)
        resumed = time.monotonic() - retry.started
    finally:
        left = retry.close()
    print(f"FAULT trainer rank kill: segment failed (recoverable) {failed_after:.1f} s after the kill; "
          f"retry ran {resumed:.1f} s")
    assert rc == 0, retry.text()[-4000:]
    status = json.loads((run / "STATUS.json").read_text())
    assert status["segment"] == 1, status
    assert check(run, STEPS, BATCH, set()) == []
    assert not left, left
