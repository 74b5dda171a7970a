"""An S3-only run survives its node caches being deleted mid-run (docs/training.md), its weight versions
written as bf16 deltas (docs/weight-versions.md).

The real `pyflyte run` with the run root on SeaweedFS S3 and the node cache in a temp dir, at a learning
rate whose versions are sparse (`--lr 1e-6`: about 3.5% of the toy model's bf16 elements change per step;
deltas between anchors every 8 versions). Once the engines serve pushed weights, a thread deletes the
cached initial model (the trainer's local copy of its checkpoint: what it read config and tokenizer files
from at every export) every second, and the engine node's rebuilt weight versions every third second,
each once a copy of it has completed since its last deletion, while the run trains and checkpoints. The
trainer keeps what it needs in memory and every role re-fetches from the run root: the run finishes all
its steps, versions were written as deltas, the engine's node rebuilt some from their anchor (its local
base deleted), and no checksum failed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from miles_core.metrics import names as N
from miles_core.metrics import read_metrics
from miles_core.storage import Store
from miles_core.storage.node_local import MARKER

from tests.support.timeouts import SLOW_RUN_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_s3_run_completes_while_its_node_caches_are_deleted(seaweed, s3_bucket, tmp_path):
    cache = tmp_path / "node-cache"
    storage = f"s3://{s3_bucket}/cache-{uuid.uuid4().hex[:8]}"
    stop, deletions = threading.Event(), []

    def complete(kind: str) -> bool:  # the node finished a copy of this kind since it was last deleted
        return any((entry / MARKER).exists() for entry in (cache / kind).glob("*"))

    def clean():
        # A cleaner that deleted on a clock faster than a loaded machine copies would never let a copy
        # finish (each is tried again, up to CACHE_REMOVED_RETRIES): it deletes a kind only once a copy of
        # it completed, which still lands deletions under copies in progress.
        ticks = 0
        while not stop.wait(1.0):
            ticks += 1
            if complete("weights"):  # the engines serve pushed weights
                if complete("models"):
                    shutil.rmtree(cache / "models", ignore_errors=True)
                    deletions.append(1)
                if ticks % 3 == 0:
                    shutil.rmtree(cache / "weights", ignore_errors=True)  # the base of the next delta

    cleaner = threading.Thread(target=clean, daemon=True)
    env = {**__import__("os").environ, **seaweed.env(), "MILES_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    flags = ("--preset tiny-reverse4 --num-rollout 25 --run-id cache --save-interval 10 --eval-interval none "
             "--eval-prompt-data --lr 1e-6 --weight-anchor-interval 8")
    cmd = [str(Path(sys.executable).with_name("pyflyte")), "run", "workflows/fully_async.py", "fully_async_rl",
           "--flags", flags, "--storage_root", storage]
    cleaner.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SLOW_RUN_SECONDS)
    finally:
        stop.set()
        cleaner.join()
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    status = Store(f"{storage}/runs/cache").get_json("STATUS.json")
    assert status["state"] == "finished" and status["last_step"] == 24, status
    assert deletions, "the cache was never there to delete"
    events = list(read_metrics(Store(f"{storage}/runs/cache")))

    def series(name: str) -> dict[int, float]:
        return {e["step"]: e["value"] for e in events if e["name"] == name}

    anchors = series(N.WEIGHTS_ANCHOR)
    anchor_steps = sorted(s for s, a in anchors.items() if a)
    assert len(anchors) == 25 and anchor_steps[:2] == [0, 1] and len(anchor_steps) <= 6, anchors
    assert all(b - a <= 8 for a, b in zip(anchor_steps, anchor_steps[1:] + [25])), anchor_steps  # every 8 at least
    assert max(v for s, v in series(N.WEIGHTS_VERSION_BYTES).items() if not anchors[s]) < 0.2 * series(
        N.WEIGHTS_VERSION_BYTES)[0]
    assert sum(series(N.WEIGHTS_ANCHOR_READS).values()) >= 1  # a delivery whose base the cleaner had deleted
    assert not any(series(N.WEIGHTS_CHECKSUM_FAILURES).values())
