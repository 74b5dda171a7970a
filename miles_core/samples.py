"""Samples and prompt groups, and their Arrow schema (docs/data-path.md).

One row per sample; a record batch holds one or more whole groups. The schema carries its
version in the schema metadata (`miles.schema_version`, "MAJOR.MINOR"); readers accept any minor
of a known major and reject an unknown major or a missing column with SchemaError. No pickle.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

import pyarrow as pa

SCHEMA_VERSION = "1.1"  # 1.1 added routed_experts
SCHEMA_VERSION_KEY = b"miles.schema_version"
SUPPORTED_MAJORS = {1}


class SampleStatus(str, Enum):
    PENDING = "pending"  # in memory only, never stored
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class SchemaError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class Sample:
    group_id: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: str = ""
    label: str = ""  # JSON
    metadata: str = "{}"  # JSON
    created_at: float = field(default_factory=time.time)
    generation_seconds: float = 0.0
    # A MoE model's routing as the engine ran it (--use-rollout-routing-replay): the expert ids of
    # each token position it ran, [positions, MoE layers, top-k] flattened (int32); [] otherwise
    routed_experts: list[int] = field(default_factory=list)

    @property
    def oldest_version(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None

    @property
    def mixed_version(self) -> bool:
        return bool(self.token_versions) and max(self.token_versions) != min(self.token_versions)

    def cleared(self, group_id: str) -> "Sample":
        """The same prompt, generated fields cleared (for a retry under a new group id)."""
        return Sample(group_id=group_id, prompt_index=self.prompt_index, sample_index=self.sample_index,
                      prompt_ids=list(self.prompt_ids), label=self.label, metadata=self.metadata)


@dataclass
class Group:
    group_id: str
    prompt_index: int
    samples: list[Sample]

    @property
    def aborted(self) -> bool:
        return any(s.status == SampleStatus.ABORTED for s in self.samples)

    @property
    def oldest_version(self) -> int | None:
        versions = [v for s in self.samples for v in s.token_versions]
        return min(versions) if versions else None

    def staleness(self, current_version: int | None) -> int | None:
        """current − oldest token version; None (unknown = not stale) when either is unknown."""
        oldest = self.oldest_version
        if current_version is None or oldest is None:
            return None
        return max(0, current_version - oldest)


SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=True),
        pa.field("status", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("label", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
        pa.field("created_at", pa.float64(), nullable=False),
        pa.field("generation_seconds", pa.float32(), nullable=False),
        pa.field("routed_experts", pa.list_(pa.int32()), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)
COLUMNS = [f.name for f in SAMPLE_SCHEMA]
# Columns a minor version added: a batch of an older minor lacks them and reads them as their default
ADDED_COLUMNS = {"routed_experts": list}


def groups_to_batch(groups: Iterable[Group]) -> pa.RecordBatch:
    rows = [s for g in groups for s in g.samples]
    for s in rows:
        if s.status == SampleStatus.PENDING:
            raise SchemaError(f"sample {s.group_id}/{s.sample_index} is still pending; only finished samples are stored")
    cols = {name: [] for name in COLUMNS}
    for s in rows:
        for name in COLUMNS:
            v = getattr(s, name)
            cols[name].append(v.value if isinstance(v, SampleStatus) else v)
    return pa.RecordBatch.from_pydict(cols, schema=SAMPLE_SCHEMA)


def check_schema(schema: pa.Schema, source: str = "record batch") -> None:
    meta = schema.metadata or {}
    raw = meta.get(SCHEMA_VERSION_KEY)
    if raw is None:
        raise SchemaError(f"{source}: no {SCHEMA_VERSION_KEY.decode()} in the Arrow schema metadata; not a miles sample batch")
    version = raw.decode(errors="replace")
    try:
        major = int(version.split(".")[0])
    except ValueError as e:
        raise SchemaError(f"{source}: unreadable schema version {version!r}") from e
    if major not in SUPPORTED_MAJORS:
        raise SchemaError(f"{source}: schema version {version} has unknown major {major}; this reader "
                          f"supports {sorted(SUPPORTED_MAJORS)} (upgrade miles-flyte to read it)")
    missing = [c for c in COLUMNS if c not in schema.names and c not in ADDED_COLUMNS]
    if missing:
        raise SchemaError(f"{source}: missing column(s) {missing} (schema version {version})")
    # A minor version may add columns, never retype one: a retyped column would decode into wrong Samples.
    wrong = [f"{f.name}: {schema.field(f.name).type} (expected {f.type})" for f in SAMPLE_SCHEMA
             if f.name in schema.names and not schema.field(f.name).type.equals(f.type)]
    if wrong:
        raise SchemaError(f"{source}: wrong column type(s) {'; '.join(wrong)} (schema version {version})")


def batch_to_groups(batch: pa.RecordBatch | pa.Table, source: str = "record batch") -> list[Group]:
    check_schema(batch.schema, source)
    present = [name for name in COLUMNS if name in batch.schema.names]
    data = {name: batch.column(name).to_pylist() for name in present}
    groups: dict[str, Group] = {}
    for i in range(batch.num_rows):
        row = {name: data[name][i] for name in present}
        try:
            row["status"] = SampleStatus(row["status"])
        except ValueError as e:
            raise SchemaError(f"{source}: row {i}: unknown status {row['status']!r}") from e
        s = Sample(**row)
        g = groups.get(s.group_id)
        if g is None:
            g = groups[s.group_id] = Group(s.group_id, s.prompt_index, [])
        g.samples.append(s)
    for g in groups.values():
        g.samples.sort(key=lambda s: s.sample_index)
    return list(groups.values())


def groups_to_ipc(groups: Iterable[Group]) -> bytes:
    """Groups -> Arrow IPC stream bytes (one record batch): the buffer's object format."""
    batch = groups_to_batch(groups)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


def ipc_to_groups(data: bytes, source: str = "object") -> list[Group]:
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise SchemaError(f"{source}: not a readable Arrow IPC stream ({e})") from e
    return batch_to_groups(table, source)
