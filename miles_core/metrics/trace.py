"""The run's timeline: spans of every role on one clock, exported as Chrome trace-event JSON.

    trace.configure(store, "rollout")                    # once per process (driver, actors, ranks)
    with trace.span("optimizer", lane="trainer", step=7):
        ...
    trace.async_span("group", group_id, t_submit, t_commit, reward=0.5)

Each process buffers its events and a background thread writes them every `flush_seconds` as one
new object, `trace/events/{process}/{flush time in ms}-{writer}-{part:06d}.json` (like the metric
parts: immutable, no coordination between writers; a key says when its chunk was written). A
chunk carries its process, host, Ray node and pid; every time is the writer's `time.time()`.
`trace/clock.json` holds each Ray node's clock offset from the driver's node, measured by the
driver (a round trip to a task pinned on that node, the fastest of several); `build_trace` adds
it when it merges the chunks, so spans from different nodes line up.

Bounded: a process buffers at most `max_pending` events between flushes (more are dropped and
counted in the chunk's `dropped`); group and request spans are recorded for a deterministic
sample of group ids (`--trace-sample-groups`, default every group); the driver keeps only the
chunks of the last `--trace-window-steps` steps (`prune`). Recording an event is a list append
under a lock (about a microsecond); a process that never called `configure` records nothing.

`build_trace(store, steps=(a, b))` merges the chunks into one trace ({"traceEvents": [...]}):
spans ("X") nest on their lane, group lives and engine requests are async spans ("b"/"e" pairs
with an id) that Perfetto draws on tracks of their own, and metadata events name every process
and lane. `miles trace RUN_URI` writes it; the report draws its last steps as a swimlane.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import zlib
from typing import Iterator

from miles_core.config.sections import MetricsSection
from miles_core.storage import StorageError, StorageUnavailable, Store

log = logging.getLogger(__name__)

TRACE_PREFIX = "trace"
EVENTS_PREFIX = f"{TRACE_PREFIX}/events"
CLOCK_KEY = f"{TRACE_PREFIX}/clock.json"
TIMELINE_KEY = f"{TRACE_PREFIX}/timeline.json"
STEP_SPAN = "step"  # the driver's span of one training step; args {"step": n}
DRIVER_PROCESS = "driver"
PRODUCER_PROCESS = "producer-"  # + the producer job's id


def now() -> float:
    """The trace's clock: this host's wall clock in seconds (offsets between nodes are measured)."""
    return time.time()


def _us(seconds: float) -> int:
    return int(seconds * 1_000_000)


def sampled(group_id: str, fraction: float) -> bool:
    """Whether a group's spans are recorded: the same answer in every process for one group id."""
    if fraction >= 1.0:
        return True
    return (zlib.crc32(group_id.encode()) % 10_000) < fraction * 10_000


def ray_node_id() -> str | None:
    """This process's Ray node id, or None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a trace never fails the run
        return None


class Tracer:
    """One process's recorder. Thread-safe; times are `now()` seconds."""

    def __init__(self, store: Store, process: str, *, flush_seconds: float = 10.0, max_pending: int = 50_000,
                 sample_groups: float = 1.0, background: bool = True):
        self.store, self.process = store, process
        self.flush_seconds, self.max_pending, self.sample_groups = flush_seconds, max_pending, sample_groups
        self.writer = uuid.uuid4().hex[:8]
        self.header = {"process": process, "host": socket.gethostname(), "node": ray_node_id(), "pid": os.getpid()}
        self._pending: list[dict] = []
        self._dropped = 0
        self._part = 0
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._flush_loop, name=f"trace-{process}", daemon=True)
            self._thread.start()

    # ---- recording -----------------------------------------------------------------------------
    def _add(self, event: dict) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._dropped += 1
                return
            self._pending.append(event)

    def complete(self, name: str, start: float, end: float, *, lane: str = "main", cat: str = "", **args) -> None:
        """A span on `lane` (spans on one lane must nest)."""
        self._add({"ph": "X", "name": name, "cat": cat, "ts": _us(start), "dur": max(0, _us(end) - _us(start)),
                   "lane": lane, "args": args})

    def async_span(self, name: str, span_id: str, start: float, end: float, *, cat: str = "", **args) -> None:
        """A span that may overlap others (a group's life, one request): drawn on a track of its own;
        spans with the same id nest."""
        self._add({"ph": "A", "name": name, "cat": cat or name, "id": span_id, "ts": _us(start),
                   "dur": max(0, _us(end) - _us(start)), "args": args})

    def instant(self, name: str, at: float | None = None, *, lane: str = "main", cat: str = "", **args) -> None:
        self._add({"ph": "i", "name": name, "cat": cat, "ts": _us(now() if at is None else at), "lane": lane,
                   "args": args})

    @contextlib.contextmanager
    def span(self, name: str, *, lane: str = "main", cat: str = "", **args) -> Iterator[dict]:
        """Time the block as a span; the yielded dict's items are added to its args."""
        extra: dict = {}
        start = now()
        try:
            yield extra
        finally:
            self.complete(name, start, now(), lane=lane, cat=cat, **args, **extra)

    def traces_group(self, group_id: str) -> bool:
        return sampled(group_id, self.sample_groups)

    # ---- writing -------------------------------------------------------------------------------
    def flush(self) -> str | None:
        """Write the buffered events as one chunk; returns its key. On a storage error they stay buffered."""
        with self._flush_lock:
            with self._lock:
                events, self._pending = self._pending, []
                dropped, self._dropped = self._dropped, 0
            if not events and not dropped:
                return None
            key = f"{EVENTS_PREFIX}/{self.process}/{int(time.time() * 1000):013d}-{self.writer}-{self._part:06d}.json"
            body = json.dumps(self.header | {"dropped": dropped, "events": events}, separators=(",", ":"))
            try:
                self.store.put_bytes(key, body.encode())
            except Exception:
                with self._lock:
                    self._pending[:0] = events
                    self._dropped += dropped
                raise
            self._part += 1
            return key

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            self._flush_quietly()

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except StorageError as e:
            log.warning("trace flush of %s failed (will retry): %s", self.process, e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._flush_quietly()


class _NullTracer:
    """What `tracer()` returns in a process that never called `configure`: records nothing."""

    def complete(self, *a, **k) -> None: ...

    def async_span(self, *a, **k) -> None: ...

    def instant(self, *a, **k) -> None: ...

    @contextlib.contextmanager
    def span(self, *a, **k) -> Iterator[dict]:
        yield {}

    def traces_group(self, group_id: str) -> bool:
        return False

    def flush(self) -> None: ...

    def close(self) -> None: ...


_NULL = _NullTracer()
_current: Tracer | _NullTracer = _NULL


def configure(store: Store, process: str, **kwargs) -> Tracer:
    """Make this process record into `store` as `process` (closing a tracer configured before)."""
    global _current
    _current.close()
    _current = Tracer(store, process, **kwargs)
    return _current


def configure_from(m: MetricsSection, store: Store, process: str) -> Tracer | _NullTracer:
    """`configure` with the run's trace flags; with --no-trace this process records nothing."""
    if not m.trace:
        return _NULL
    return configure(store, process, flush_seconds=m.trace_flush_seconds, sample_groups=m.trace_sample_groups)


def join(m: MetricsSection, store: Store, process: str) -> Tracer | _NullTracer:
    """`configure_from` unless this process records already (a role run inside the driver's process
    records as the driver)."""
    return _current if enabled() else configure_from(m, store, process)


def tracer() -> Tracer | _NullTracer:
    return _current


def enabled() -> bool:
    """Whether this process records (configure was called)."""
    return _current is not _NULL


def shutdown() -> None:
    """Flush and stop this process's tracer (the next `tracer()` records nothing)."""
    global _current
    _current.close()
    _current = _NULL


def span(name: str, **kwargs):
    return _current.span(name, **kwargs)


# ----------------------------------------------------------------------------- clocks


def write_clock_offsets(store: Store, offsets: dict[str, dict], reference: str | None) -> None:
    """Record each node's clock offset from the driver's node (seconds to add to that node's times)."""
    store.put_json(CLOCK_KEY, {"reference": reference, "measured_at": now(), "nodes": offsets})


def estimate_offset(samples: list[tuple[float, float, float]]) -> dict:
    """Offset of a remote clock from (sent, remote time, received) round trips on the local clock:
    the fastest round trip's midpoint minus the remote time (error at most half its round trip)."""
    sent, remote, received = min(samples, key=lambda s: s[2] - s[0])
    return {"offset_seconds": (sent + received) / 2 - remote, "rtt_seconds": received - sent}


def read_offsets(store: Store) -> dict[str, float]:
    """node id -> seconds to add to its times; {} when nothing was measured (one node)."""
    try:
        record = store.get_json(CLOCK_KEY)
    except StorageUnavailable:
        raise
    except StorageError:
        return {}
    nodes = record.get("nodes") if isinstance(record, dict) else None
    return {k: float(v["offset_seconds"]) for k, v in (nodes or {}).items()
            if isinstance(v, dict) and isinstance(v.get("offset_seconds"), (int, float))}


# ----------------------------------------------------------------------------- reading


def read_chunks(store: Store) -> list[dict]:
    """Every chunk of the run root, in key order; a chunk that does not parse is skipped (logged)."""
    chunks = []
    for key in store.list(EVENTS_PREFIX + "/"):
        try:
            chunk = json.loads(store.get_bytes(key))
        except StorageUnavailable:
            raise
        except (StorageError, ValueError) as e:
            log.warning("trace chunk %s skipped: %s", key, e)
            continue
        if isinstance(chunk, dict) and isinstance(chunk.get("events"), list):
            chunks.append(chunk | {"key": key})
    return chunks


def aligned_events(store: Store) -> list[tuple[str, dict]]:
    """(process, event) of every chunk with the event's ts moved onto the driver's clock."""
    offsets = read_offsets(store)
    out = []
    for chunk in read_chunks(store):
        shift = _us(offsets.get(chunk.get("node") or "", 0.0))
        for event in chunk["events"]:
            if isinstance(event, dict) and isinstance(event.get("ts"), int):
                out.append((str(chunk.get("process")), event | {"ts": event["ts"] + shift}))
    return out


def step_windows(events: list[tuple[str, dict]]) -> dict[int, tuple[int, int]]:
    """step -> (start, end) µs of the driver's step spans."""
    out = {}
    for process, e in events:
        if process == DRIVER_PROCESS and e.get("name") == STEP_SPAN and e.get("ph") == "X":
            step = (e.get("args") or {}).get("step")
            if isinstance(step, int):
                out[step] = (e["ts"], e["ts"] + e.get("dur", 0))
    return out


def window_of(events: list[tuple[str, dict]], steps: tuple[int | None, int | None] | None) -> tuple[int, int] | None:
    """The µs window of steps [a, b) (None: everything). Raises ValueError when no step is in range."""
    if steps is None:
        return None
    windows = step_windows(events)
    a, b = steps
    chosen = [w for s, w in windows.items() if (a is None or s >= a) and (b is None or s < b)]
    if not chosen:
        known = f"{min(windows)}..{max(windows)}" if windows else "none"
        raise ValueError(f"no traced step in {a if a is not None else ''}:{b if b is not None else ''} "
                         f"(steps in the trace: {known})")
    return min(w[0] for w in chosen), max(w[1] for w in chosen)


def _overlaps(e: dict, window: tuple[int, int] | None) -> bool:
    return window is None or (e["ts"] <= window[1] and e["ts"] + e.get("dur", 0) >= window[0])


def to_chrome(events: list[tuple[str, dict]], window: tuple[int, int] | None = None) -> dict:
    """Chrome trace-event JSON of `events` within `window`, times from the first event."""
    kept = [(p, e) for p, e in events if _overlaps(e, window)]
    zero = min((e["ts"] for _, e in kept), default=0)
    pids = {p: i + 1 for i, p in enumerate(sorted({p for p, _ in kept}, key=lambda p: (p != DRIVER_PROCESS, p)))}
    tids: dict[tuple[str, str], int] = {}
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": p}} for p, pid in pids.items()]
    for p, e in kept:
        base = {"name": e.get("name", "?"), "cat": e.get("cat") or "miles", "pid": pids[p], "ts": e["ts"] - zero,
                "args": e.get("args") or {}}
        if e.get("ph") == "A":
            sid = f"{p}:{e.get('id')}"
            out.append(base | {"ph": "b", "id": sid, "tid": 0})
            out.append(base | {"ph": "e", "id": sid, "tid": 0, "ts": base["ts"] + e.get("dur", 0), "args": {}})
            continue
        tid = tids.setdefault((p, e.get("lane", "main")), len(tids) + 1)
        out.append(base | {"ph": e.get("ph", "X"), "tid": tid} | ({"dur": e.get("dur", 0)} if e.get("ph") == "X"
                                                                   else {"s": "t"}))
    out += [{"ph": "M", "name": "thread_name", "pid": pids[p], "tid": tid, "args": {"name": lane}}
            for (p, lane), tid in tids.items()]
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"zero_unix_us": zero}}


def build_trace(store: Store, steps: tuple[int | None, int | None] | None = None) -> dict:
    events = aligned_events(store)
    return to_chrome(events, window_of(events, steps))


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """'A:B' (A included, B excluded; either may be left out) or 'N' (that step alone)."""
    try:
        if ":" not in text:
            return int(text), int(text) + 1
        a, b = text.split(":", 1)
        steps = (int(a) if a.strip() else None), (int(b) if b.strip() else None)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B (A included, B excluded), A:, :B or N") from None
    if steps[0] is not None and steps[1] is not None and steps[1] <= steps[0]:
        raise ValueError(f"--steps {text!r}: no step is in it (B is excluded, so B must be larger than A)")
    return steps


def prune(store: Store, keep_after: float) -> int:
    """Delete the chunks written before unix time `keep_after` (a key starts with its write time, and
    every event of a chunk happened before it was written); returns how many were deleted."""
    removed = 0
    for key in store.list(EVENTS_PREFIX + "/"):
        written = key.rsplit("/", 1)[-1].split("-", 1)[0]
        if written.isdigit() and int(written) / 1000 < keep_after:
            store.delete(key)
            removed += 1
    return removed
