"""A run root whose report shows every panel: every metric `miles_core.metrics.report.PANELS`
reads, and eval curves, written through MetricsSink with config.json and STATUS.json beside them
(as a finished run leaves them). A panel added to PANELS is covered without a change here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from miles_core.config import embedded_default, replace_fields
from miles_core.metrics import MetricsSink, trace
from miles_core.metrics.report import PANELS
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, write_config, write_status

EVAL_METRICS = ("eval/heldout", "eval/heldout/pass@1")
ENGINE = "http://10.0.0.2:30000"
# How plotly's Figure.to_html calls the library: Plotly.newPlot("div id", [traces], {layout}, {config}).
_NEW_PLOT = re.compile(r'Plotly\.newPlot\(\s*"[^"]+",\s*')
_COMMA = re.compile(r"\s*,\s*")


def panel_metrics() -> list[str]:
    return [name for _, names, _ in PANELS for name in names]


def write_full_run(run_uri: str, steps: int = 24) -> Store:
    """Fill `run_uri` with `steps` steps of every panel's metrics and eval every 4 steps."""
    store = Store(run_uri)
    write_config(store, replace_fields(embedded_default(), rollout_batch_size=4))  # capacity 8
    with MetricsSink(store, "trainer", background=False) as sink:
        for k in range(steps):
            sink.log(k, {name: 1.0 + i + math.sin(k / 3 + i) for i, name in enumerate(panel_metrics())})
    with MetricsSink(store, "eval", background=False) as sink:
        for k in range(0, steps, 4):
            sink.log(k, {name: 0.02 * k + 0.1 * i for i, name in enumerate(EVAL_METRICS)})
    write_status(store, FINISHED, last_step=steps - 1, segment=0)
    return store


def write_steps(store: Store, steps: int = 6, t0: float = 1_000.0, node: str | None = None,
                trainer_skew: float = 0.0) -> None:
    """`steps` one-second steps: the driver's step spans, the trainer's phases (its clock `trainer_skew`
    seconds off, on `node`), a group with two requests per step."""
    driver = trace.Tracer(store, trace.DRIVER_PROCESS, background=False)
    trainer = trace.Tracer(store, "trainer-rank0", background=False)
    trainer.header["node"] = node
    rollout = trace.Tracer(store, "rollout", background=False)
    for k in range(steps):
        start = t0 + k
        driver.complete(trace.STEP_SPAN, start, start + 1.0, lane="step", step=k)
        driver.complete("batches.next_batch", start, start + 0.2, lane="step")
        trainer.complete("forward+backward", start + 0.2 + trainer_skew, start + 0.6 + trainer_skew, lane="train")
        trainer.complete("optimizer", start + 0.6 + trainer_skew, start + 0.7 + trainer_skew, lane="train")
        trainer.complete("pause", start + 0.8 + trainer_skew, start + 0.85 + trainer_skew, lane="weights")
        gid = f"e0-p{k}-a0-trainer"
        rollout.async_span("group", gid, start - 0.5, start + 0.1, cat="group")
        rollout.async_span("request", gid, start - 0.5, start - 0.2, cat="group", engine=ENGINE)
        rollout.async_span("request", gid, start - 0.3, start + 0.0, cat="group", engine=ENGINE)
    for t in (driver, trainer, rollout):
        t.flush()


def plotly_figures(html: str) -> list[tuple[str, list[str]]]:
    """(title, trace names) of every figure a page hands to Plotly.newPlot, in page order."""
    decoder = json.JSONDecoder()
    figures = []
    for call in _NEW_PLOT.finditer(html):
        traces, end = decoder.raw_decode(html, call.end())
        layout, _ = decoder.raw_decode(html, _COMMA.match(html, end).end())
        figures.append((layout["title"]["text"], [t["name"] for t in traces]))
    return figures


def run_report_task(run_uri: str, sandbox: Path) -> tuple[Path, Path]:
    """Run tasks.report.report locally, as `pyflyte run` without --remote does, with flytekit's
    local files under `sandbox`: (the HTMLPage it returned, the deck.html flytekit wrote)."""
    from flytekit import FlyteContextManager
    from flytekit.core.data_persistence import FileAccessProvider

    from tasks.report import report
    from tasks.types import TrainOutcome

    files = FileAccessProvider(local_sandbox_dir=str(sandbox), raw_output_prefix=str(sandbox / "raw"))
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_file_access(files)):
        page = report(outcome=TrainOutcome(run_uri=run_uri, state="finished"))
    decks = sorted(sandbox.rglob("deck.html"))
    assert len(decks) == 1, f"expected one deck.html under {sandbox}, found {decks}"
    return Path(page.path), decks[0]
