"""The local run's progress display (miles_core.driver.roles.Progress): a rich bar on a terminal,
one `[miles] step` line every 10 steps otherwise, nothing with --no-progress."""

from __future__ import annotations

import io
import os
import pty

from miles_core.driver import roles
from miles_core.driver.roles import Progress
from miles_core.metrics import names as N

METRICS = {N.REWARD: 0.5, N.AVG_STALENESS: 1.25, N.TOKENS_PER_SECOND: 1234.0}


def test_off_a_terminal_one_line_every_ten_steps(capsys):
    p = Progress(total=25, start=0, enabled=True)
    for step in range(25):
        p.update(step, METRICS)
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"[miles] step {s}/25  reward 0.500  staleness 1.25  1234 tok/s" for s in (1, 10, 20)]


def test_disabled_prints_nothing(capsys):
    p = Progress(total=5, start=0, enabled=False)
    p.update(0, METRICS)
    p.close()
    assert capsys.readouterr().err == ""


def test_on_a_terminal_a_rich_bar(monkeypatch):
    master, slave = pty.openpty()
    tty = os.fdopen(slave, "w")
    monkeypatch.setattr(roles.sys, "stderr", tty)
    from rich.console import Console

    out = io.StringIO()
    monkeypatch.setattr("rich.progress.get_console", lambda: Console(file=out, force_terminal=True, width=120))
    p = Progress(total=4, start=1, enabled=True)
    assert p.bar is not None
    for step in range(1, 4):
        p.update(step, METRICS)
    p.close()
    tty.close()
    os.close(master)
    assert "step 4/4" in out.getvalue() and "reward 0.500" in out.getvalue()
