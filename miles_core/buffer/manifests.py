"""The consumption record of a run root, read defensively by the tools that only read it.

    record = read_consumption(store)     # `miles runs show`, `miles buffer inspect`, `miles lineage`
    record.manifests                     # step -> manifest, for every manifest that parses
    record.unreadable                    # step -> why its manifest does not parse (truncated, empty, ...)
    record.covered(group_id, key)        # consumed or rejected through the compaction step

A manifest that does not parse cannot be rebuilt exactly: the compaction record
(buffer/compacted/upto_{step}.json) holds what was consumed or rejected through its step as one set
(whole objects as seq ranges, single ids for the rest), not per step, not which groups were trained
and which rejected, nor the training order. So a reader skips a bad manifest with a warning and says
so instead of counting wrong: a group the compaction covers but no readable manifest names is
"consumed or rejected at an unreadable step"; the groups of a bad manifest after the compaction step
are unknown. Readers never write (a bad manifest is left where it is, for the user to restore).
A resume refuses a bad manifest after the compaction step (miles_core.buffer.durable), since
treating its groups as unconsumed would train them twice.

`miles doctor --repair` (miles_core.lineage.doctor) rebuilds a bad manifest the compaction covers when
its groups can be told exactly: it is the only covered step without a readable manifest and every
object the compaction counts as done is still stored, so its groups are what the compaction covers
less what the other manifests name. Which of them were trained and which rejected, and their order,
are not recorded anywhere, so the rebuilt manifest lists them under REBUILT_IDS (`consumed` and
`rejected` empty): a resume counts them as taken, `runs show` and `lineage` as "consumed or rejected at
step k", fork and replay through that step refuse.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property

import miles_core.buffer.objects as O
from miles_core.storage import ObjectNotFound, Store

log = logging.getLogger(__name__)

READ_THREADS = 16  # object-store latency, not CPU, bounds reading many small manifests
REBUILT_IDS = "consumed_or_rejected"  # a rebuilt manifest's groups: consumed or rejected at its step, not which


class BadManifest(ValueError):
    """A consumption manifest (or compaction record) that exists but does not parse."""


@dataclass(frozen=True)
class ConsumptionRecord:
    manifests: dict[int, dict]  # step -> manifest, step order
    unreadable: dict[int, str] = field(default_factory=dict)  # step -> why it does not parse
    compacted_through: int | None = None  # the newest readable compaction record's step
    compacted_ids: frozenset[str] = frozenset()
    compacted_done: dict[str, set[int]] = field(default_factory=dict)  # writer -> seqs of objects done
    compaction_error: str = ""  # why the newest compaction record does not parse, "" when it does
    compaction_deleted_objects: bool = False  # the newest compaction deleted the objects consumed through it

    @cached_property
    def rebuilt(self) -> dict[str, int]:
        """group id -> step, for the groups of manifests rebuilt from the compaction record (REBUILT_IDS)."""
        return {gid: step for step, m in self.manifests.items() for gid in m.get(REBUILT_IDS, ())}

    def rebuilt_steps(self) -> list[int]:
        return [step for step, m in self.manifests.items() if REBUILT_IDS in m]

    def covered(self, group_id: str, key: str | None) -> bool:
        """Whether the compaction record says the group (in object `key`) was consumed or rejected."""
        if group_id in self.rebuilt:
            return True
        if self.compacted_through is None:
            return False
        parsed = O.split_group_key(key) if key else None
        return group_id in self.compacted_ids or (
            parsed is not None and parsed[1] in self.compacted_done.get(parsed[0], ()))

    def unreadable_covered(self) -> list[int]:
        """Unreadable steps the compaction covers (their groups count as consumed or rejected)."""
        through = -1 if self.compacted_through is None else self.compacted_through
        return [s for s in self.unreadable if s <= through]

    def unreadable_after(self) -> list[int]:
        """Unreadable steps after the compaction (their groups are unknown: shown as available)."""
        through = -1 if self.compacted_through is None else self.compacted_through
        return [s for s in self.unreadable if s > through]


def parse_manifest(data: bytes, source: str) -> dict:
    """A consumption manifest from its bytes; BadManifest naming `source` when it does not parse."""
    try:
        manifest = json.loads(data)
    except ValueError as e:  # truncated, empty, garbage, not UTF-8
        raise BadManifest(f"{source} is not valid JSON ({len(data)} bytes: {e})") from e
    lists = ("consumed", "rejected", "objects_done", REBUILT_IDS)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("consumed"), list) or any(
            not isinstance(manifest.get(k, []), list) for k in lists):
        raise BadManifest(f"{source} is not a consumption manifest (expected an object with a 'consumed' list)")
    return manifest


def read_consumption(store: Store) -> ConsumptionRecord:
    """Every consumption manifest of the run root (read in parallel) and its newest compaction record."""
    steps = sorted(s for k in store.list(O.CONSUMED) if (s := O.consumed_step(k)) is not None)
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="manifest-read") as pool:
        got = list(pool.map(lambda s: _read_one(store, O.consumed_key(s)), steps))
    manifests = {s: m for s, m in zip(steps, got) if isinstance(m, dict)}
    unreadable = {s: m for s, m in zip(steps, got) if isinstance(m, str)}
    for step, why in unreadable.items():
        log.warning("consumption manifest of step %d skipped: %s", step, why)
    return ConsumptionRecord(manifests, unreadable, **_compaction(store))


def _read_one(store: Store, key: str) -> dict | str | None:
    """The manifest; why it does not parse; None when it vanished since the listing."""
    try:
        return parse_manifest(store.get_bytes(key), store.uri(key))
    except ObjectNotFound:
        return None
    except BadManifest as e:
        return str(e)


def _compaction(store: Store) -> dict:
    """The fields of the newest compaction record; its error instead when it does not parse."""
    compacted = sorted(s for k in store.list(O.COMPACTED) if (s := O.compact_step(k)) is not None)
    if not compacted:
        return {}
    key = O.compact_key(compacted[-1])
    try:
        record = json.loads(store.get_bytes(key))
        done = {w: O.from_ranges(runs) for w, runs in record.get("objects_done", {}).items()}
        return {"compacted_through": compacted[-1], "compacted_ids": frozenset(record.get("consumed", ())),
                "compacted_done": done, "compaction_deleted_objects": bool(record.get("deleted_consumed_objects"))}
    except ObjectNotFound:
        return {}
    except (ValueError, TypeError, AttributeError) as e:
        log.warning("compaction record %s skipped: does not parse (%s)", store.uri(key), e)
        return {"compaction_error": f"{store.uri(key)} does not parse ({e})"}
