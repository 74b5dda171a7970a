"""`miles buffer inspect RUN_URI [--ids]`: what the durable buffer of a run holds, read-only.

    inspect_buffer(run_uri)   # counts: committed, consumed, rejected, available, quarantined, ...
    group_ids(run_uri)        # each group's id, status (consumed / rejected / available) and step

Reads every consumption manifest and every group object (nothing is moved, deleted or
quarantined; undecodable objects are counted under `undecodable_objects`).
"""

from __future__ import annotations

import miles_core.buffer.objects as O
from miles_core.storage import ObjectNotFound, StorageError, Store


def inspect_buffer(run_uri: str) -> dict:
    """Counts of the buffer at `run_uri` (a run root, e.g. file:///x/.miles/runs/default).

    committed: groups in decodable objects; consumed / rejected: of those, recorded as trained or
    rejected at get; available: the rest (what a reopened buffer serves); oldest_version /
    newest_version: over the available groups' token versions (None when unknown or none).
    """
    store = Store(run_uri)
    consumed, rejected, steps = _fates(store)
    sizes = _object_sizes(store)
    committed, undecodable = _committed(store, sizes)
    available = [g for gid, g in committed.items() if gid not in consumed and gid not in rejected]
    oldest = [g.oldest_version for g in available if g.oldest_version is not None]
    newest = [g.newest_version for g in available if g.newest_version is not None]
    quarantine = [k for k in store.list(O.QUARANTINE) if not k.endswith(O.REASON_SUFFIX)]
    return {
        "run_uri": store.root_uri,
        "objects": len(sizes),
        "bytes": sum(sizes.values()),
        "committed": len(committed),
        "consumed": sum(1 for gid in committed if gid in consumed),
        "rejected": sum(1 for gid in committed if gid in rejected and gid not in consumed),
        "available": len(available),
        "quarantined": len(quarantine),
        "undecodable_objects": undecodable,
        "consumed_steps": len(steps),
        "last_consumed_step": max(steps) if steps else None,
        "oldest_version": min(oldest) if oldest else None,
        "newest_version": max(newest) if newest else None,
    }


def group_ids(run_uri: str) -> list[dict]:
    """Every group of the buffer at `run_uri`: {"group_id", "status": consumed | rejected | available,
    "step": the step that consumed or rejected it (None when available), "stored": its object is
    still there}; committed groups in commit order, then those only a manifest still names (their
    object deleted after consumption)."""
    store = Store(run_uri)
    consumed, rejected, _ = _fates(store)
    committed, _ = _committed(store, _object_sizes(store))
    ids = [*committed, *sorted((consumed.keys() | rejected.keys()) - committed.keys())]
    return [_group_row(gid, consumed, rejected, gid in committed) for gid in ids]


def _group_row(gid: str, consumed: dict[str, int], rejected: dict[str, int], stored: bool) -> dict:
    if gid in consumed:
        return {"group_id": gid, "status": "consumed", "step": consumed[gid], "stored": stored}
    if gid in rejected:
        return {"group_id": gid, "status": "rejected", "step": rejected[gid], "stored": stored}
    return {"group_id": gid, "status": "available", "step": None, "stored": stored}


def _fates(store: Store) -> tuple[dict[str, int], dict[str, int], list[int]]:
    """(consumed id -> step, rejected id -> step, the steps with a manifest), from every manifest."""
    consumed: dict[str, int] = {}
    rejected: dict[str, int] = {}
    steps: list[int] = []
    for key in store.list(O.CONSUMED):
        step = O.consumed_step(key)
        if step is None:
            continue
        try:
            manifest = store.get_json(key)
        except (ObjectNotFound, StorageError):
            continue
        if isinstance(manifest, dict):
            steps.append(step)
            for gid in manifest.get("consumed", ()):
                consumed.setdefault(gid, step)
            for gid in manifest.get("rejected", ()):
                rejected.setdefault(gid, step)
    return consumed, rejected, steps


def _object_sizes(store: Store) -> dict[str, int]:
    return {k: v for k, v in store.list_sizes(O.GROUPS).items() if k.endswith(".arrow")}


def _committed(store: Store, sizes: dict[str, int]) -> tuple[dict[str, O.StoredGroup], int]:
    """(group id -> its stored group, in commit order; how many objects did not decode)."""
    committed: dict[str, O.StoredGroup] = {}
    undecodable = 0
    for key in sizes:
        try:
            for sg in O.decode_object(store.get_bytes(key), store.uri(key)):
                committed.setdefault(sg.group_id, sg)
        except (ObjectNotFound, StorageError):
            raise
        except Exception:  # noqa: BLE001 - counted, the tool never crashes on a bad object
            undecodable += 1
    return committed, undecodable
