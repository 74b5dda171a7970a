"""A real run's timeline trace and live Prometheus metrics (the embedded default, 8 steps, its own Ray).

Pins:
- Prometheus: while the run trains, GET /metrics on --prometheus-port parses with the Prometheus
  client's own parser; miles_steps_total grows with the steps, the queue size, staleness, tokens/s,
  in-flight groups, step seconds and engine count are gauges, pushes are counted; after the run
  the port is closed.
- Trace: the driver, the rollout manager and trainer rank 0 each wrote spans to the run root; one
  driver step span per step; every traced group's life holds generate, reward and commit, and its
  requests name their engine; one clock: every trainer forward+backward lies inside the driver's
  trainer.train_step span, every export inside its weights.push span, and each delivery's pause,
  load and resume (the rollout manager's) between its push and the next (these are different processes); checkpoints and snapshot exports are spans; trace/timeline.json opens as Chrome trace-event JSON; `miles trace` writes
  a step range.

Rerun: `.venv/bin/pytest -m slow tests/e2e/test_trace_run.py -s` (about 2 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_core.cli import main
from miles_core.metrics import trace
from miles_core.storage import Store
from tests.support.seaweed import free_port
from tests.support.timeouts import PROBE_SECONDS

READER_END_SECONDS = 30  # the reader thread ends once the finished run's stdout closes
SCRAPE_SECONDS = 0.3  # how often the live /metrics are scraped while the run goes (until it ends)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
RUN = ("import sys; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
       "r = run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]])); print('RESULT', r.state, r.steps_run)")
GAUGES = ("miles_rollout_fully_async_queue_size", "miles_rollout_fully_async_avg_staleness",
          "miles_perf_tokens_per_second", "miles_rollout_producer_in_flight_groups", "miles_perf_step_seconds",
          "miles_rollout_engines")


def scrape(port: int) -> dict[str, float] | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PROBE_SECONDS).read().decode()
    except OSError:
        return None
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace-run")
    port = free_port()
    flags = ["--storage-root", f"file://{root}", "--run-id", "t", "--num-rollout", str(STEPS), "--no-progress",
             "--prometheus-port", str(port), "--trace-sample-groups", "1", "--eval-interval", "4"]
    proc = subprocess.Popen([sys.executable, "-c", RUN, *flags], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, RAY_ADDRESS=""))
    scrapes = []
    reader = threading.Thread(target=lambda: scrapes.append(proc.stdout.read()), daemon=True)
    reader.start()
    live = []
    while proc.poll() is None:
        got = scrape(port)
        if got is not None:
            live.append(got)
        time.sleep(SCRAPE_SECONDS)
    reader.join(timeout=READER_END_SECONDS)
    output = scrapes[0] if scrapes else ""
    assert proc.returncode == 0 and f"RESULT finished {STEPS}" in output, output[-4000:]
    return Store(f"file://{root}/runs/t"), live, scrape(port), output


def test_prometheus_serves_live_metrics_while_the_run_trains(traced_run):
    _, live, after, output = traced_run
    assert live, f"nothing answered on the Prometheus port while the run trained\n{output[-2000:]}"
    assert "live metrics for Prometheus: http://" in output
    steps = [s["miles_steps_total"] for s in live if "miles_steps_total" in s]
    assert steps == sorted(steps) and steps[-1] >= STEPS - 1 and len(set(steps)) >= 3, steps
    last = live[-1]
    for name in GAUGES:
        assert name in last, f"{name} not served; served: {sorted(last)}"
    assert last["miles_rollout_engines"] == 1 and last["miles_perf_step_seconds"] > 0
    assert last["miles_weight_pushes_total"] >= last["miles_steps_total"] - 1
    assert after is None  # the endpoint closes with the segment


def test_every_role_traces_on_one_clock(traced_run):
    store, *_ = traced_run
    events = trace.aligned_events(store)
    by_process = defaultdict(list)
    for process, e in events:
        by_process[process].append(e)
    assert {"driver", "rollout", "trainer-rank0"} <= set(by_process), set(by_process)
    assert sorted(trace.step_windows(events)) == list(range(STEPS))

    first_step = min(a for a, _ in trace.step_windows(events).values())

    def spans(name: str, process: str) -> list[tuple[int, int]]:
        return sorted((e["ts"], e["ts"] + e["dur"]) for e in by_process[process]
                      if e["name"] == name and e["ts"] >= first_step)  # not start-up's

    def inside(inner: str, outers: list[tuple[int, int]], process: str, slack_us: int = 5_000) -> None:
        inners = spans(inner, process)
        assert inners and outers
        for s, e in inners:
            assert any(a - slack_us <= s and e <= b + slack_us for a, b in outers), (inner, s, e)

    inside("forward+backward", spans("trainer.train_step", "driver"), "trainer-rank0")
    pushes = spans("weights.push", "driver")
    inside("export", pushes, "trainer-rank0")
    # A push's delivery (pause, load, resume) overlaps the next step: it lies between its push's start and
    # the end of the next push, which waits for it; the last push waits for its own.
    deliveries = [(a, d) for (a, _), (_, d) in zip(pushes, pushes[1:])] + pushes[-1:]
    for name in ("pause", "load", "resume"):  # the store transport's delivery runs in the rollout manager
        inside(name, deliveries, "rollout")
    resumes = spans("resume", "rollout")
    outlived = [p for p in pushes[:-1] if any(p[0] <= s and e > p[1] for s, e in resumes)]
    assert outlived, "no push returned before the engines resumed: the deliveries did not overlap the steps"

    groups = defaultdict(set)
    for e in by_process["rollout"]:
        if e["ph"] == "A":
            groups[e["id"]].add(e["name"])
            if e["name"] == "request":
                assert e["args"]["engine"].startswith("http://127.0.0.1:") and e["args"]["tokens"] >= 1
    committed = [g for g, names in groups.items() if "group" in names]
    assert len(committed) >= STEPS * 32
    assert all({"generate", "reward", "commit", "request"} <= groups[g] for g in committed)
    assert sum("consumed" in names for names in groups.values()) == STEPS * 32
    names = {e["name"] for e in by_process["trainer-rank0"]}
    assert {"checkpoint", "snapshot export", "export", "optimizer"} <= names, names
    assert {"pause", "load", "resume"} <= {e["name"] for e in by_process["rollout"]}


def test_the_timeline_and_miles_trace_open_as_chrome_traces(traced_run, tmp_path):
    store, *_ = traced_run
    timeline = store.get_json(trace.TIMELINE_KEY)
    phases = {e["ph"] for e in timeline["traceEvents"]}
    assert {"M", "X", "b", "e"} <= phases
    out = tmp_path / "t.json"
    assert main(["trace", store.uri(), "--steps", "3:5", "-o", str(out)]) == 0
    steps = {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if e["name"] == "step"}
    assert {3, 4} <= steps <= {2, 3, 4, 5}
