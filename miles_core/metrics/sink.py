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
from typing import Mapping, Protocol

from miles_core.storage import StorageError, Store, validate_name

log = logging.getLogger(__name__)

METRICS_PREFIX = "metrics"


class MetricMirror(Protocol):
    """An optional extra destination (TensorBoard, W&B). The JSONL parts stay the source of truth."""

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None: ...

    def close(self) -> None: ...


def _as_store(run) -> Store:
    return run if isinstance(run, Store) else Store(run)


class MetricsSink:
    def __init__(self, run, component: str, *, flush_seconds: float = 10.0, flush_events: int = 1000,
                 mirrors: tuple[MetricMirror, ...] | list[MetricMirror] = (), background: bool = True):
        """`run`: the run root (a Store or its URI); `component`: e.g. trainer, rollout, eval, buffer."""
        self.store = _as_store(run)
        self.component = validate_name(component, "metrics component")
        self.flush_seconds = float(flush_seconds)
        self.flush_events = max(1, int(flush_events))
        self.mirrors = list(mirrors)
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
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            v = self._number(name, value)
            if v is _SKIP:
                continue
            events.append({"step": int(step), "time": now, "name": str(name), "value": v})
            if v is not None:
                clean[str(name)] = v
        with self._lock:
            self._pending.extend(events)
            due = len(self._pending) >= self.flush_events or time.monotonic() - self._last_flush >= self.flush_seconds
        for m in self.mirrors:
            try:
                m.log(int(step), clean, now)
            except Exception as e:  # noqa: BLE001 - a mirror must never break training
                log.warning("metrics mirror %s failed: %s", type(m).__name__, e)
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
        for m in self.mirrors:
            try:
                m.close()
            except Exception as e:  # noqa: BLE001
                log.warning("metrics mirror %s failed to close: %s", type(m).__name__, e)

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
    events: list[dict] = []
    for key in store.list(prefix):
        if not key.endswith(".jsonl"):
            continue
        comp = key.split("/")[1] if key.count("/") >= 2 else ""
        text = store.get_bytes(key).decode("utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                event = {"step": int(e["step"]), "time": float(e["time"]), "name": str(e["name"]),
                         "value": None if e["value"] is None else float(e["value"]), "component": comp}
            except (ValueError, KeyError, TypeError) as ex:
                log.warning("skipping bad metric event %s line %d: %s", store.uri(key), lineno, ex)
                continue
            events.append(event)
    events.sort(key=lambda e: (e["step"], e["time"]))
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


# ----------------------------------------------------------------------------- optional mirrors


class TensorBoardMirror:
    def __init__(self, logdir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("the TensorBoard mirror needs the `tensorboard` package (not a dependency of "
                              "miles-flyte); install it or drop the TensorBoard option") from e
        self._w = SummaryWriter(logdir)

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        for name, v in metrics.items():
            self._w.add_scalar(name, v, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self._w.close()


class WandbMirror:
    def __init__(self, project: str, run_name: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("the W&B mirror needs the `wandb` package (not a dependency of miles-flyte); "
                              "install it or drop the W&B option") from e
        self._run = wandb.init(project=project, name=run_name, resume="allow")

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def optional_sinks(tensorboard_dir: str | None = None, wandb_project: str | None = None,
                   run_name: str | None = None) -> list[MetricMirror]:
    """Mirrors for the options given; ImportError with what to install when a package is missing."""
    mirrors: list[MetricMirror] = []
    if tensorboard_dir:
        mirrors.append(TensorBoardMirror(tensorboard_dir))
    if wandb_project:
        mirrors.append(WandbMirror(wandb_project, run_name))
    return mirrors
