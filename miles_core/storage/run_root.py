"""The run root's identity files: config.json (and one per resumed segment) and STATUS.json.

    store = Store(cfg.run_uri)
    segment = next_segment(store)                    # 0 for a new run, n for the n-th continuation
    write_config(store, cfg, segment)                # config.json, or config_segment_{n}.json
    write_status(store, RUNNING, last_step=-1, segment=segment)
    ...
    write_status(store, FINISHED, last_step=k, segment=segment)

STATUS.json is what watchers read (the eval follower stops when the state is no longer
`running`; the report shows it). States:
    running        a segment is training now
    segment_done   a segment ended cleanly (segment steps or deadline reached); the run continues later
    finished       the run reached --num-rollout steps
    failed         the segment failed; `message` says why
Every write is one atomic object PUT (Store.put_json), so a reader sees the old or the new file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass

from miles_core.storage import ObjectNotFound, StorageError, StorageUnavailable, Store
from miles_core.storage.status_rebuild import has_history, rebuilt_status

log = logging.getLogger(__name__)

RUNNING = "running"
SEGMENT_DONE = "segment_done"
FINISHED = "finished"
FAILED = "failed"
STATES = (RUNNING, SEGMENT_DONE, FINISHED, FAILED)

CONFIG_KEY = "config.json"
STATUS_KEY = "STATUS.json"


@dataclass(frozen=True)
class RunStatus:
    state: str
    last_step: int  # the last step trained and committed; -1 before the first
    segment: int
    updated_at: float
    message: str = ""

    @property
    def active(self) -> bool:
        return self.state == RUNNING


def segment_config_key(segment: int) -> str:
    return CONFIG_KEY if segment == 0 else f"config_segment_{segment:04d}.json"


def write_config(store: Store, cfg, segment: int = 0) -> str:
    """Write the resolved config (a RunConfig or its dict) for `segment`; returns the key.

    Segment 0 writes config.json; a resumed segment n writes config_segment_{n:04d}.json and
    leaves config.json as the record of how the run started.
    """
    if segment < 0:
        raise ValueError(f"segment must be >= 0, got {segment}")
    if not isinstance(cfg, dict):
        cfg = dataclasses.asdict(cfg)  # a RunConfig (a dataclass tree): the config's own dict form
    key = segment_config_key(segment)
    store.put_json(key, {"segment": segment, "written_at": time.time(), "config": cfg})
    return key


def read_config(store: Store, segment: int | None = None) -> dict | None:
    """The resolved config dict of `segment` (default: the latest segment with one), or None."""
    if segment is None:
        status = read_status(store)
        latest = status.segment if status is not None else 0
        # No listing: a run root also holds the buffer and checkpoints; STATUS names the segment.
        for seg in range(latest, -1, -1):
            found = get_json_or_none(store, segment_config_key(seg))
            if found is not None:
                return found.get("config", found)
        return None
    found = get_json_or_none(store, segment_config_key(segment))
    return None if found is None else found.get("config", found)


def require_first_config(store: Store) -> None:
    """Refuse to continue a run whose config.json is there but does not parse: a StorageError naming it and the
    fix. It records how the run started (the plan's estimate, `miles runs show`, lineage, fork and replay read
    it); a run root damaged so is repaired before more is written to it."""
    try:
        record = get_json_or_none(store, CONFIG_KEY)
        if record is None or isinstance(record, dict):
            return
        why = f"{store.uri(CONFIG_KEY)} is not a config record (a JSON object)"
    except StorageUnavailable:
        raise
    except StorageError as e:
        why = str(e)
    raise StorageError(
        f"{why[:500]}. config.json records how this run started; the run does not continue over a damaged one. "
        "Restore it from a backup (it is {\"segment\": 0, \"written_at\": ..., \"config\": {...}}: `miles validate` "
        f"with the run's flags prints the config), then run again; `miles doctor {store.root_uri}` checks the rest "
        "of the run root.")


def error_key(segment: int) -> str:
    """Where a failed segment's traceback is kept (the console and STATUS.json carry its one line)."""
    return f"errors/segment_{segment:04d}.txt"


def write_error(store: Store, segment: int, text: str) -> str:
    """Keep a failed segment's traceback in the run root; its URI."""
    store.put_bytes(error_key(segment), text.encode())
    return store.uri(error_key(segment))


def write_status(store: Store, state: str, *, last_step: int, segment: int, message: str = "") -> RunStatus:
    if state not in STATES:
        raise ValueError(f"unknown run state {state!r}; known: {', '.join(STATES)}")
    status = RunStatus(state, int(last_step), int(segment), time.time(), message)
    store.put_json(STATUS_KEY, dataclasses.asdict(status))
    return status


def read_status(store: Store) -> RunStatus | None:
    """STATUS.json, None when there is none in a run that never started a segment. One that does not parse
    (truncated, garbage), or is missing from a run with checkpoints or consumption manifests, is rebuilt
    from them (miles_core.storage.status_rebuild), with a warning: the run and every reader go on (the next
    segment numbers itself after the recorded ones, never over config.json); it writes a fresh one."""
    try:
        raw = store.get_bytes(STATUS_KEY)
    except ObjectNotFound:
        return _rebuilt_if_started(store)
    try:
        return parse_status(raw)
    except (ValueError, TypeError) as e:
        why = f"{store.uri(STATUS_KEY)} does not parse ({e})"
        status = RunStatus(**rebuilt_status(store, why))
        log.warning("%s; rebuilt: %s after step %d (segment %d)", why, status.state, status.last_step, status.segment)
        return status


def _rebuilt_if_started(store: Store) -> RunStatus | None:
    if not has_history(store):
        return None  # a new run
    why = f"{store.uri(STATUS_KEY)} is missing"
    status = RunStatus(**rebuilt_status(store, why))
    log.warning("%s; rebuilt: %s after step %d (segment %d)", why, status.state, status.last_step, status.segment)
    return status


def parse_status(raw: bytes) -> RunStatus:
    """STATUS.json's bytes as a RunStatus; ValueError or TypeError when they do not parse."""
    d = json.loads(raw)
    if not isinstance(d, dict) or not isinstance(d.get("state", ""), str):
        raise ValueError("not a STATUS object")
    return RunStatus(d.get("state", ""), int(d.get("last_step", -1)), int(d.get("segment", 0)),
                     float(d.get("updated_at", 0.0)), d.get("message") or "")


def next_segment(store: Store) -> int:
    """0 for a run that never started a segment, else the recorded (or rebuilt) segment + 1."""
    status = read_status(store)
    return 0 if status is None else status.segment + 1


class RunNotFound(ValueError):
    """A command was pointed at a run root that holds no run (a typo must not read as an empty run)."""


def require_run(store: Store) -> Store:
    """`store` if it holds a run (config.json, STATUS.json or a buffer), else RunNotFound naming it."""
    if store.exists(CONFIG_KEY) or store.exists(STATUS_KEY) or store.list("buffer/"):
        return store
    raise RunNotFound(f"no run at {store.uri()}: it has no {CONFIG_KEY}, {STATUS_KEY} or buffer/. A run root is "
                      "{storage_root}/runs/{run_id} (e.g. file:///path/.miles/runs/default).")


def get_json_or_none(store: Store, key: str):
    """The JSON object at `key`, or None when there is none."""
    try:
        return store.get_json(key)
    except ObjectNotFound:
        return None
