"""The run report in a real browser: headless Chromium, offline (docs/metrics.md).

Pins: the `miles report` file, opened from file:// with the network blocked, loads with no console
error or uncaught exception and renders every figure the report promises (report_figures of the
same metrics: each title, with an svg and one drawn trace per curve); the report task's Flyte Deck
renders the same figures. A full-page screenshot of each goes to the test's tmp dir and, when
MILES_SCREENSHOT_DIR is set, there too (CI can keep it as an artifact).
Guards: a report that needs the network (plotly from a CDN), a script error that leaves panels
blank, a Deck that drops panels; and, in test_blocked_network_is_caught, a harness that would pass
such a report (network not really blocked, errors not collected).

Rerun: `./dev test -m e2e tests/e2e/test_report_browser.py` (installs the Debian package chromium
with apt-get when `chromium` is not on PATH).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from miles_core.cli import main
from miles_core.metrics import trace
from miles_core.metrics.report import buffer_capacity, report_figures, swimlane_figure, swimlane_spans
from miles_core.metrics.sink import read_metrics
from miles_core.storage import Store
from miles_core.storage.run_root import read_config
from tests.support.browser import Browser, chromium  # noqa: F401 - chromium is a fixture
from tests.support.report_run import run_report_task, write_full_run, write_steps

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# flytekit's Deck template links a Google Fonts stylesheet; offline it fails to load, harmlessly.
DECK_TEMPLATE_FONTS = "https://fonts.googleapis.com/css"
# The Deck opens on flytekit's Timeline tab; the report is the tab named after Deck("report", ...).
SHOW_REPORT_TAB = "[...document.querySelectorAll('li')].find(li => li.textContent === 'report').click()"
INLINE_PLOTLY = re.compile(r"<script>/\*\*.*?plotly\.js v.*?</script>", re.S)


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> str:
    run = f"file://{tmp_path_factory.mktemp('report-run')}/run"
    write_full_run(run)
    return run


@pytest.fixture(scope="module")
def browser(chromium):  # noqa: F811 - the fixture imported above
    with Browser(chromium) as b:
        yield b


def promised(run: str) -> list[tuple[str, int]]:
    """(title, number of curves) of every figure the report renders for `run`."""
    store = Store(run)
    figures = report_figures(read_metrics(store), buffer_capacity(read_config(store)))
    return [(f.layout.title.text, len(f.data)) for f in figures]


def keep_screenshot(path) -> None:
    assert path.read_bytes().startswith(PNG_MAGIC), f"{path} is not a PNG"
    if os.environ.get("MILES_SCREENSHOT_DIR"):
        os.makedirs(os.environ["MILES_SCREENSHOT_DIR"], exist_ok=True)
        shutil.copy(path, os.environ["MILES_SCREENSHOT_DIR"])


def assert_renders(page, want: list[tuple[str, int]]) -> None:
    assert [(p["title"], p["traces"]) for p in page.plots] == want, page.plots
    for plot in page.plots:
        assert plot["rendered"] and plot["visible"] and plot["main_svgs"] >= 1 and plot["points"] > 0, plot


def test_report_renders_offline(run_root, browser, tmp_path):
    want = promised(run_root)
    assert len(want) == 10, want  # write_full_run gives every panel data
    out = tmp_path / "report.html"
    assert main(["report", run_root, "-o", str(out)]) == 0
    page = browser.load(out, screenshot=tmp_path / "report.png")
    assert page.errors == [], page.errors
    assert_renders(page, want)
    keep_screenshot(page.screenshot)


def test_deck_renders_the_same_figures(run_root, browser, tmp_path):
    _, deck = run_report_task(run_root, tmp_path / "flyte")
    page = browser.load(deck, screenshot=tmp_path / "report-deck.png", script=SHOW_REPORT_TAB)
    assert [e for e in page.errors if DECK_TEMPLATE_FONTS not in e] == [], page.errors
    assert_renders(page, promised(run_root))
    keep_screenshot(page.screenshot)


def test_the_timeline_swimlane_renders(tmp_path, browser):
    """A run with a timeline trace: the report draws its last steps as a swimlane of bars (one trace per
    phase, one bar per span), after the metric panels."""
    run = f"file://{tmp_path}/run"
    store = write_full_run(run)
    write_steps(store, steps=8)
    spans = swimlane_spans(trace.aligned_events(store))
    want = promised(run) + [(f.layout.title.text, len(f.data)) for f in [swimlane_figure(spans)]]
    out = tmp_path / "report.html"
    assert main(["report", run, "-o", str(out)]) == 0
    page = browser.load(out, screenshot=tmp_path / "report-timeline.png")
    assert page.errors == [], page.errors
    assert_renders(page, want)
    assert page.plots[-1]["title"] == "Timeline of the last 5 steps"
    assert page.plots[-1]["points"] == len(spans)  # every span drawn as a bar
    keep_screenshot(page.screenshot)


def test_blocked_network_is_caught(run_root, browser, tmp_path):
    """The report with its inline plotly.js swapped for the CDN script fails to load it and draws nothing."""
    out = tmp_path / "report.html"
    assert main(["report", run_root, "-o", str(out)]) == 0
    html, swapped = INLINE_PLOTLY.subn('<script src="https://cdn.plot.ly/plotly-3.1.0.min.js"></script>',
                                       out.read_text(encoding="utf-8"), count=1)
    assert swapped == 1, "the inline plotly.js <script> was not found; update INLINE_PLOTLY"
    (tmp_path / "cdn.html").write_text(html, encoding="utf-8")
    page = browser.load(tmp_path / "cdn.html", settle_seconds=2)
    assert any("cdn.plot.ly" in e and "ERR_" in e for e in page.errors), page.errors
    assert any("Plotly is not defined" in e for e in page.errors), page.errors
    assert page.plots and not any(p["rendered"] for p in page.plots), page.plots
