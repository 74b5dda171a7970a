"""The buffer's per-window metric counters behind `get_metrics()` (docs/data-path.md). The names it
emits are in miles_core.metrics.names (`BUFFER_METRICS`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from miles_core.metrics import names as N


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
            N.QUEUE_SIZE: queue_size,
            N.ABORTED_GROUPS_FILTERED: self.aborted,
            N.STALE_GROUPS_FILTERED: self.stale,
            N.BYTES_WRITTEN: self.bytes_written,
            N.QUARANTINED: self.quarantined,
            N.DUPLICATE_GROUPS_FILTERED: self.duplicates,
            N.PRODUCER_BLOCKED_SECONDS: self.blocked_seconds,
        }
        if self.put_seconds:
            m[N.PUT_SECONDS] = sum(self.put_seconds) / len(self.put_seconds)
        if self.staleness:
            m[N.AVG_STALENESS] = sum(self.staleness) / len(self.staleness)
            m[N.MAX_STALENESS] = max(self.staleness)
        if buffered_staleness:
            m[N.BUFFER_AVG_STALENESS] = sum(buffered_staleness) / len(buffered_staleness)
            m[N.BUFFER_MAX_STALENESS] = max(buffered_staleness)
        for reason_metric, n in sorted(self.drops.items()):
            m[reason_metric] = n
        return m
