"""The report task's Flyte Deck holds the report (tasks/report.py, docs/metrics.md).

Pins: run locally through flytekit, the `report` task writes a deck.html whose figures (titles and
curve names, in order) are those of the `miles report` file of the same run root, with plotly.js
inline; its returned HTMLPage and {run root}/report.html are the `miles report` page. Guards: a
Deck that drops panels or is rendered from something other than the report (the browser check of
the same Deck is tests/e2e/test_report_browser.py).
"""

from __future__ import annotations

from miles_core.cli import main
from miles_core.metrics.report import PANELS
from miles_core.storage import Store
from tests.support.report_run import plotly_figures, run_report_task, write_full_run


def test_report_deck_holds_the_report_figures(tmp_path):
    run = f"file://{tmp_path}/run"
    write_full_run(run)
    out = tmp_path / "report.html"
    assert main(["report", run, "-o", str(out)]) == 0
    want = plotly_figures(out.read_text(encoding="utf-8"))
    assert [title for title, _ in want] == [title for title, _, _ in PANELS] + ["Eval"]  # every panel

    page, deck = run_report_task(run, tmp_path / "flyte")
    deck_html = deck.read_text(encoding="utf-8")
    assert plotly_figures(deck_html) == want
    assert deck_html.count("plotly.js v") == 1, "plotly.js inline once: the Deck opens without a CDN"
    assert plotly_figures(page.read_text(encoding="utf-8")) == want
    assert plotly_figures(Store(run).get_bytes("report.html").decode("utf-8")) == want
