"""Two Ray nodes that share nothing but object storage (DESIGN §15), on one machine.

tests/support/two_nodes.py: the head (driver, trainer: resource `head_node`) and an engine node
started with `ray start` inside its own mount namespace (`unshare -m`) with tmpfs over /tmp and
~/.cache, the run root on the SeaweedFS S3 server. The real `pyflyte run` joins the cluster through
RAY_ADDRESS and pins roles with --trainer-custom-resource / --engine-custom-resource.

Pins: the private mounts are in effect (a file the head writes is invisible on the engine node, and
one the engine node writes is invisible to the head); the embedded default learns by the §10 bar
(150 steps: last 10% mean >= 0.6 and >= 5x the first 5 steps) with the store weight transport;
every consumed group is consumed exactly once; the engines copied weights into their own node's
cache (the head's node cache holds no pushed weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from miles_core.storage import Store
from tests.support.two_nodes import TwoNodeCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 150


@pytest.fixture()
def cluster(seaweed, tmp_path):
    c = TwoNodeCluster({**seaweed.env(), "MILES_CACHE_DIR": str(tmp_path / "head-cache")}).start()
    try:
        yield c
    finally:
        c.stop()


def _on_engine_node(cluster: TwoNodeCluster, code: str) -> str:
    """Run `code` (it prints its answer) as a Ray task pinned to the engine node."""
    driver = ("import ray, subprocess, sys; ray.init(address=%r)\n"
              "f = ray.remote(resources={'engine_node': 0.001})(lambda c: subprocess.run([sys.executable, '-c', c], "
              "capture_output=True, text=True).stdout)\n"
              "print(ray.get(f.remote(%r)), end='')" % (cluster.address, code))
    return subprocess.run([sys.executable, "-c", driver], env=cluster.env, capture_output=True, text=True,
                          timeout=180, check=True).stdout.strip().splitlines()[-1]


def test_engine_node_sees_nothing_local_of_the_head_and_the_run_learns(cluster, s3_bucket, tmp_path):
    head_file = tmp_path / "written-by-head"
    head_file.write_text("head")
    assert _on_engine_node(cluster, f"import os; print(os.path.exists({str(head_file)!r}))") == "False"
    engine_file = f"/tmp/written-by-engine-{uuid.uuid4().hex}"
    assert _on_engine_node(cluster, f"open({engine_file!r}, 'w').write('x'); print('ok')") == "ok"
    assert not os.path.exists(engine_file)

    storage = f"s3://{s3_bucket}/two-nodes-{uuid.uuid4().hex[:8]}"
    flags = (f"--num-rollout {STEPS} --run-id two --trainer-custom-resource head_node "
             "--engine-custom-resource engine_node --num-cpus-per-engine 1 --num-cpus-trainer 1 "
             "--save-interval 50 --eval-interval none --eval-prompt-data")
    env = {**cluster.env, "RAY_ADDRESS": cluster.address, "PYTHONUNBUFFERED": "1"}
    cmd = [str(Path(sys.executable).with_name("pyflyte")), "run", "workflows/fully_async.py", "fully_async_rl",
           "--flags", flags, "--storage_root", storage]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    run = Store(f"{storage}/runs/two")
    status = run.get_json("STATUS.json")
    assert status["state"] == "finished" and status["last_step"] == STEPS - 1, status
    from miles_core.metrics.sink import read_metrics

    rewards = {e["step"]: e["value"] for e in read_metrics(run.uri(), "trainer") if e["name"] == "rollout/reward/mean"}
    first = sum(rewards[s] for s in range(5)) / 5
    tail = [rewards[s] for s in range(STEPS - STEPS // 10, STEPS)]
    last = sum(tail) / len(tail)
    print(f"two nodes: reward first 5 steps {first:.3f}, last {len(tail)} steps {last:.3f}")
    assert last >= 0.6 and last >= 5 * first, (first, last)

    ids = [g for k in run.list("buffer/consumed") if k.endswith(".json") for g in run.get_json(k)["consumed"]]
    assert len(ids) == STEPS * 32 and len(set(ids)) == len(ids), "a group was consumed twice"
    head_cache = Path(cluster.env["MILES_CACHE_DIR"])
    assert (head_cache / "models").is_dir(), "the trainer copied its initial model to the head node"
    assert not (head_cache / "weights").exists(), "pushed weights landed in the head's cache"
