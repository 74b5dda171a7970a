"""What each producer job publishes about itself: `producers/heartbeats/{producer id}.json`.

    beat = Heartbeat.start(producer_id, writer)   # at join
    write_heartbeat(store, beat.update(...))      # every few seconds, and once more when it stops
    list_heartbeats(store)                        # accounting: `miles runs show`, the report

Written by the producer alone (its only record outside its groups and claims). A record whose
`heartbeat_at` is old belongs to a producer that was killed (or lost its storage): the run goes on,
and that producer's unfinished prompt block is claimed again by another writer after its expiry.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from dataclasses import dataclass, field

from miles_core.storage import ObjectNotFound, StorageError, StorageUnavailable, Store, validate_name

log = logging.getLogger(__name__)

HEARTBEATS = "producers/heartbeats/"
STARTING, GENERATING, WAITING, STOPPED = "starting", "generating", "waiting", "stopped"


@dataclass(frozen=True)
class Heartbeat:
    producer_id: str
    writer: str  # the buffer writer id its groups are committed under (buffer/groups/{writer}/)
    host: str
    started_at: float
    heartbeat_at: float
    state: str = STARTING
    stop_reason: str = ""
    engines: int = 0
    version: int = 0  # the weight version its engines serve
    groups_committed: int = 0
    groups_rejected: int = 0  # aborted or filtered at put: never committed
    tokens: int = 0  # response tokens generated
    tokens_per_second: float = 0.0  # over the last heartbeat interval
    history: list = field(default_factory=list)  # [[time, groups_committed], ...], sparse: throughput over time

    @staticmethod
    def start(producer_id: str, writer: str) -> "Heartbeat":
        now = time.time()
        return Heartbeat(producer_id, writer, socket.gethostname(), now, now)

    def update(self, **changes) -> "Heartbeat":
        now = time.time()
        beat = dataclasses.replace(self, heartbeat_at=now, **changes)
        interval = max(now - self.heartbeat_at, 1e-9)
        rate = (beat.tokens - self.tokens) / interval
        history = thinned([*self.history, [round(now, 3), beat.groups_committed]])
        return dataclasses.replace(beat, tokens_per_second=rate, history=history)


HISTORY_POINTS = 720  # one point per heartbeat (an hour at 5 s), then every other point of the whole life


def thinned(history: list) -> list:
    """`history`, every other point dropped once it holds more than HISTORY_POINTS (the first and the
    last kept): the record stays small and still spans the producer's whole life, coarser the longer."""
    if len(history) <= HISTORY_POINTS:
        return history
    return [*history[:-1:2], history[-1]]


def heartbeat_key(producer_id: str) -> str:
    return f"{HEARTBEATS}{validate_name(producer_id, 'producer id')}.json"


def write_heartbeat(store: Store, beat: Heartbeat) -> None:
    store.put_json(heartbeat_key(beat.producer_id), dataclasses.asdict(beat))


def read_heartbeat(store: Store, producer_id: str) -> Heartbeat | None:
    try:
        return _parse(store.get_json(heartbeat_key(producer_id)))
    except ObjectNotFound:
        return None


def list_heartbeats(store: Store) -> list[Heartbeat]:
    """Every producer that ever joined the run, by start time; records that do not parse are skipped
    with a warning (never a failure of the command that reads them)."""
    beats = []
    for key in store.list(HEARTBEATS):
        try:
            beats.append(_parse(store.get_json(key)))
        except StorageUnavailable:
            raise
        except (StorageError, ValueError, TypeError) as e:  # gone since the listing, or not a record
            log.warning("skipping producer record %s: %s", store.uri(key), e)
    return sorted(beats, key=lambda b: b.started_at)


def _parse(raw) -> Heartbeat:
    if not isinstance(raw, dict):
        raise ValueError("not a producer heartbeat record")
    names = {f.name for f in dataclasses.fields(Heartbeat)}
    return Heartbeat(**{k: v for k, v in raw.items() if k in names})
