"""Two Ray nodes that share nothing but object storage (docs/training.md), on one machine.

tests/support/two_nodes.py: the head (driver, trainer: resource `head_node`) and an engine node
started with `ray start` inside its own network and mount namespaces (a veth pair with one test
address on each side; tmpfs over /tmp and ~/.cache), the run root on a SeaweedFS S3 server listening
on the head's address. The real `pyflyte run` joins the cluster through RAY_ADDRESS and pins roles
with --trainer-custom-resource / --engine-custom-resource, with MILES_ENGINE_API_KEY on both nodes
and the default --engine-bind-host (auto).

Pins: the private mounts are in effect (a file the head writes is invisible on the engine node, and
one the engine node writes is invisible to the head); the engine node has its own network (a server
on the head's 127.0.0.1 is unreachable from it; Ray sees it at its own address); the engines listen
and are called on the engine node's address; the embedded default learns by the §10 bar (150 steps:
last 10% mean >= 0.6 and >= 5x the first 5 steps) with the store weight transport; every consumed
group is consumed exactly once; the engines copied weights into their own node's cache (the head's
node cache holds no pushed weights); the cluster leaves no process, interface or server behind.
Guards: engines bound to 127.0.0.1 on their node, called from the head (refused connections; the
run fails with `--engine-bind-host 127.0.0.1` on this cluster).
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from miles_core.engines.auth import TOKEN_ENV
from miles_core.storage import Store
from tests.support.timeouts import HTTP_SECONDS, MULTI_NODE_RUN_SECONDS
from tests.support.two_nodes import BUCKET, TwoNodeCluster

CLUSTER_COMMAND_SECONDS = 180  # a driver that joins the cluster and runs one task on the engine node

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 150


@pytest.fixture()
def cluster(tmp_path, monkeypatch):
    c = TwoNodeCluster({"MILES_CACHE_DIR": str(tmp_path / "head-cache"), TOKEN_ENV: uuid.uuid4().hex})
    try:
        c.start()
        for k, v in c.s3.env().items():  # this process reads the run root from the cluster's S3 server
            monkeypatch.setenv(k, v)
        yield c
    finally:
        c.stop()
    assert c.leftovers() == []


def _on_engine_node(cluster: TwoNodeCluster, code: str | None) -> str:
    """Run `code` (it prints its answer) in a process started by a Ray task pinned to the engine node;
    `None`: the task's node address as Ray sees it."""
    task = ("lambda c: ray.util.get_node_ip_address() if c is None else "
            "subprocess.run([sys.executable, '-c', c], capture_output=True, text=True).stdout")
    driver = ("import ray, subprocess, sys; ray.init(address=%r)\n"
              "f = ray.remote(resources={'engine_node': 0.001})(%s)\n"
              "print(ray.get(f.remote(%r)), end='')" % (cluster.address, task, code))
    return subprocess.run([sys.executable, "-c", driver], env=cluster.env, capture_output=True, text=True,
                          timeout=CLUSTER_COMMAND_SECONDS, check=True).stdout.strip().splitlines()[-1]


def _pyflyte(cluster: TwoNodeCluster, storage: str, flags: str, env: dict[str, str] | None = None):
    """The real `pyflyte run` of the workflow, its driver joined to the cluster (RAY_ADDRESS)."""
    cmd = [str(Path(sys.executable).with_name("pyflyte")), "run", "workflows/fully_async.py", "fully_async_rl",
           "--flags", flags, "--storage_root", storage]
    env = {**cluster.env, "RAY_ADDRESS": cluster.address, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=MULTI_NODE_RUN_SECONDS)


def _fetch(url: str) -> str:
    """Code that prints `ok` when `url` answers, else the error's class."""
    return ("import urllib.request\ntry:\n    urllib.request.urlopen(%r, timeout=%r); print('ok')\n"
            "except Exception as e:\n    print(type(e).__name__)" % (url, HTTP_SECONDS))


def _head_loopback_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.mark.timeout(1500)  # 330 s alone, 600 s beside CI's other lane and a third run on two cores
def test_engine_node_shares_nothing_local_with_the_head_and_the_run_learns(cluster, tmp_path):
    head_file = tmp_path / "written-by-head"
    head_file.write_text("head")
    assert _on_engine_node(cluster, f"import os; print(os.path.exists({str(head_file)!r}))") == "False"
    engine_file = f"/tmp/written-by-engine-{uuid.uuid4().hex}"
    assert _on_engine_node(cluster, f"open({engine_file!r}, 'w').write('x'); print('ok')") == "ok"
    assert not os.path.exists(engine_file)

    server, url = _head_loopback_server()  # 127.0.0.1 of the head: reachable here, not from the engine node
    try:
        here = subprocess.run([sys.executable, "-c", _fetch(url)], capture_output=True, text=True).stdout.strip()
        assert here == "ok"
        assert _on_engine_node(cluster, _fetch(url)) == "URLError"
    finally:
        server.shutdown()
    assert _on_engine_node(cluster, _fetch(cluster.s3.endpoint)) in ("ok", "HTTPError")  # the S3 server answers
    assert _on_engine_node(cluster, None) == cluster.engine_ip

    storage = f"s3://{BUCKET}/two-nodes-{uuid.uuid4().hex[:8]}"
    flags = ("--preset tiny-reverse4 --trainer-custom-resource head_node --engine-custom-resource engine_node --num-cpus-per-engine 1 "
             "--num-cpus-trainer 1 --save-interval 50 --eval-interval none --eval-prompt-data")
    # Without the token the driver refuses the run once it sees two nodes, before any role starts.
    refused = _pyflyte(cluster, storage, f"{flags} --num-rollout 1 --run-id refused", {TOKEN_ENV: ""})
    said = " ".join((refused.stdout + refused.stderr).split())  # the console wraps long lines
    assert refused.returncode != 0 and "--engine-bind-host=auto on this 2-node cluster" in said, said[-3000:]
    assert TOKEN_ENV in said

    t0 = time.monotonic()
    proc = _pyflyte(cluster, storage, f"{flags} --num-rollout {STEPS} --run-id two")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    print(f"two nodes: pyflyte run took {time.monotonic() - t0:.0f} s")
    # The engine actors logged the URL each handed the run (the trainer, the rollout manager): the engine
    # node's address, where the server listens (`--host`).
    logs = "".join(p.read_text(errors="replace") for p in cluster.engine_node_logs())
    urls = set(re.findall(r"engine-\d+: healthy at (http://[\d.]+:\d+)", logs))
    assert urls and all(u.startswith(f"http://{cluster.engine_ip}:") for u in urls), urls
    assert f"--host {cluster.engine_ip} " in logs

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
