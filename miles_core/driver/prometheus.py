"""Live metrics for Prometheus (`--prometheus-port`): the driver serves its step metrics while it runs.

    exporter = PrometheusExporter.start(port, run_id="qwen-math")   # 0: a free port (exporter.port)
    exporter.log(step, step_metrics)                                 # after every step (the driver's MetricsLog)
    exporter.close()

GET http://{driver host}:{port}/metrics answers Prometheus' text format (any other path: 404):
- every metric of the last step as a gauge `miles_{name}` (`/` and other characters outside
  [a-zA-Z0-9_] become `_`, and a name that repeats its component, `train/train_rollout_logprob_abs_diff`,
  says it once: miles_train_rollout_logprob_abs_diff): rollout/fully_async/queue_size ->
  miles_rollout_fully_async_queue_size, perf/step_seconds -> miles_perf_step_seconds, ...;
  `miles_step` is the last step's number;
- step metrics that count since the run began (`CUMULATIVE`: rollout/producer/started_groups) as
  counters, `miles_rollout_producer_started_groups_total`;
- counters summed over the steps this process served: miles_steps_total, miles_weight_pushes_total,
  miles_groups_aborted_total (groups aborted at put), miles_groups_recycled_total (unused groups served again).

Every series carries the label `run_id`, so one Prometheus scraping several runs keeps them apart.
Counters have no `_created` series. A value that is not a finite number is skipped. The registry is
the exporter's own (no process or Python collectors of the library's global one), so two exporters
in one process never clash.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from miles_core.metrics.names import (ABORTED_GROUPS_FILTERED, PRODUCER_STARTED_GROUPS, PUBLISHED_VERSION,
                                      UNUSED_RECYCLED, WEIGHT_EXPORT_SECONDS)

log = logging.getLogger(__name__)

PREFIX = "miles_"
PATH = "/metrics"
# counter name -> (help, the step metric it sums; None: one per step)
COUNTERS = {
    "steps": ("Training steps served by this driver.", None),
    "weight_pushes": ("Weight pushes to the engines.", WEIGHT_EXPORT_SECONDS),
    "groups_aborted": ("Groups aborted at put (an engine failure or a pause that aborted them).",
                       ABORTED_GROUPS_FILTERED),
    "groups_recycled": ("Unused groups served again by --async-unused-samples-handler retry.", UNUSED_RECYCLED),
}
CUMULATIVE = frozenset({PRODUCER_STARTED_GROUPS})  # step metrics that count since the run began
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(metric: str) -> str:
    """`miles_` + the metric's name with `/` (and anything outside [a-zA-Z0-9_]) as `_`; a first
    component the next part repeats is said once (train/train_x -> miles_train_x)."""
    head, sep, rest = metric.partition("/")
    if sep and rest.startswith(head + "_"):
        metric = rest
    return PREFIX + _INVALID.sub("_", metric)


class StepMetrics:
    """The collector: the last step's metrics and the counters, as metric families labelled run_id."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._lock = threading.Lock()
        self._step: float | None = None
        self._last: dict[str, float] = {}
        self._counts = {name: 0.0 for name in COUNTERS}

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        with self._lock:
            self._step = float(step)
            for name, value in metrics.items():
                v = _finite(value)
                if v is not None:
                    self._last[name] = v
            for name, (_, source) in COUNTERS.items():
                amount = 1.0 if source is None else _finite(metrics.get(source))
                if source == WEIGHT_EXPORT_SECONDS:  # a push happened this step when its export was logged
                    amount = 1.0 if amount is not None and PUBLISHED_VERSION in metrics else None
                if amount:
                    self._counts[name] += amount

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            step, last, counts = self._step, dict(self._last), dict(self._counts)
        labels = ["run_id"]
        if step is not None:
            yield self._one(GaugeMetricFamily(PREFIX + "step", "The last step the driver logged.", labels=labels), step)
        for name, (help_, _) in COUNTERS.items():
            yield self._one(CounterMetricFamily(PREFIX + name, help_, labels=labels), counts[name])
        for metric, value in sorted(last.items()):
            kind = CounterMetricFamily if metric in CUMULATIVE else GaugeMetricFamily
            what = "since the run began" if metric in CUMULATIVE else "last step"
            yield self._one(kind(prometheus_name(metric), f"{metric} ({what})", labels=labels), value)

    def _one(self, family, value: float):
        family.add_metric([self.run_id], value)
        return family


class PrometheusExporter:
    def __init__(self, registry: CollectorRegistry, metrics: StepMetrics, server: ThreadingHTTPServer | None):
        self.registry, self._metrics, self._server = registry, metrics, server
        self.port = server.server_address[1] if server is not None else 0

    @classmethod
    def start(cls, port: int, addr: str = "0.0.0.0", run_id: str = "") -> "PrometheusExporter":
        registry, metrics = cls._registry(run_id)
        server = ThreadingHTTPServer((addr, port), _handler(registry))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="prometheus", daemon=True).start()
        exporter = cls(registry, metrics, server)
        log.info("Prometheus metrics at http://%s:%d%s", addr, exporter.port, PATH)
        return exporter

    @classmethod
    def unserved(cls, run_id: str = "") -> "PrometheusExporter":
        """An exporter without its HTTP server (`text()` says what it would answer)."""
        return cls(*cls._registry(run_id), None)

    @staticmethod
    def _registry(run_id: str) -> tuple[CollectorRegistry, StepMetrics]:
        registry, metrics = CollectorRegistry(auto_describe=False), StepMetrics(run_id)
        registry.register(metrics)
        return registry, metrics

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        self._metrics.log(step, metrics)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != PATH:
                self._answer(404, "text/plain; charset=utf-8", f"not found: metrics are at {PATH}\n".encode())
                return
            self._answer(200, CONTENT_TYPE_LATEST, generate_latest(registry))

        def _answer(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: no line per scrape
            pass

    return Handler


def _finite(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
