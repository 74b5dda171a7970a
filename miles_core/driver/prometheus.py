"""Live metrics for Prometheus (`--prometheus-port`): the driver serves its step metrics while it runs.

    exporter = PrometheusExporter.start(port)   # 0: a free port (exporter.port says which)
    exporter.log(step, step_metrics)             # after every step (the driver's MetricsLog)
    exporter.close()

GET http://{driver host}:{port}/metrics answers Prometheus' text format:
- every metric of the last step as a gauge `miles_{name}` (`/` and other characters outside
  [a-zA-Z0-9_] become `_`): rollout/fully_async/queue_size -> miles_rollout_fully_async_queue_size,
  perf/step_seconds -> miles_perf_step_seconds, ...; `miles_step` is the last step's number;
- counters summed over the steps this process served: miles_steps_total, miles_weight_pushes_total,
  miles_groups_aborted_total (groups aborted at put), miles_groups_recycled_total (unused groups served again).

The registry is the exporter's own (no process or Python collectors of the library's global one),
so two exporters in one process never clash. A value that is not a finite number is skipped.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from miles_core.buffer.metrics import ABORTED_GROUPS_FILTERED, UNUSED_RECYCLED
from miles_core.metrics.names import PUBLISHED_VERSION, WEIGHT_EXPORT_SECONDS

log = logging.getLogger(__name__)

PREFIX = "miles_"
# counter name -> (help, the step metric it sums; None: one per step)
COUNTERS = {
    "steps": ("Training steps served by this driver.", None),
    "weight_pushes": ("Weight pushes to the engines.", WEIGHT_EXPORT_SECONDS),
    "groups_aborted": ("Groups aborted at put (an engine failure or a pause that aborted them).",
                       ABORTED_GROUPS_FILTERED),
    "groups_recycled": ("Unused groups served again by --async-unused-samples-handler retry.", UNUSED_RECYCLED),
}
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(metric: str) -> str:
    return PREFIX + _INVALID.sub("_", metric)


class PrometheusExporter:
    def __init__(self, registry: CollectorRegistry, server, port: int):
        self.registry, self._server, self.port = registry, server, port
        self._gauges: dict[str, Gauge] = {}
        self._step = Gauge(PREFIX + "step", "The last step the driver logged.", registry=registry)
        self._counters = {name: Counter(PREFIX + name, help_, registry=registry)
                          for name, (help_, _) in COUNTERS.items()}

    @classmethod
    def start(cls, port: int, addr: str = "0.0.0.0") -> "PrometheusExporter":
        registry = CollectorRegistry(auto_describe=True)
        server, _ = start_http_server(port, addr=addr, registry=registry)
        exporter = cls(registry, server, server.server_address[1])
        log.info("Prometheus metrics at http://%s:%d/metrics", addr, exporter.port)
        return exporter

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        self._step.set(step)
        for name, value in metrics.items():
            v = _finite(value)
            if v is not None:
                self._gauge(name).set(v)
        for name, (_, source) in COUNTERS.items():
            amount = 1.0 if source is None else _finite(metrics.get(source))
            if source == WEIGHT_EXPORT_SECONDS:  # a push happened this step when its export was logged
                amount = 1.0 if amount is not None and PUBLISHED_VERSION in metrics else None
            if amount:
                self._counters[name].inc(amount)

    def _gauge(self, metric: str) -> Gauge:
        gauge = self._gauges.get(metric)
        if gauge is None:
            gauge = self._gauges[metric] = Gauge(prometheus_name(metric), f"{metric} (last step)",
                                                 registry=self.registry)
        return gauge

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _finite(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
