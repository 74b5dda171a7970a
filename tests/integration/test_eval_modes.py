"""Eval Modes 1 and 2 on real CPU engine server processes (docs/evaluation.md), driven through the
EvalScheduler the training driver calls every step.

Pins: Mode 1 pauses and resumes producer submission around the eval (in that order, once per
eval), writes eval/step_{k}/{ds}.json and logs the §7.3 metrics at the step; Mode 2 pins the
dedicated engine to each step's snapshot (loads it, reads the version back) and evaluates in the
background; an engine that reports another version is `pin_violation`, a dead one `unhealthy`,
and neither reaches the training loop as an exception.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from miles_core.eval import build_eval_scheduler
from miles_core.eval.results import read_result
from miles_core.engines.launcher import free_port
from miles_core.metrics.sink import MetricsSink, read_metrics
from miles_core.models.builtin import materialize_checkpoint
from miles_core.storage import Store
from tests.integration.eval_support import config, exporter_from, start_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # One checkpoint serves as initial model and as every snapshot: the pin is proven by the path
    # and version the engine reports, not by different weights.
    path = materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("eval-models") / "a"))
    return {"a": path, "b": path}


@pytest.fixture(scope="module")
def engine(models):
    server = start_engine(models["a"])
    yield server
    server.stop()


def eval_events(run_uri):
    return [(e["step"], e["name"]) for e in read_metrics(run_uri, "eval")]


def test_mode1_shared_engines_pause_submission_around_the_eval(tmp_path, models, engine):
    """Mode 1: the producer's submission is paused for exactly the duration of each eval, results
    are written per dataset and the metrics land at the step with lag 0."""
    cfg = config(tmp_path, "--eval-mode", "shared", "--eval-interval", "2")
    calls = []
    sink = MetricsSink(cfg.run_uri, "eval", background=False)
    sched = build_eval_scheduler(cfg, exporter=exporter_from(models["a"]), metrics=sink,
                                 shared_engine_urls=[engine.url], pause_submission=lambda: calls.append("pause"),
                                 resume_submission=lambda: calls.append("resume"))
    for step in range(4):
        sched.on_step(step, version=0, last=step == 3)
    sched.close()
    sink.close()
    assert calls == ["pause", "resume", "pause", "resume"]
    store = Store(cfg.run_uri)
    for step in (1, 3):
        r = read_result(store, step, "held")
        assert r is not None and r.mode == "shared" and r.n_prompts == 12 and r.n_samples == 24
        assert set(r.metrics) >= {"eval/held", "eval/held/pass@1", "eval/held/pass@2", "eval/held/truncated_ratio",
                                  "eval/held/response_len/mean"}
    events = eval_events(cfg.run_uri)
    assert (1, "eval/held") in events and (3, "eval/held/pass@2") in events
    assert (3, "eval/lag_steps") in events and (1, "eval/export_seconds") in events


def test_mode2_dedicated_engines_pinned_to_each_snapshot(tmp_path, models):
    """Mode 2: each eval loads the step's snapshot on the dedicated engine and reads the version
    back; the result records that version and the engine ends up serving the last snapshot."""
    cfg = config(tmp_path, "--eval-mode", "dedicated", "--eval-num-gpus", "1", "--eval-interval", "2")
    dedicated = start_engine(models["a"], version=0)
    try:
        sink = MetricsSink(cfg.run_uri, "eval", background=False)
        sched = build_eval_scheduler(cfg, exporter=exporter_from(models["b"]), metrics=sink,
                                     dedicated_engine_urls=[dedicated.url])
        for step in range(4):
            sched.on_step(step, version=step + 1, last=step == 3)
        sched.close()
        sink.close()
        store = Store(cfg.run_uri)
        assert read_result(store, 1, "held").weight_version == 2
        assert read_result(store, 3, "held").weight_version == 4
        info = asyncio.run(_model_info(dedicated.url))
        assert info["model_path"].endswith("snapshots/step_00000003") and info["weight_version"] == "4"
        assert (3, "eval/held") in eval_events(cfg.run_uri)
    finally:
        dedicated.stop()


async def _model_info(url):
    from miles_core.engines.client import EngineClient

    async with EngineClient([url]) as c:
        return await c.model_info(url)


class LyingEngine:
    """An engine endpoint that accepts a weight load but keeps reporting another version: the
    fault a restarted or mis-pinned engine presents."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    def _serve(self):
        async def ok(request):
            return web.json_response({"success": True, "message": "ok"})

        async def version(request):
            return web.json_response({"weight_version": "999"})

        async def health(request):
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/update_weights_from_disk", ok)
        app.router.add_get("/model_info", version)  # SGLang 0.5.23 reports the version here only
        app.router.add_get("/health", health)
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()


def test_mode2_pin_violation_and_unhealthy_are_skips(tmp_path, models):
    """A dedicated engine that reports a version other than the pinned one gives
    eval/skipped_pin_violation; an engine that is down gives eval/skipped_unhealthy. Training
    goes on (on_step returns normally) and the step is settled with a skip marker."""
    for urls, reason, run in (([LyingEngine().url], "pin_violation", "lie"),
                              ([f"http://127.0.0.1:{free_port()}"], "unhealthy", "down")):
        cfg = config(tmp_path / run, "--eval-mode", "dedicated", "--eval-num-gpus", "1", "--eval-interval", "1")
        sink = MetricsSink(cfg.run_uri, "eval", background=False)
        sched = build_eval_scheduler(cfg, exporter=exporter_from(models["a"]), metrics=sink, dedicated_engine_urls=urls)
        sched.on_step(0, version=1, last=True)
        sched.close()
        sink.close()
        assert (0, f"eval/skipped_{reason}") in eval_events(cfg.run_uri)
        assert Store(cfg.run_uri).get_json("eval/step_00000000/_skipped.json")["reason"] == reason
