"""The engine fleet as a registry in the run root (`engines/`): the size asked for and what runs.

    change_target(store, +2, current=1)     # `miles engines add RUN 2`: engines/target.json {"count": 3, ...}
    read_target(store)                      # 3; None while nobody asked for a size
    write_fleet(store, record)              # the driver, after each change: engines/fleet.json
    read_fleet(store)                       # {"engines": [{"name", "url", "state", "since", ...}], "target", ...}

`--rollout-num-engines` is the fleet's starting size; the target, once written, is the size the
driver moves the fleet to while the run goes on (miles_core.driver.fleet_reconciler), in this and
later segments. Anyone may write the target (the `miles engines` command, an autoscaler's hook);
only the driver writes fleet.json. A change is a compare-and-swap on target.json
(miles_core.storage.conditional), so two `add`s at once both count.
"""

from __future__ import annotations

import json
import time
import uuid

from miles_core.storage import Store
from miles_core.storage.conditional import conditional_object
from miles_core.storage.run_root import get_json_or_none

TARGET_KEY = "engines/target.json"
FLEET_KEY = "engines/fleet.json"
_CAS_TRIES = 20


class EngineTargetError(ValueError):
    """A fleet size that cannot be asked for (below 0), or a target.json that is not a size."""

    def __init__(self, message: str):
        super().__init__(message)


def read_target(store: Store) -> int | None:
    """The target engine count, or None when there is no target.json (EngineTargetError when it holds no count)."""
    record = get_json_or_none(store, TARGET_KEY)
    return None if record is None else _count(record, store)


def write_target(store: Store, count: int, by: str = "") -> int:
    """Set the target to `count` (>= 0), whatever it was."""
    if count < 0:
        raise EngineTargetError(f"an engine count must be >= 0, got {count}")
    store.put_bytes(TARGET_KEY, _record(count, by))
    return count


def change_target(store: Store, delta: int, current: int, by: str = "", minimum: int = 0, why: str = "") -> int:
    """The target plus `delta` (`current` when there is no target yet); returns the new count.
    EngineTargetError, naming the count, when it would go below `minimum` (`why` says why it is that)."""
    obj = conditional_object(store, TARGET_KEY)
    for _ in range(_CAS_TRIES):
        found = obj.read()
        base = current if found is None else _count(json.loads(found[0]), store)
        count = base + delta
        if count < max(0, minimum):
            raise EngineTargetError(f"cannot remove {-delta} engine(s): the target of {store.uri()} is {base}"
                                    + (f", and {why}" if why else ""))
        data = _record(count, by)
        if (obj.create(data) if found is None else obj.replace(data, found[1])) is not None:
            return count
    raise EngineTargetError(f"{store.uri(TARGET_KEY)} kept changing under {_CAS_TRIES} tries; try again")


def read_fleet(store: Store) -> dict | None:
    """What the driver last recorded running (engines/fleet.json), or None."""
    return get_json_or_none(store, FLEET_KEY)


def write_fleet(store: Store, record: dict) -> None:
    store.put_json(FLEET_KEY, {**record, "updated_at": time.time()})


def _record(count: int, by: str) -> bytes:
    """The target record; `request` makes every write unique (the compare-and-swap compares content)."""
    return json.dumps({"count": int(count), "requested_at": time.time(), "by": by,
                       "request": uuid.uuid4().hex}).encode()


def _count(record, store: Store) -> int:
    count = record.get("count") if isinstance(record, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise EngineTargetError(f"{store.uri(TARGET_KEY)} holds no engine count >= 0: {record!r}; write one with "
                                "`miles engines add|remove RUN_URI N`")
    return count
