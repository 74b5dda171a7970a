"""Who generated a run's groups: its producer jobs, as the run root records them (accounting).

    rows = producer_rows(store, manifests)   # `miles runs show`: one row per producer, then the run's own
    producer_of(store, group_id)             # `miles lineage`: the producer job of one group, or TRAINER

Each producer's heartbeat (`producers/heartbeats/{id}.json`) gives its host, first and last heartbeat,
state, engines, groups committed and rejected at put, and tokens/s. What the trainer did with its
groups comes from the consumption manifests: a group's producer is the claim holder its id ends with
(`e{epoch}-p{position}-a{attempt}-{holder}`), which stays the same when a retried task starts the
producer again under the same id (a new buffer writer); ids of the run's own rollout, and of runs
that never allowed producers, count as TRAINER. "Rejected at get" is what the manifests list as
rejected: too stale for --max-weight-staleness, or refused as another writer's duplicate.
"""

from __future__ import annotations

import time
from collections import Counter

from miles_core.buffer.objects import from_producer, holder_of_id
from miles_core.elastic.heartbeat import STOPPED, Heartbeat, list_heartbeats, read_heartbeat
from miles_core.storage import Store

TRAINER = "trainer"  # the run's own rollout, in the rows and in a lineage
SILENT_SECONDS = 60.0  # a live producer beats every 5 s: this long without one, it was probably killed


def generated_by(group_id: str) -> str:
    """The producer id of the job that generated `group_id`, or TRAINER."""
    return holder_of_id(group_id) if from_producer(group_id) else TRAINER


def producer_rows(store: Store, manifests: list[dict]) -> list[dict]:
    """One row per producer that joined (by start), then TRAINER's; [] for a run no producer fed."""
    consumed = _count(gid for m in manifests for gid in m.get("consumed", ()))
    rejected = _count(gid for m in manifests for gid in m.get("rejected", ()))
    beats = {b.producer_id: b for b in list_heartbeats(store)}
    ids = [*beats, *sorted((consumed.keys() | rejected.keys()) - beats.keys() - {TRAINER})]
    if not ids:
        return []
    rows = [_row(pid, beats.get(pid), consumed[pid], rejected[pid]) for pid in ids]
    return rows + [_row(TRAINER, None, consumed[TRAINER], rejected[TRAINER])]


def _count(group_ids) -> Counter:
    return Counter(generated_by(gid) for gid in group_ids)


def _row(producer_id: str, beat: Heartbeat | None, consumed: int, rejected: int) -> dict:
    row = {"producer_id": producer_id, "groups_consumed": consumed, "groups_rejected_at_get": rejected}
    if beat is None:  # the run's own rollout, or a producer whose record is gone
        return row | dict.fromkeys(("host", "writer", "state", "stop_reason", "started_at", "heartbeat_at",
                                    "engines", "version", "groups_committed", "groups_rejected_at_put",
                                    "tokens_per_second", "silent_seconds"))
    return row | {"host": beat.host, "writer": beat.writer, "state": beat.state, "stop_reason": beat.stop_reason,
                  "started_at": beat.started_at, "heartbeat_at": beat.heartbeat_at, "engines": beat.engines,
                  "version": beat.version, "groups_committed": beat.groups_committed,
                  "groups_rejected_at_put": beat.groups_rejected, "tokens_per_second": beat.tokens_per_second,
                  "silent_seconds": _silent(beat)}


def _silent(beat: Heartbeat) -> float | None:
    """Seconds since the last heartbeat of a producer that never said it stopped and is quiet for longer
    than SILENT_SECONDS (two hosts' wall clocks: a hint for people, never a decision), else None."""
    age = time.time() - beat.heartbeat_at
    return round(age, 1) if beat.state != STOPPED and age > SILENT_SECONDS else None


def producer_of(store: Store, group_id: str) -> dict:
    """{"producer_id", "host"} of the job that generated `group_id` (host None for TRAINER, or when the
    producer's record is gone)."""
    pid = generated_by(group_id)
    beat = None if pid == TRAINER else read_heartbeat(store, pid)
    return {"producer_id": pid, "host": beat.host if beat is not None else None}
