"""report: the run's Deck and a self-contained HTML file, both from metrics/ (docs/metrics.md)."""

from __future__ import annotations

import os

from flytekit import Deck, Resources, current_context, task
from flytekit.types.file import HTMLPage

from images import task_image
from miles_core.metrics.report import render_report
from miles_core.metrics.trace import TIMELINE_KEY
from miles_core.storage import Store
from tasks.types import DECK_FIELDS, TrainOutcome

REPORT_KEY = "report.html"


@task(container_image=task_image("cpu"), enable_deck=True, deck_fields=DECK_FIELDS,
      requests=Resources(cpu="1", mem="2Gi"))
def report(outcome: TrainOutcome) -> HTMLPage:
    """Render reward, staleness, queue size, throughput, wait times and eval curves with the
    bottleneck reading as this task's Deck; also saved as {run root}/report.html and returned.
    """
    html = render_report(outcome.run_uri)
    Deck("report", html)
    Store(outcome.run_uri).put_bytes(REPORT_KEY, html.encode("utf-8"))
    path = os.path.join(current_context().working_directory, REPORT_KEY)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    print(where_to_look(outcome.run_uri), flush=True)
    return HTMLPage(path)


def where_to_look(run_uri: str) -> str:
    """The console's last lines: the report, the timeline trace, and the commands that read a run."""
    store = Store(run_uri)
    lines = [f"[miles] report: {store.uri(REPORT_KEY)} (also the report task's Deck)"]
    if store.exists(TIMELINE_KEY):
        lines.append(f"[miles] timeline trace of the last steps: {store.uri(TIMELINE_KEY)} (open it in "
                     f"https://ui.perfetto.dev; `miles trace {run_uri} --steps A:B -o trace.json` for others)")
    lines.append(f"[miles] what the run holds: `miles runs show {run_uri}`")
    return "\n".join(lines)
