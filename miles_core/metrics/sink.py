"""MetricsSink: metric events as JSON lines in the run root, append-only on any object store.

Object stores cannot append, so a sink buffers events and each flush writes one new, immutable
part object: `metrics/{component}/{writer}-{part:06d}.jsonl`, where `writer` starts with the
writer's start time in milliseconds. Keys therefore sort in time order, several processes (or
resumed segments) can log the same component without coordination, and nothing is ever
rewritten. A part is one atomic PUT, so readers never see a torn line.

A flush happens when `flush_events` events are buffered, when `flush_seconds` have passed since
the last flush (checked on each log and by a background thread), and at `close()`. Use the sink
as a context manager; it is thread-safe, not picklable (each Ray actor makes its own).

Event: {"step": int, "time": unix seconds, "name": str, "value": float | null}; non-finite values
are stored as null. Non-numeric values are skipped (logged once per name).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from typing import Mapping

from miles_core.storage import StorageError, Store, validate_name

log = logging.getLogger(__name__)

METRICS_PREFIX = "metrics"


def _as_store(run) -> Store:
    return run if isinstance(run, Store) else Store(run)


class MetricsSink:
    def __init__(self, run, component: str, *, flush_seconds: float = 10.0, flush_events: int = 1000,
                 background: bool = True):
        """`run`: the run root (a Store or its URI); `component`: e.g. trainer, rollout, eval, buffer."""
        self.store = _as_store(run)
        self.component = validate_name(component, "metrics component")
        self.flush_seconds = float(flush_seconds)
        self.flush_events = max(1, int(flush_events))
        self.writer = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"
        self._pending: list[dict] = []
        self._part = 0
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._skipped_names: set[str] = set()
        self._closed = False
        self._stop = threading.Event()
        self._thread = None
        if background and self.flush_seconds > 0:
            self._thread = threading.Thread(target=self._flush_loop, name=f"metrics-{component}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: Mapping[str, object], wall_time: float | None = None) -> None:
        """Record `metrics` (name -> number) at `step`."""
        if self._closed:
            raise RuntimeError(f"MetricsSink({self.component}) is closed")
        now = time.time() if wall_time is None else float(wall_time)
        events = []
        for name, value in metrics.items():
            v = self._number(name, value)
            if v is not _SKIP:
                events.append({"step": int(step), "time": now, "name": str(name), "value": v})
        with self._lock:
            self._pending.extend(events)
            due = len(self._pending) >= self.flush_events or time.monotonic() - self._last_flush >= self.flush_seconds
        if due:
            try:
                self.flush()
            except StorageError as e:  # the events stay buffered; close() raises if storage stays down
                log.warning("metrics flush of %s failed (will retry): %s", self.component, e)

    def log_one(self, step: int, name: str, value: float, wall_time: float | None = None) -> None:
        self.log(step, {name: value}, wall_time)

    def _number(self, name, value):
        if isinstance(value, bool):
            return float(value)
        try:
            v = float(value)  # ints, floats, numpy and torch scalars
        except (TypeError, ValueError):
            if name not in self._skipped_names:
                self._skipped_names.add(name)
                log.warning("metric %r has a non-numeric value of type %s; skipped", name, type(value).__name__)
            return _SKIP
        return v if math.isfinite(v) else None

    # ------------------------------------------------------------------ flushing

    def part_key(self, part: int) -> str:
        return f"{METRICS_PREFIX}/{self.component}/{self.writer}-{part:06d}.jsonl"

    def flush(self) -> str | None:
        """Write buffered events as one new part object; returns its key (None when nothing was buffered).

        On a storage error the events stay buffered for the next flush and the error is raised.
        """
        with self._flush_lock:
            with self._lock:
                events, self._pending = self._pending, []
                self._last_flush = time.monotonic()
            if not events:
                return None
            body = "".join(json.dumps(e, allow_nan=False) + "\n" for e in events).encode()
            key = self.part_key(self._part)
            try:
                self.store.put_bytes(key, body)
            except Exception:
                with self._lock:
                    self._pending[:0] = events
                raise
            self._part += 1
            return key

    def _flush_loop(self) -> None:
        while not self._stop.wait(min(self.flush_seconds, 1.0)):
            with self._lock:
                due = self._pending and time.monotonic() - self._last_flush >= self.flush_seconds
            if due:
                try:
                    self.flush()
                except StorageError as e:
                    log.warning("metrics flush of %s failed (will retry): %s", self.component, e)

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        self._closed = True

    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SKIP = object()


# ----------------------------------------------------------------------------- reading


def read_metrics(run, component: str | None = None) -> list[dict]:
    """Every event of the run (or of one component), sorted by (step, time).

    Each event also carries "component". Undecodable lines are skipped with a warning: a report
    must come out even from a run root with a damaged part.
    """
    store = _as_store(run)
    prefix = f"{METRICS_PREFIX}/{validate_name(component, 'metrics component')}" if component else METRICS_PREFIX
    events = [e for key in store.list(prefix) if key.endswith(".jsonl") for e in part_events(store, key)]
    events.sort(key=lambda e: (e["step"], e["time"]))
    return events


def part_events(store: Store, key: str) -> list[dict]:
    """The events of one part object, each with its "component"; bad lines skipped with a warning."""
    comp = key.split("/")[1] if key.count("/") >= 2 else ""
    text = store.get_bytes(key).decode("utf-8", errors="replace")
    events = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            events.append({"step": int(e["step"]), "time": float(e["time"]), "name": str(e["name"]),
                           "value": None if e["value"] is None else float(e["value"]), "component": comp})
        except (ValueError, KeyError, TypeError) as ex:
            log.warning("skipping bad metric event %s line %d: %s", store.uri(key), lineno, ex)
    return events


def series(events: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric: the mean per step of its non-null values, in step order."""
    per_step: dict[int, list[float]] = {}
    for e in events:
        if e["name"] == name and e["value"] is not None:
            per_step.setdefault(e["step"], []).append(e["value"])
    steps = sorted(per_step)
    return steps, [sum(per_step[s]) / len(per_step[s]) for s in steps]


def metric_names(events: list[dict]) -> list[str]:
    return sorted({e["name"] for e in events})
