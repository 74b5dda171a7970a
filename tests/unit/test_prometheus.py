"""What --prometheus-port serves (miles_core.driver.prometheus), read with Prometheus' own parser.

Pins: every series carries the run's `run_id` label; counters have no `_created` series; a step
metric that counts since the run began (rollout/producer/started_groups) is a counter, the others
gauges of the last step; a name that repeats its component (train/train_rollout_logprob_abs_diff)
says it once; the driver's own counters sum over the steps; a value that is not finite is skipped.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from miles_core.driver.prometheus import PrometheusExporter, prometheus_name
from miles_core.metrics.names import PUBLISHED_VERSION, WEIGHT_EXPORT_SECONDS


def _families(exporter: PrometheusExporter) -> dict:
    return {f.name: f for f in text_string_to_metric_families(exporter.text())}


def test_series_are_labelled_typed_and_named_once():
    e = PrometheusExporter.unserved("qwen-math")
    for step in range(3):
        e.log(step, {"train/train_rollout_logprob_abs_diff": 0.1, "rollout/producer/started_groups": 40 * (step + 1),
                     "perf/step_seconds": 0.5, WEIGHT_EXPORT_SECONDS: 0.1, PUBLISHED_VERSION: step + 1,
                     "train/loss": math.nan})
    families = _families(e)
    samples = [s for f in families.values() for s in f.samples]
    assert samples and all(s.labels == {"run_id": "qwen-math"} for s in samples)
    assert not any(s.name.endswith("_created") for s in samples)
    assert families["miles_rollout_producer_started_groups"].type == "counter"
    assert families["miles_perf_step_seconds"].type == "gauge"
    values = {s.name: s.value for s in samples}
    assert values["miles_rollout_producer_started_groups_total"] == 120
    assert values["miles_steps_total"] == 3 and values["miles_weight_pushes_total"] == 3 and values["miles_step"] == 2
    assert "miles_train_rollout_logprob_abs_diff" in values and "miles_train_train_rollout_logprob_abs_diff" not in values
    assert "miles_train_loss" not in values  # NaN: skipped


def test_names():
    assert prometheus_name("rollout/fully_async/queue_size") == "miles_rollout_fully_async_queue_size"
    assert prometheus_name("train/train_rollout_logprob_abs_diff") == "miles_train_rollout_logprob_abs_diff"
    assert prometheus_name("train/trainer_x") == "miles_train_trainer_x"
    assert prometheus_name("eval/heldout/pass@1") == "miles_eval_heldout_pass_1"
