"""Metric events in the run root (docs/metrics.md) and the report built from them.

    with MetricsSink(run_uri, "trainer") as sink:
        sink.log(step, {N.LOSS: 0.3, N.STEP_SECONDS: 1.2})   # from miles_core.metrics import names as N
    events = read_metrics(run_uri)          # [{"step", "time", "name", "value", "component"}, ...]
    write_report(run_uri, "report.html")   # from miles_core.metrics.report

`metrics/{component}/*.jsonl` is the source of truth for every plot; TensorBoard and W&B are
optional mirrors fed from it (`miles_core.metrics.mirrors`, --use-tensorboard / --use-wandb).
Every metric name miles logs, with its meaning, is in `miles_core.metrics.names` (and nowhere else).
"""

from miles_core.metrics.names import METRIC_NAMES, PERF_METRICS
from miles_core.metrics.sink import MetricsSink, read_metrics, series

__all__ = ["METRIC_NAMES", "PERF_METRICS", "MetricsSink", "read_metrics", "series"]
