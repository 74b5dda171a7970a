"""Samples whose user code failed: counted per kind, summarised on the console, and a budget that stops the run.

Kinds (`KINDS`): `reward` (the reward function raised, timed out or returned a non-number) and
`generate` (an episode of --custom-generate-function-path raised or timed out). One such failure
fails only its sample (or group); a run where most samples fail, though, learns nothing, so:

- `FailureTally` (the rollout side) counts, per kind, the samples tried and failed since the last
  `take()`, with the first message per exception type. On the console, the first failure of each
  (kind, exception type) in an interval is logged as it happens; the rest are counted and one line
  per (kind, exception type) says how many more there were when the interval ends (`flush()`), not
  one line per sample.
- `FailureBudget` (the driver) keeps the last --failed-sample-window-steps steps' tallies and raises
  `SampleFailuresError` when, over a full window (or at the segment's last step), a kind failed on
  more than --max-failed-sample-fraction of its samples. The message is one line: what failed, how
  often, the first exception, and the flag to change. A fraction of 1 never stops the run.
- A failed episode rejects its whole group, so when every episode fails no batch ever reaches the
  driver: the producer itself fails (`streak_error`) after a window's worth of samples
  (window x --rollout-batch-size x --n-samples-per-prompt) failed in a row, none succeeding.

A filter that raises (--dynamic-sampling-filter-path, --rollout-sample-filter-path) is not counted
here: it fails the run at once (its error names the flag), since it is not per-sample user code.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

KINDS = ("reward", "generate")
FRACTION_FLAG = "--max-failed-sample-fraction"
WINDOW_FLAG = "--failed-sample-window-steps"
WHAT = {
    "reward": "the reward function (--custom-rm-path)",
    "generate": "the custom generate function (--custom-generate-function-path)",
}
SUMMARY_SECONDS = 30.0


class SampleFailuresError(RuntimeError):
    """Too many samples' user code failed over the window (see the module docstring)."""

    def __init__(self, message: str):
        super().__init__(message)


def _message(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:500]


class FailureTally:
    """See the module docstring. Not thread-safe: call it from one thread (the producer's loop)."""

    def __init__(self, logger: logging.Logger | None = None, interval_seconds: float = SUMMARY_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.log = logger or logging.getLogger("miles_core.rollout")
        self.interval, self.clock = interval_seconds, clock
        self._window = self._empty()
        self._interval_t0: float | None = None  # the interval begins at its first failure
        self._repeats: dict[tuple[str, str], list] = {}  # (kind, type) -> [count after the first, first message]

    @staticmethod
    def _empty() -> dict:
        return {k: {"tried": 0, "failed": 0, "errors": {}} for k in KINDS}

    def tried(self, kind: str, n: int = 1) -> None:
        self._window[kind]["tried"] += n

    def failed(self, kind: str, error: BaseException, where: str = "") -> str:
        """Count one failed sample of `kind`; returns the message recorded for it."""
        message = _message(error)
        w = self._window[kind]
        w["failed"] += 1
        first = w["errors"].setdefault(type(error).__name__, {"count": 0, "first": message})
        first["count"] += 1
        self._console(kind, type(error).__name__, message, where)
        return message

    def _console(self, kind: str, etype: str, message: str, where: str) -> None:
        if self._interval_t0 is not None and self.clock() - self._interval_t0 >= self.interval:
            self.flush()
        if self._interval_t0 is None:
            self._interval_t0 = self.clock()
        key = (kind, etype)
        if key in self._repeats:
            self._repeats[key][0] += 1
            return
        self._repeats[key] = [0, message]
        self.log.warning("%s failed%s: %s (further %s failures with %s are counted: one summary line every %.0f s)",
                         kind, f" for {where}" if where else "", message, kind, etype, self.interval)

    def flush(self) -> None:
        """One line per (kind, exception type) that repeated since the interval began; the next failure
        begins a new interval."""
        seconds = 0.0 if self._interval_t0 is None else self.clock() - self._interval_t0
        for (kind, etype), (count, message) in self._repeats.items():
            if count:
                self.log.warning("%s failed %d more time(s) with %s in the last %.0f s (first: %s)",
                                 kind, count, etype, seconds, message)
        self._repeats = {}
        self._interval_t0 = None

    def take(self) -> dict:
        """The counts since the last take: {kind: {"tried", "failed", "errors": {type: {"count", "first"}}}}."""
        out, self._window = self._window, self._empty()
        return out


def merge(a: dict, b: dict) -> dict:
    """Two tallies (`FailureTally.take()` answers) added up; the first message of `a` wins."""
    out = FailureTally._empty()
    for t in (a, b):
        for kind, w in (t or {}).items():
            o = out.setdefault(kind, {"tried": 0, "failed": 0, "errors": {}})
            o["tried"] += int(w.get("tried", 0))
            o["failed"] += int(w.get("failed", 0))
            for etype, e in w.get("errors", {}).items():
                oe = o["errors"].setdefault(etype, {"count": 0, "first": e["first"]})
                oe["count"] += int(e["count"])
    return out


def summary_lines(tally: dict) -> list[str]:
    """Human lines naming each kind that failed: count, share, and the first message per exception type."""
    lines = []
    for kind, w in tally.items():
        if not w.get("failed"):
            continue
        errors = sorted(w["errors"].items(), key=lambda kv: -kv[1]["count"])
        first = "; ".join(f"{e['count']}x {e['first']}" for _, e in errors)
        share = f" of {w['tried']}" if w.get("tried") else ""
        lines.append(f"{kind}: {w['failed']}{share} samples failed ({first})")
    return lines


class FailureBudget:
    """See the module docstring. `observe(step, tally, last)` once per step; raises SampleFailuresError."""

    def __init__(self, max_fraction: float, window_steps: int):
        self.max_fraction, self.window_steps = float(max_fraction), int(window_steps)
        self._steps: deque[tuple[int, dict]] = deque(maxlen=self.window_steps)
        self.total: dict = FailureTally._empty()  # this segment's counts, for the run's record

    def observe(self, step: int, tally: dict | None, last: bool = False) -> None:
        tally = tally or {}
        self.total = merge(self.total, tally)
        self._steps.append((step, tally))
        if self.max_fraction >= 1 or (len(self._steps) < self.window_steps and not last):
            return
        window: dict = {}
        for _, t in self._steps:
            window = merge(window, t)
        for kind in KINDS:
            w = window.get(kind, {})
            tried, failed = w.get("tried", 0), w.get("failed", 0)
            if tried and failed / tried > self.max_fraction:
                raise SampleFailuresError(self._message(kind, w, self._steps[0][0], step))

    def _message(self, kind: str, w: dict, first_step: int, step: int) -> str:
        etype, e = max(w["errors"].items(), key=lambda kv: kv[1]["count"]) if w["errors"] else ("?", {"first": "?"})
        steps = f"step {step}" if first_step == step else f"steps {first_step}-{step}"
        return (f"{WHAT[kind]} failed on {w['failed']} of {w['tried']} samples ({w['failed'] / w['tried']:.0%}) "
                f"over {steps}, above {FRACTION_FLAG}={self.max_fraction:g} (window {WINDOW_FLAG}="
                f"{self.window_steps}); first: {e['first']}. Fix the function, or raise {FRACTION_FLAG} "
                "(1 never stops the run)")


def streak_error(kind: str, count: int, first: str) -> SampleFailuresError:
    """`kind` failed on `count` samples in a row, a full window's worth (see `generate_failure_limit` in
    miles_core.rollout.manager): with every group rejected, no step would ever come to judge them."""
    return SampleFailuresError(
        f"{WHAT[kind]} failed on {count} samples in a row ({WINDOW_FLAG} steps' worth, none succeeded), above "
        f"{FRACTION_FLAG}; first: {first}. Fix the function, or raise {FRACTION_FLAG} (1 never stops the run)")
