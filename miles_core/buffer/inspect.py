"""`miles buffer inspect RUN_URI [--ids]`: what the durable buffer of a run holds, read-only.

    inspect_buffer(run_uri)   # counts: committed, consumed, rejected, available, quarantined, ...
    group_ids(run_uri)        # each group's id, status (consumed / rejected / available) and step

Reads every consumption manifest and every group object (nothing is moved, deleted or
quarantined; undecodable objects are counted under `undecodable_objects`, manifests that do not
parse are listed under `unreadable_manifests`: miles_core.buffer.manifests).
"""

from __future__ import annotations

import miles_core.buffer.objects as O
from miles_core.buffer.manifests import ConsumptionRecord, read_consumption
from miles_core.storage import ObjectNotFound, StorageError, Store


def inspect_buffer(run_uri: str) -> dict:
    """Counts of the buffer at `run_uri` (a run root, e.g. file:///x/.miles/runs/default).

    committed: groups in decodable objects; consumed / rejected: of those, recorded as trained or
    rejected at get by a manifest that parses; consumed_or_rejected_unattributed: of those, groups no
    readable manifest names but the compaction record covers (consumed or rejected at a step whose
    manifest does not parse); available: the rest (what a reopened buffer serves); unreadable_manifests:
    the manifests that do not parse ({"step", "key", "reason", "covered_by_compaction"}: the groups of
    one not covered count as available here, wrongly if they were trained); rebuilt_manifests: the steps
    whose manifest `miles doctor --repair` rebuilt from the compaction record (their groups count under
    consumed_or_rejected_unattributed); oldest_version /
    newest_version: over the available groups' token versions (None when unknown or none).
    """
    store = Store(run_uri)
    consumed, rejected, record = _fates(store)
    sizes = _object_sizes(store)
    committed, keys, undecodable = _committed(store, sizes)
    unattributed = _unattributed(committed, keys, consumed, rejected, record)
    available = [g for gid, g in committed.items()
                 if gid not in consumed and gid not in rejected and gid not in unattributed]
    oldest = [g.oldest_version for g in available if g.oldest_version is not None]
    newest = [g.newest_version for g in available if g.newest_version is not None]
    quarantine = [k for k in store.list(O.QUARANTINE) if not k.endswith(O.REASON_SUFFIX)]
    steps = [*record.manifests, *record.unreadable]
    return {
        "run_uri": store.root_uri,
        "objects": len(sizes),
        "bytes": sum(sizes.values()),
        "committed": len(committed),
        "consumed": sum(1 for gid in committed if gid in consumed),
        "rejected": sum(1 for gid in committed if gid in rejected and gid not in consumed),
        "consumed_or_rejected_unattributed": len(unattributed),
        "available": len(available),
        "quarantined": len(quarantine),
        "undecodable_objects": undecodable,
        "consumed_steps": len(steps),
        "last_consumed_step": max(steps) if steps else None,
        "unreadable_manifests": _unreadable_rows(store, record),
        "rebuilt_manifests": record.rebuilt_steps(),
        "compaction_error": record.compaction_error,
        "oldest_version": min(oldest) if oldest else None,
        "newest_version": max(newest) if newest else None,
    }


def group_ids(run_uri: str) -> list[dict]:
    """Every group of the buffer at `run_uri`: {"group_id", "status": consumed | rejected |
    consumed_or_rejected (at a step whose manifest does not parse) | available, "step": the step that
    consumed or rejected it (None when available or unknown), "stored": its object is still there};
    committed groups in commit order, then those only a manifest still names (their object deleted
    after consumption)."""
    store = Store(run_uri)
    consumed, rejected, record = _fates(store)
    committed, keys, _ = _committed(store, _object_sizes(store))
    unattributed = _unattributed(committed, keys, consumed, rejected, record)
    ids = [*committed, *sorted((consumed.keys() | rejected.keys()) - committed.keys())]
    return [_group_row(gid, consumed, rejected, gid in unattributed, gid in committed) for gid in ids]


def _group_row(gid: str, consumed: dict[str, int], rejected: dict[str, int], unattributed: bool,
               stored: bool) -> dict:
    if gid in consumed:
        return {"group_id": gid, "status": "consumed", "step": consumed[gid], "stored": stored}
    if gid in rejected:
        return {"group_id": gid, "status": "rejected", "step": rejected[gid], "stored": stored}
    if unattributed:
        return {"group_id": gid, "status": "consumed_or_rejected", "step": None, "stored": stored}
    return {"group_id": gid, "status": "available", "step": None, "stored": stored}


def _fates(store: Store) -> tuple[dict[str, int], dict[str, int], ConsumptionRecord]:
    """(consumed id -> step, rejected id -> step, the consumption record), from every manifest that parses."""
    record = read_consumption(store)
    consumed: dict[str, int] = {}
    rejected: dict[str, int] = {}
    for step, manifest in record.manifests.items():
        for gid in manifest.get("consumed", ()):
            consumed.setdefault(gid, step)
        for gid in manifest.get("rejected", ()):
            rejected.setdefault(gid, step)
    return consumed, rejected, record


def _unattributed(committed: dict[str, O.StoredGroup], keys: dict[str, str], consumed: dict, rejected: dict,
                  record: ConsumptionRecord) -> set[str]:
    """Committed groups no readable manifest names but the compaction record covers: consumed or
    rejected at a step whose manifest does not parse (or was deleted)."""
    return {gid for gid in committed if gid not in consumed and gid not in rejected
            and record.covered(gid, keys.get(gid))}


def _unreadable_rows(store: Store, record: ConsumptionRecord) -> list[dict]:
    through = -1 if record.compacted_through is None else record.compacted_through
    return [{"step": s, "key": store.uri(O.consumed_key(s)), "reason": why, "covered_by_compaction": s <= through}
            for s, why in record.unreadable.items()]


def _object_sizes(store: Store) -> dict[str, int]:
    return {k: v for k, v in store.list_sizes(O.GROUPS).items() if O.split_group_key(k) is not None}


def _committed(store: Store, sizes: dict[str, int]) -> tuple[dict[str, O.StoredGroup], dict[str, str], int]:
    """(group id -> its stored group, in commit order; group id -> its object key; how many objects
    did not decode)."""
    committed: dict[str, O.StoredGroup] = {}
    keys: dict[str, str] = {}
    undecodable = 0
    for key in sizes:
        try:
            for sg in O.decode_object(store.get_bytes(key), store.uri(key)):
                committed.setdefault(sg.group_id, sg)
                keys.setdefault(sg.group_id, key)
        except (ObjectNotFound, StorageError):
            raise
        except Exception:  # noqa: BLE001 - counted, the tool never crashes on a bad object
            undecodable += 1
    return committed, keys, undecodable
