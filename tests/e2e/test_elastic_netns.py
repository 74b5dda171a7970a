"""A run with no engines of its own, fed by two producer jobs on network-isolated nodes (docs/elastic.md).

The trainer is the real `pyflyte run workflows/fully_async.py fully_async_rl` here, on its own local
Ray, with `--allow-rollout-producers --rollout-num-engines 0`: it only trains and publishes weights.
Each producer is the real `pyflyte run workflows/rollout_producer.py rollout_producer`, started on its
own isolated node (tests/support/netns_node.py: its own network and mount namespaces, private /tmp
and ~/.cache) with its own local Ray and engine. The nodes and the trainer share nothing but the run
root, on a SeaweedFS S3 server listening on a veth address of this machine that both nodes are routed
to; nothing on a node can reach this machine's 127.0.0.1.

Pins: the trainer finishes every step; every consumed group was committed by one of the two
producers (the manifests' writers are the writer ids of their heartbeats), each supplied some; the
independent checker (tests/chaos/checker.py) finds every step consumed once, no group consumed twice,
no prompt trained twice and the final checkpoint complete; the run learns (the last 10 steps' mean
reward well above the random-policy level); each producer stops by itself when the run finishes (its
`pyflyte run` exits 0 soon after the trainer's, its heartbeat says stopped because the run finished,
and nothing it started is left on its node); nothing of the setup is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles_core.storage import Store
from tests.chaos.checker import check
from tests.support.netns_node import IsolatedNode, missing_tools
from tests.support.seaweed import SeaweedS3, start_seaweed
from tests.support.timeouts import COMMAND_SECONDS, HTTP_SECONDS, wait_until
from tests.support.two_nodes import BUCKET, _processes

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(bool(missing_tools()), reason=f"network-isolated nodes need root with unshare, "
                                 f"nsenter and ip; missing here: {missing_tools()}")]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
STEPS, BATCH = 80, 32  # 32: the embedded default's --rollout-batch-size
PRODUCERS = ("p1", "p2")
RUN_ID = "elastic"
STOP_SECONDS = 60  # a producer notices the finished run within 5 s, then stops its engine and its Ray
STALL_SECONDS = 300  # no step trained for this long: the run is stuck (a step takes seconds here)
CONFIG_SECONDS = 900  # the trainer's pyflyte run, from its start to the run's config.json
GONE_SECONDS = 30  # a stopped run's processes (its local Ray, a node's producer, Ray and engine) end
NODE_POLL_SECONDS = 1  # how often the wait looks: each look lists every process of a node


@dataclass
class Setup:
    nodes: list[IsolatedNode]
    s3: SeaweedS3
    ray_tmp: str  # the trainer's local Ray (RAY_TMPDIR): its processes name it


def _trainer_pids(ray_tmp: str) -> set[int]:
    """The trainer's local Ray: processes naming its temp dir, and their descendants."""
    procs = _processes()
    ours = {pid for pid, (_, cmd, _) in procs.items() if ray_tmp in cmd}
    while more := {pid for pid, (ppid, _, _) in procs.items() if ppid in ours} - ours:
        ours |= more
    return ours - {os.getpid()}


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture()
def isolated(monkeypatch):
    nodes, s3, ray_tmp = [], None, tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's sockets live under it
    try:
        for _ in PRODUCERS:
            nodes.append(IsolatedNode().start())
        s3 = start_seaweed(ip=nodes[0].host_ip)  # this machine's end of the first node's pair
        for node in nodes[1:]:
            node.route_to(s3.ip)
        for k, v in s3.env().items():  # this process reads the run root from the S3 server
            monkeypatch.setenv(k, v)
        Store(f"s3://{BUCKET}").fs.mkdir(BUCKET)
        yield Setup(nodes, s3, ray_tmp)
    finally:
        left = set()
        try:
            wait_until(lambda: not _trainer_pids(ray_tmp), GONE_SECONDS, "end of the trainer's local Ray",
                       interval=NODE_POLL_SECONDS)
        except AssertionError:
            left = _trainer_pids(ray_tmp)  # killed below, and the test fails on them
        _kill(left)
        for node in nodes:
            node.stop()
        if s3 is not None:
            s3.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"the trainer's local Ray left processes behind: {sorted(left)}"
    assert [x for node in nodes for x in node.leftovers()] == []
    assert s3 is None or s3.process.poll() is not None, "the S3 server is still running"


def _env(s3: SeaweedS3, **extra: str) -> dict[str, str]:
    """This machine's environment without any Ray or cache location of its own, pointed at the S3 server."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_TMPDIR", "TMPDIR", "MILES_CACHE_DIR")}
    return {**base, **s3.env(), "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", **extra}


def _start_trainer(setup: Setup, storage: str, log: Path, cache: Path) -> subprocess.Popen:
    flags = (f"--preset tiny-reverse4 --allow-rollout-producers --rollout-num-engines 0 --num-rollout {STEPS} --run-id {RUN_ID} "
             f"--save-interval {STEPS // 2} --eval-interval none --eval-prompt-data")
    cmd = [PYFLYTE, "run", "workflows/fully_async.py", "fully_async_rl", "--flags", flags, "--storage_root", storage]
    env = _env(setup.s3, RAY_TMPDIR=setup.ray_tmp, MILES_CACHE_DIR=str(cache))
    return _popen(cmd, log, cwd=ROOT, env=env)


def _start_producer(setup: Setup, node: IsolatedNode, run_uri: str, producer_id: str, log: Path):
    """The producer's `pyflyte run` on `node`: its Ray, temp files and caches are the node's own."""
    cmd = [PYFLYTE, "run", "workflows/rollout_producer.py", "rollout_producer", "--run_uri", run_uri,
           "--producer_id", producer_id]
    return _popen(node.command(cmd), log, env=_env(setup.s3))


def _popen(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    """`cmd` in a session of its own (killed as a group if it outlives the test), its output in `log`."""
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def _fetch(url: str) -> str:
    """Code that prints `ok` when `url` answers (an HTTP error is an answer), else the error's class."""
    return ("import urllib.request, urllib.error\ntry:\n    urllib.request.urlopen(%r, timeout=%r); print('ok')\n"
            "except urllib.error.HTTPError:\n    print('ok')\n"
            "except Exception as e:\n    print(type(e).__name__)" % (url, HTTP_SECONDS))


def _reaches(node: IsolatedNode, url: str) -> str:
    out = subprocess.run(node.command([sys.executable, "-c", _fetch(url)]), capture_output=True, text=True,
                         timeout=COMMAND_SECONDS)
    return out.stdout.strip()


def _assert_isolated(setup: Setup) -> None:
    """Each node reaches the S3 server, and not a server on this machine's 127.0.0.1."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for node in setup.nodes:
            assert _reaches(node, f"http://127.0.0.1:{server.server_address[1]}/") == "URLError"
            assert _reaches(node, setup.s3.endpoint) == "ok"
    finally:
        server.shutdown()


def _tail(log: Path, chars: int = 5000) -> str:
    """The end of a log, without the engines' line per S3 client (aiobotocore's "Found credentials")."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "Found credentials" not in x]
    return f"--- {log.name} ---\n" + "\n".join(lines)[-chars:]


def _stall_report(run: Store) -> str:
    """The records producers and the trainer exchange: the feed and each producer's heartbeat."""
    records = {}
    for key in ("producers/FEED.json", *(f"producers/heartbeats/{p}.json" for p in PRODUCERS)):
        record = run.get_json(key) if run.exists(key) else None
        records[key] = {k: v for k, v in record.items() if k != "history"} if isinstance(record, dict) else record
    return json.dumps(records, indent=1)


def _wait_for_trainer(trainer: subprocess.Popen, run: Store, logs: dict[str, Path]) -> None:
    """Until the trainer's `pyflyte run` ends; fails as soon as no step was trained for STALL_SECONDS."""
    steps, changed = -1, time.monotonic()
    while trainer.poll() is None:
        trained = len(run.list("buffer/consumed/"))
        if trained != steps:
            steps, changed = trained, time.monotonic()
        elif time.monotonic() - changed > STALL_SECONDS:
            raise AssertionError(f"the run stalled: {trained} steps trained, none in {STALL_SECONDS} s\n"
                                 f"{_stall_report(run)}\n" + "\n".join(_tail(f) for f in logs.values()))
        with contextlib.suppress(subprocess.TimeoutExpired):  # returns as soon as it ends
            trainer.wait(5)


def _copy_run_root(run: Store, dest: Path) -> Path:
    """What the checker and the metrics reader need, from the S3 run root to `dest`."""
    keys = ["STATUS.json", *(k for prefix in ("buffer/", "checkpoints/", "metrics/", "producers/")
                             for k in run.list(prefix))]
    for key in keys:
        (dest / key).parent.mkdir(parents=True, exist_ok=True)
        (dest / key).write_bytes(run.get_bytes(key))
    return dest


def _assert_learned(run: Path) -> None:
    """The last 10 steps' mean reward is at the embedded default's bar (>= 0.6 and >= 5x the random
    policy's level, recorded at step 0: 0.07): fed by the two producers it passes 0.6 at about step 40
    and ends near 0.99 after 80 steps; a run that did not learn stays near the random level."""
    from miles_core.metrics.names import RANDOM_POLICY_REWARD
    from miles_core.metrics.sink import read_metrics

    events = read_metrics(f"file://{run}", "trainer")
    rewards = {e["step"]: e["value"] for e in events if e["name"] == "rollout/reward/mean"}
    random_level = next(e["value"] for e in events if e["name"] == RANDOM_POLICY_REWARD)
    tail = [rewards[s] for s in range(STEPS - 10, STEPS)]
    last = sum(tail) / len(tail)
    print(f"elastic: random policy {random_level:.3f}, last 10 steps {last:.3f}, "
          f"curve {[round(rewards[s], 2) for s in sorted(rewards)]}")
    assert last >= max(0.6, 5 * random_level), (random_level, last)


def _assert_fed_by_the_producers(run: Store, consumed_writers: collections.Counter) -> None:
    beats = {p: run.get_json(f"producers/heartbeats/{p}.json") for p in PRODUCERS}
    writer_of = {p: beats[p]["writer"] for p in PRODUCERS}
    assert set(consumed_writers) <= set(writer_of.values()), (consumed_writers, writer_of)
    assert sum(consumed_writers.values()) == STEPS * BATCH, consumed_writers
    assert all(consumed_writers[w] > 0 for w in writer_of.values()), (consumed_writers, writer_of)
    for p, beat in beats.items():
        assert beat["state"] == "stopped" and "finished" in beat["stop_reason"], (p, beat)


@pytest.mark.timeout(1800)
def test_two_producers_on_isolated_nodes_feed_a_run_without_engines_and_it_learns(isolated, tmp_path):
    _assert_isolated(isolated)
    storage = f"s3://{BUCKET}/elastic-{uuid.uuid4().hex[:8]}"
    run_uri = f"{storage}/runs/{RUN_ID}"
    run = Store(run_uri)
    logs = {name: tmp_path / f"{name}.log" for name in ("trainer", *PRODUCERS)}
    t0 = time.monotonic()
    trainer = _start_trainer(isolated, storage, logs["trainer"], tmp_path / "trainer-cache")
    producers = {}
    try:
        # A producer joins a run that exists (its config.json); it then waits for the first published feed.
        wait_until(lambda: trainer.poll() is not None or run.exists("config.json"), CONFIG_SECONDS, "config.json",
                   interval=NODE_POLL_SECONDS)
        assert trainer.poll() is None, _tail(logs["trainer"])
        for node, p in zip(isolated.nodes, PRODUCERS):
            producers[p] = _start_producer(isolated, node, run_uri, p, logs[p])
        _wait_for_trainer(trainer, run, logs)
        ended = time.monotonic()
        print(f"elastic: trainer's pyflyte run took {ended - t0:.0f} s")
        assert trainer.returncode == 0, "\n".join(_tail(f) for f in logs.values())
        for p, proc in producers.items():
            proc.wait(max(1.0, STOP_SECONDS - (time.monotonic() - ended)))
            assert proc.returncode == 0, _tail(logs[p])
            assert f"producer {p} stopped (the run finished)" in logs[p].read_text(), _tail(logs[p])
        print(f"elastic: producers stopped {time.monotonic() - ended:.0f} s after the trainer")
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{e}\n" + "\n".join(_tail(f) for f in logs.values())) from e
    finally:
        for proc in (trainer, *producers.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    for node in isolated.nodes:  # a producer's Ray and engine end with it
        wait_until(lambda: not node.pids(), GONE_SECONDS, f"end of everything on {node.ip}", interval=NODE_POLL_SECONDS,
                   details=lambda: f"left on {node.ip}: {sorted(node.pids())}")

    local = _copy_run_root(run, tmp_path / "run")
    problems = check(local, STEPS, BATCH, set())
    assert problems == [], problems
    consumed_writers = collections.Counter()
    for manifest in sorted((local / "buffer" / "consumed").glob("[0-9]*.json")):
        consumed_writers.update(json.loads(manifest.read_text())["writers"])
    _assert_fed_by_the_producers(run, consumed_writers)
    _assert_learned(local)
