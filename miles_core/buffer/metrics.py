"""Buffer metric names (docs/data-path.md) and the per-window accumulator behind `get_metrics()`.

The names are interface: plots, reports and users' dashboards read them. `METRIC_NAMES` is the
single list the docs are checked against; `DYNAMIC_FILTER_DROP` is a pattern with `{reason}`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

PREFIX = "rollout/fully_async/"
QUEUE_SIZE = PREFIX + "queue_size"
ABORTED_GROUPS_FILTERED = PREFIX + "aborted_groups_filtered"
STALE_GROUPS_FILTERED = PREFIX + "stale_groups_filtered"
AVG_STALENESS = PREFIX + "avg_staleness"
MAX_STALENESS = PREFIX + "max_staleness"
BUFFER_AVG_STALENESS = PREFIX + "buffer_avg_staleness"
BUFFER_MAX_STALENESS = PREFIX + "buffer_max_staleness"
PUT_SECONDS = PREFIX + "put_seconds"
BYTES_WRITTEN = PREFIX + "bytes_written"
QUARANTINED = PREFIX + "quarantined"
DUPLICATE_GROUPS_FILTERED = PREFIX + "duplicate_groups_filtered"
UNUSED_DROPPED = PREFIX + "unused_dropped"
UNUSED_RECYCLED = PREFIX + "unused_recycled"
PRODUCER_BLOCKED_SECONDS = "perf/producer_blocked_seconds"
DYNAMIC_FILTER_DROP = "rollout/dynamic_filter/drop_{reason}"

# Every metric the buffer and the built-in unused-samples handlers can emit.
METRIC_NAMES: tuple[str, ...] = (
    QUEUE_SIZE,
    ABORTED_GROUPS_FILTERED,
    STALE_GROUPS_FILTERED,
    AVG_STALENESS,
    MAX_STALENESS,
    BUFFER_AVG_STALENESS,
    BUFFER_MAX_STALENESS,
    PUT_SECONDS,
    BYTES_WRITTEN,
    QUARANTINED,
    DUPLICATE_GROUPS_FILTERED,
    UNUSED_DROPPED,
    UNUSED_RECYCLED,
    PRODUCER_BLOCKED_SECONDS,
    DYNAMIC_FILTER_DROP,
)

_REASON_RE = re.compile(r"[^a-z0-9_]+")


def drop_metric(reason: str) -> str:
    """`rollout/dynamic_filter/drop_{reason}` with the reason folded to [a-z0-9_] (metric-name safe)."""
    clean = _REASON_RE.sub("_", str(reason).strip().lower()).strip("_") or "unspecified"
    return DYNAMIC_FILTER_DROP.format(reason=clean)


@dataclass
class Window:
    """Counters for one metrics window. Callers hold the buffer's lock."""

    aborted: int = 0
    stale: int = 0
    staleness: list[int] = field(default_factory=list)  # every group examined at get with a known staleness
    put_seconds: list[float] = field(default_factory=list)  # slot acquired -> committed, per put
    bytes_written: int = 0
    quarantined: int = 0
    duplicates: int = 0
    blocked_seconds: float = 0.0
    drops: Counter = field(default_factory=Counter)

    def emit(self, queue_size: int, buffered_staleness: list[int]) -> dict[str, float]:
        m: dict[str, float] = {
            QUEUE_SIZE: queue_size,
            ABORTED_GROUPS_FILTERED: self.aborted,
            STALE_GROUPS_FILTERED: self.stale,
            BYTES_WRITTEN: self.bytes_written,
            QUARANTINED: self.quarantined,
            DUPLICATE_GROUPS_FILTERED: self.duplicates,
            PRODUCER_BLOCKED_SECONDS: self.blocked_seconds,
        }
        if self.put_seconds:
            m[PUT_SECONDS] = sum(self.put_seconds) / len(self.put_seconds)
        if self.staleness:
            m[AVG_STALENESS] = sum(self.staleness) / len(self.staleness)
            m[MAX_STALENESS] = max(self.staleness)
        if buffered_staleness:
            m[BUFFER_AVG_STALENESS] = sum(buffered_staleness) / len(buffered_staleness)
            m[BUFFER_MAX_STALENESS] = max(buffered_staleness)
        for reason_metric, n in sorted(self.drops.items()):
            m[reason_metric] = n
        return m
