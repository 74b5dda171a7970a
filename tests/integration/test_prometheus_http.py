"""The --prometheus-port endpoint over HTTP on 127.0.0.1: /metrics answers Prometheus' text format,
any other path 404 (a scrape config with a wrong path fails loudly, not with a page of metrics);
closing the exporter frees the port."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_core.driver.prometheus import PrometheusExporter

from tests.support.timeouts import HTTP_SECONDS, PROBE_SECONDS


def test_only_the_metrics_path_answers():
    e = PrometheusExporter.start(0, addr="127.0.0.1", run_id="r")
    try:
        e.log(4, {"perf/step_seconds": 0.25})
        url = f"http://127.0.0.1:{e.port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=HTTP_SECONDS) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["miles_step"] == 4 and values["miles_perf_step_seconds"] == 0.25
        for path in ("/", "/favicon.ico", "/metricsx"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(url + path, timeout=HTTP_SECONDS)
            assert info.value.code == 404
    finally:
        e.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=PROBE_SECONDS)
