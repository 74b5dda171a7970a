"""The DataBuffer slot (docs/data-path.md), the unused-samples handlers, and `build_buffer`.

    put(group) -> None        may store, reject or block (backpressure); never silently loses
    get(**context) -> group   waits until a group is available; context carries current_version;
                              unknown keys are ignored
    get_metrics() -> dict     metrics for the window since the last call, then resets the window

Blocking convention: every method here is synchronous and may block the calling thread (put on a
full buffer, get on an empty one). An asyncio producer calls them through `asyncio.to_thread`.

`--custom-async-data-buffer-path module:Class` replaces the default durable buffer; the class is
built as `Class(config, unused_samples_handler, store=..., consumed_through_step=...)` and then owns
every group decision. `store` is the run root's Store and `consumed_through_step` the step of the
checkpoint this segment resumes from (-1: none); a class whose `__init__` does not take both
keywords is built as `Class(config, unused_samples_handler)`, with a warning that it gets neither,
so it cannot serve committed groups again after a crash nor keep consumed ones from being served
twice (exactly-once is then the plug-in's own business). The default buffer also offers the
extras the rollout manager uses (`BufferExtras.METHODS`: the consumption record, compaction, what it
committed, the counts the demand gate and the producer feed read, `close`); a custom buffer may leave
any of them out, and `BufferExtras` is the one place that looks them up (once, when the buffer is
built) and says what stands in for each one left out.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Callable, Protocol, runtime_checkable

from miles_core.config.plugins import load_optional
from miles_core.metrics import names as N
from miles_core.samples import Group

log = logging.getLogger(__name__)

BUFFER_FLAG = "--custom-async-data-buffer-path"
FILTER_FLAG = "--dynamic-sampling-filter-path"
BUFFER_METHODS = ("put", "get", "get_metrics")


class DataBufferError(RuntimeError):
    """A buffer operation that cannot go on (closed buffer, corrupt manifest, bad filter)."""

    def __init__(self, message: str):
        super().__init__(message)


class BufferClosed(DataBufferError):
    pass


class BufferTimeout(DataBufferError, TimeoutError):
    pass


@runtime_checkable
class DataBuffer(Protocol):
    def put(self, group: Group) -> None: ...

    def get(self, **context: Any) -> Group: ...

    def get_metrics(self) -> dict[str, float]: ...


class BufferExtras:
    """The run buffer's methods beyond the DataBuffer slot, typed, for the rollout manager. The durable
    default has all of them; for a custom buffer each one it leaves out stands in as written below."""

    METHODS = ("committed_positions", "groups_received", "usable_queue_size", "recent_foreign_writers",
               "record_consumed", "compact", "close")

    def __init__(self, buffer: Any):
        self._has = {m: fn for m in self.METHODS if callable(fn := getattr(buffer, m, None))}
        self._queue_size = lambda: int(getattr(buffer, "queue_size", 0))

    def committed_positions(self) -> set[tuple[int, int]]:
        """Positions (epoch, index) the buffer committed; none: nothing to skip on a resume."""
        fn = self._has.get("committed_positions")
        return fn() if fn else set()

    def groups_received(self) -> int | None:
        """Groups queued or handed out since it opened; None: the demand gate does not apply."""
        fn = self._has.get("groups_received")
        return fn() if fn else None

    def usable_queue_size(self, version: int | None) -> int:
        """Queued groups a get under `version` would not reject; without it, its `queue_size` (else 0)."""
        fn = self._has.get("usable_queue_size")
        return fn(version) if fn else self._queue_size()

    def recent_foreign_writers(self) -> int:
        """Producer jobs that committed into it lately; without it, 0."""
        fn = self._has.get("recent_foreign_writers")
        return fn() if fn else 0

    def record_consumed(self, step: int, group_ids: list[str]) -> None:
        """Record that `step` consumed `group_ids`; without it, nothing is recorded."""
        if fn := self._has.get("record_consumed"):
            fn(step, group_ids)

    def compact(self, through_step: int, *, delete_consumed_objects: bool) -> None:
        """Fold the consumption record through a complete checkpoint's step; without it, nothing."""
        if fn := self._has.get("compact"):
            fn(through_step, delete_consumed_objects=delete_consumed_objects)

    def close(self) -> None:
        if fn := self._has.get("close"):
            fn()


@runtime_checkable
class UnusedSamplesHandler(Protocol):
    """Receives every group the buffer rejects (reason: 'aborted' at put, 'stale' at get).

    `handle` returns nothing; it must not block for long (it runs on the put/get caller's thread).
    """

    def handle(self, group: Group, reason: str) -> None: ...


class DropUnused:
    """`--async-unused-samples-handler drop`: discard the group, count the drop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped = 0
        self.dropped_total = 0

    def handle(self, group: Group, reason: str) -> None:
        with self._lock:
            self._dropped += 1
            self.dropped_total += 1

    def metrics(self) -> dict[str, float]:
        """Drops since the last call (merged into the buffer's `get_metrics`)."""
        with self._lock:
            n, self._dropped = self._dropped, 0
        return {N.UNUSED_DROPPED: n}


_RETRY_SUFFIX = re.compile(r"#r(\d+)$")


def retry_group_id(group_id: str) -> str:
    """The id of the next attempt: `g` -> `g#r1` -> `g#r2` (ids are unique per prompt group and attempt)."""
    m = _RETRY_SUFFIX.search(group_id)
    if m is None:
        return f"{group_id}#r1"
    return f"{group_id[: m.start()]}#r{int(m.group(1)) + 1}"


def cleared_group(group: Group) -> Group:
    """The original prompt group under a new attempt id, every generated field cleared."""
    new_id = retry_group_id(group.group_id)
    return Group(new_id, group.prompt_index, [s.cleared(new_id) for s in group.samples])


class RetryUnused:
    """`--async-unused-samples-handler retry`: hand the cleared prompt group back to the data source.

    `recycle(prompt_group)` is provided by the data source; it must accept the group and return
    quickly (queue it for the next submission).
    """

    def __init__(self, recycle: Callable[[Group], None]) -> None:
        if not callable(recycle):
            raise TypeError("RetryUnused needs a callable recycle(prompt_group) from the data source")
        self._recycle = recycle
        self._lock = threading.Lock()
        self._recycled = 0

    def handle(self, group: Group, reason: str) -> None:
        self._recycle(cleared_group(group))
        with self._lock:
            self._recycled += 1

    def metrics(self) -> dict[str, float]:
        with self._lock:
            n, self._recycled = self._recycled, 0
        return {N.UNUSED_RECYCLED: n}


def build_unused_handler(mode: str, recycle: Callable[[Group], None] | None = None) -> UnusedSamplesHandler:
    """The handler for `--async-unused-samples-handler` (drop | retry; retry needs the data source's recycle)."""
    if mode == "drop":
        return DropUnused()
    if mode == "retry":
        if recycle is None:
            raise ValueError("--async-unused-samples-handler=retry needs the data source's recycle(prompt_group) "
                             "callable; pass recycle= when building the handler")
        return RetryUnused(recycle)
    raise ValueError(f"--async-unused-samples-handler={mode!r}: expected one of drop, retry")


def load_dynamic_filter(path: str) -> Callable[[Group], tuple[bool, str]] | None:
    return load_optional(path, FILTER_FLAG)
