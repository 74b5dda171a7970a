"""The buffer's layout in the run root and its object codec (docs/quickstart.md#where-the-run-lives).

    buffer/groups/{writer}/{seq:012d}.arrow      Arrow IPC stream of SAMPLE_SCHEMA record batches,
                                                 one batch per group; immutable once committed
    buffer/consumed/{step:08d}.json              {"step", "consumed": [ids], "rejected": [ids],
                                                 "objects_done": [keys]} for training step `step`
    buffer/compacted/upto_{step:08d}.json        the compaction of every manifest through `step` (written
                                                 at a checkpoint): {"through_step", "objects_done":
                                                 {writer: [[first_seq, last_seq], ...]}, "consumed": [ids
                                                 consumed or rejected in objects not yet done],
                                                 "trained_positions": {epoch: [[first, last], ...]}: the
                                                 data-source prompts consumed, so a copy of a consumed group
                                                 is never served again}
    buffer/quarantine/{writer}/{seq}.arrow       an object that failed to decode, moved aside,
    buffer/quarantine/{writer}/{seq}.arrow.reason.json   with the reason

An object is the same format `samples.groups_to_ipc` writes (an IPC stream with the versioned
sample schema) and `samples.ipc_to_groups` reads; the writer emits one record batch per group so
the reader can keep each group's rows as a compact Arrow slice without regrouping. No pickle.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa

from miles_core.samples import SAMPLE_SCHEMA, Group, SchemaError, batch_to_groups
from miles_core.storage import ObjectNotFound, StorageError, Store

log = logging.getLogger(__name__)

GROUPS = "buffer/groups/"
CONSUMED = "buffer/consumed/"
COMPACTED = "buffer/compacted/"
QUARANTINE = "buffer/quarantine/"
REASON_SUFFIX = ".reason.json"


def new_writer_id() -> str:
    """Unique per buffer instance; starts with the wall time in ms so keys of later segments sort later."""
    return f"w{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"


def group_key(writer: str, seq: int) -> str:
    return f"{GROUPS}{writer}/{seq:012d}.arrow"


def writer_of(key: str) -> str:
    """The writer of a group object key ("" for another key)."""
    parsed = split_group_key(key)
    return parsed[0] if parsed is not None else ""


def prompt_of_id(group_id: str) -> tuple[int, int, int] | None:
    """(epoch, position, attempt) from a data-source group id `e{epoch}-p{position}-a{attempt}[-{holder}]`;
    None for another id."""
    parts = group_id.split("-")
    if len(parts) < 3 or [p[:1] for p in parts[:3]] != ["e", "p", "a"]:
        return None
    nums = [p[1:] for p in parts[:3]]
    return tuple(int(n) for n in nums) if all(n.isdigit() for n in nums) else None


TRAINER_HOLDER = "trainer"  # the prompt-claim holder of the run's own rollout (producer jobs hold by their id)


def holder_of_id(group_id: str) -> str:
    """Who generated a data-source group, from its id `e{epoch}-p{position}-a{attempt}-{holder}`: a producer
    job's id, or TRAINER_HOLDER; "" for an id without a holder (a run that never allowed producers)."""
    if prompt_of_id(group_id) is None:
        return ""
    return group_id.split("-", 3)[3] if group_id.count("-") >= 3 else ""


def from_producer(group_id: str) -> bool:
    """Whether a producer job (not the run's own rollout) generated the group with this id."""
    return holder_of_id(group_id) not in ("", TRAINER_HOLDER)


def consumed_key(step: int) -> str:
    return f"{CONSUMED}{step:08d}.json"


def consumed_step(key: str) -> int | None:
    """The step of a consumption manifest key, None for a key that is not one."""
    name = key.rsplit("/", 1)[-1]
    stem, dot, ext = name.partition(".")
    if ext != "json" or not stem.isdigit():
        return None
    return int(stem)


def compact_key(step: int) -> str:
    return f"{COMPACTED}upto_{step:08d}.json"


def compact_step(key: str) -> int | None:
    """The step of a compaction key, None for a key that is not one."""
    name = key.rsplit("/", 1)[-1]
    digits = name[len("upto_"):-len(".json")]
    if not (name.startswith("upto_") and name.endswith(".json") and digits.isdigit()):
        return None
    return int(digits)


def split_group_key(key: str) -> tuple[str, int] | None:
    """(writer, seq) of a group object key, None for another key."""
    writer, _, name = key[len(GROUPS):].partition("/")
    stem = name[: -len(".arrow")]
    if not (key.startswith(GROUPS) and name.endswith(".arrow") and stem.isdigit() and writer):
        return None
    return writer, int(stem)


def to_ranges(seqs: set[int]) -> list[list[int]]:
    """Sorted integers as closed runs: {1, 2, 3, 7} -> [[1, 3], [7, 7]]."""
    runs: list[list[int]] = []
    for n in sorted(seqs):
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return runs


def from_ranges(runs: list[list[int]]) -> set[int]:
    return {n for lo, hi in runs for n in range(lo, hi + 1)}


def quarantine_key(key: str) -> str:
    return QUARANTINE + key[len(GROUPS):] if key.startswith(GROUPS) else QUARANTINE + key.replace("/", "_")


def encode_object(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SAMPLE_SCHEMA) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


@dataclass(slots=True)
class StoredGroup:
    """One group decoded from an object: its metadata, and its rows as a compact Arrow batch."""

    group_id: str
    prompt_index: int
    oldest_version: int | None
    newest_version: int | None
    position: tuple[int, int] | None
    rows: pa.RecordBatch


def decode_object(data: bytes, source: str) -> list[StoredGroup]:
    """Every group of an object, fully validated (schema, statuses, rows); SchemaError if undecodable."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise SchemaError(f"{source}: not a readable Arrow IPC stream ({e})") from e
    out: list[StoredGroup] = []
    for batch in batches:
        try:
            groups = batch_to_groups(batch, source)
        except SchemaError:
            raise
        except Exception as e:  # noqa: BLE001 - any bad value in a row makes the object undecodable
            raise SchemaError(f"{source}: undecodable rows ({type(e).__name__}: {e})") from e
        ids = batch.column("group_id").to_pylist() if len(groups) > 1 else None
        for g in groups:
            rows = batch if ids is None else batch.take(pa.array([i for i, x in enumerate(ids) if x == g.group_id]))
            out.append(describe(g, rows))
    return out


def fetch_object(store: Store, key: str) -> "list[StoredGroup] | SchemaError | None":
    """An object's groups; None when it vanished; the decode error (a SchemaError naming the key) when it
    does not decode. Storage errors propagate: a store that cannot be read says nothing of the object."""
    try:
        return decode_object(store.get_bytes(key), store.uri(key))
    except ObjectNotFound:
        return None
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - any decode failure quarantines, never crashes a reader
        return e if isinstance(e, SchemaError) else SchemaError(f"{key}: {type(e).__name__}: {e}")


def describe(group: Group, rows: pa.RecordBatch | None) -> StoredGroup:
    versions = [v for s in group.samples for v in s.token_versions]
    return StoredGroup(group.group_id, group.prompt_index, min(versions) if versions else None,
                       max(versions) if versions else None, position_of(group), rows)


def position_of(group: Group) -> tuple[int, int] | None:
    """(epoch, position) of the data source that produced the group, from the first sample's metadata."""
    for s in group.samples[:1]:
        try:
            meta = json.loads(s.metadata or "{}")
        except ValueError:
            return None
        if isinstance(meta, dict) and isinstance(meta.get("epoch"), int) and isinstance(meta.get("position"), int):
            return (meta["epoch"], meta["position"])
    return None


def committed_positions(store: Store, writer: str) -> set[tuple[int, int]]:
    """(epoch, position) of every data-source group that buffer writer `writer` committed in the run root
    `store` (its objects under buffer/groups/{writer}/): what a writer taking over a prompt claim block
    from it must not generate again. An object that does not decode is skipped with a warning (its groups
    are never read by the trainer either). Objects deleted after consumption are not seen."""
    return CommittedPositions(store)(writer)


class CommittedPositions:
    """`committed_positions` that remembers what it read: each call decodes only the writer's objects
    committed since the last call (a writer taking over several blocks of one dead writer reads its
    objects once)."""

    def __init__(self, store: Store):
        self.store = store
        self._read: dict[str, set[str]] = {}
        self._positions: dict[str, set[tuple[int, int]]] = {}

    def __call__(self, writer: str) -> set[tuple[int, int]]:
        read, out = self._read.setdefault(writer, set()), self._positions.setdefault(writer, set())
        for key in self.store.list(f"{GROUPS}{writer}/"):
            if key in read or split_group_key(key) is None:
                continue
            try:
                groups = decode_object(self.store.get_bytes(key), key)
            except (SchemaError, ObjectNotFound) as e:
                log.warning("committed positions of writer %s: skipping %s (%s)", writer, key, str(e)[:300])
                continue
            read.add(key)
            out.update(g.position for g in groups if g.position is not None)
        return set(out)


def rows_to_group(rows: pa.RecordBatch) -> Group:
    return batch_to_groups(rows, "buffered group")[0]


def quarantine_reason(key: str, error: BaseException) -> dict:
    return {"source": key, "reason": f"{type(error).__name__}: {error}"[:2000], "at": time.time(), "pid": os.getpid()}
