"""Samples, groups and their versioned Arrow schema (docs/data-path.md).

Round trips are property tests over every column (nullable reward, unicode JSON strings, empty
responses, several groups per batch). Readers must answer every malformed input with SchemaError
naming the source: an unknown major version, a missing column, a wrong column type, garbage bytes.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_core.samples import (
    COLUMNS,
    SAMPLE_SCHEMA,
    SCHEMA_VERSION_KEY,
    Group,
    Sample,
    SampleStatus,
    SchemaError,
    groups_to_batch,
    groups_to_ipc,
    ipc_to_groups,
)

STORED_STATUSES = [s for s in SampleStatus if s is not SampleStatus.PENDING]
F32 = st.floats(width=32, allow_nan=False)
I32 = st.integers(-(2**31), 2**31 - 1)
UNICODE = st.text(max_size=12)  # hypothesis text(): any code point but surrogates (not valid UTF-8)
JSON_TEXT = st.recursive(
    st.none() | st.booleans() | st.integers() | UNICODE,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(UNICODE, inner, max_size=3),
    max_leaves=6,
).map(lambda v: json.dumps(v, ensure_ascii=False))


@st.composite
def samples_of(draw, group_id: str, prompt_index: int, n: int) -> list[Sample]:
    prompt = draw(st.lists(I32, max_size=6))
    out = []
    for i in range(n):
        length = draw(st.integers(0, 6))  # 0: an empty response (aborted before the first token)
        out.append(Sample(
            group_id=group_id, prompt_index=prompt_index, sample_index=i, prompt_ids=list(prompt),
            response_ids=draw(st.lists(I32, min_size=length, max_size=length)),
            response_logprobs=draw(st.lists(F32, min_size=length, max_size=length)),
            loss_mask=draw(st.lists(st.integers(-128, 127), min_size=length, max_size=length)),
            token_versions=draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length)),
            reward=draw(st.none() | F32),
            status=draw(st.sampled_from(STORED_STATUSES)),
            finish_reason=draw(UNICODE), label=draw(JSON_TEXT), metadata=draw(JSON_TEXT),
            created_at=draw(st.floats(allow_nan=False, allow_infinity=False)),
            generation_seconds=draw(st.floats(0, 1e6, width=32)),
        ))
    return out


@st.composite
def group_lists(draw, max_groups: int = 4) -> list[Group]:
    count = draw(st.integers(0, max_groups))
    ids = draw(st.lists(UNICODE.filter(bool), min_size=count, max_size=count, unique=True))
    groups = []
    for gid in ids:
        prompt_index = draw(st.integers(0, 2**62))
        groups.append(Group(gid, prompt_index, draw(samples_of(gid, prompt_index, draw(st.integers(1, 4))))))
    return groups


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_lists())
def test_ipc_round_trip_all_columns(groups):
    """Pins: groups -> IPC bytes -> groups is the identity on every column, group order and sample order,
    including a null reward, unicode label/metadata, empty responses and zero groups.
    Guards: a column dropped or re-typed in the buffer's object format (docs/data-path.md)."""
    assert ipc_to_groups(groups_to_ipc(groups), "test") == groups


@settings(max_examples=30, deadline=None)
@given(group_lists(max_groups=3))
def test_round_trip_keeps_derived_values(groups):
    """Pins: oldest_version / mixed_version / staleness are derived (not stored) and survive a round trip.
    Guards: storing a derived value that then disagrees with token_versions."""
    back = ipc_to_groups(groups_to_ipc(groups))
    for g, b in zip(groups, back):
        assert b.oldest_version == g.oldest_version and b.staleness(10**10) == g.staleness(10**10)
        assert [s.mixed_version for s in b.samples] == [s.mixed_version for s in g.samples]
    assert set(SAMPLE_SCHEMA.names) == set(COLUMNS)


def _sample(**kw) -> Sample:
    base = dict(group_id="g0", prompt_index=5, sample_index=0, prompt_ids=[1, 2], response_ids=[3],
                response_logprobs=[-0.5], loss_mask=[1], token_versions=[2], reward=1.0,
                status=SampleStatus.COMPLETED)
    return Sample(**(base | kw))


def _ipc_of(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _stored_table() -> pa.Table:
    return pa.Table.from_batches([groups_to_batch([Group("g0", 5, [_sample()])])])


def _with_version(table: pa.Table, version: str) -> pa.Table:
    return table.replace_schema_metadata({SCHEMA_VERSION_KEY: version.encode()})


def test_schema_carries_version():
    """Pins: the written stream carries miles.schema_version in the Arrow schema metadata.
    Guards: objects written without a version, which no future reader could classify."""
    schema = pa.ipc.open_stream(groups_to_ipc([Group("g0", 5, [_sample()])])).schema
    assert schema.metadata[SCHEMA_VERSION_KEY].startswith(b"1.")


def test_unknown_major_version_rejected():
    """Pins: an unknown major version is a SchemaError naming the source, the version and what to do.
    Guards: a newer writer's objects being misread by an older reader."""
    data = _ipc_of(_with_version(_stored_table(), "2.0"))
    with pytest.raises(SchemaError) as info:
        ipc_to_groups(data, "s3://b/run/buffer/groups/w0/000001.arrow")
    message = str(info.value)
    assert "000001.arrow" in message and "2.0" in message and "major" in message and "upgrade" in message


def test_minor_version_bump_accepted_extra_columns_ignored():
    """Pins: a newer minor version of the same major (which may add columns) is read; the extra column
    is ignored. Guards: a reader that rejects forward-compatible additions and quarantines good data."""
    table = _stored_table().append_column("new_in_1_3", pa.array(["x"]))
    groups = ipc_to_groups(_ipc_of(_with_version(table, "1.3")))
    assert groups == [Group("g0", 5, [_sample(created_at=groups[0].samples[0].created_at)])]


@pytest.mark.parametrize("column", ["reward", "token_versions", "group_id", "status"])
def test_missing_column_rejected(column):
    """Pins: a missing column is a SchemaError naming the column and the source.
    Guards: a KeyError deep in the trainer instead of a quarantine with a reason (§6.2)."""
    table = _stored_table()
    table = table.drop_columns([column])
    with pytest.raises(SchemaError, match=f"missing column.*{column}") as info:
        ipc_to_groups(_ipc_of(_with_version(table, "1.0")), "obj-7")
    assert "obj-7" in str(info.value)


def test_wrong_column_type_rejected():
    """Pins: a column of the wrong type (prompt_index as string) is a SchemaError naming the column.
    Guards: a batch that decodes into Samples with strings where ints belong, failing later in training."""
    table = _stored_table()
    i = table.schema.get_field_index("prompt_index")
    table = table.set_column(i, "prompt_index", pa.array(["5"]))
    with pytest.raises(SchemaError, match="prompt_index"):
        ipc_to_groups(_ipc_of(_with_version(table, "1.0")), "obj")


def test_missing_version_rejected():
    """Pins: an Arrow stream without the version key is refused as 'not a miles sample batch'.
    Guards: arbitrary Arrow files in buffer/groups/ being read as samples."""
    table = _stored_table().replace_schema_metadata({})
    with pytest.raises(SchemaError, match="not a miles sample batch"):
        ipc_to_groups(_ipc_of(table))
    with pytest.raises(SchemaError, match="unreadable schema version"):
        ipc_to_groups(_ipc_of(_with_version(_stored_table(), "one.zero")))


def test_unknown_status_rejected():
    """Pins: a status outside completed|truncated|aborted|failed is a SchemaError naming the row.
    Guards: a bare ValueError from the enum escaping the reader."""
    table = _stored_table()
    i = table.schema.get_field_index("status")
    table = table.set_column(i, table.schema.field(i), pa.array(["exploded"]))
    with pytest.raises(SchemaError, match="row 0.*exploded"):
        ipc_to_groups(_ipc_of(table))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_are_schema_errors(data):
    """Pins: any bytes that are not a miles batch give SchemaError (never another exception, never a crash).
    Guards: a corrupt buffer object crashing the run instead of being quarantined (§6.2, §14)."""
    try:
        ipc_to_groups(data, "garbage")
    except SchemaError as e:
        assert "garbage" in str(e)


@pytest.mark.parametrize("data", [b"", b"not arrow", b"\xff\xff\xff\xff" + b"\x00" * 12])
def test_known_garbage_rejected(data):
    """Pins: empty, text and truncated-header bytes are reported as 'not a readable Arrow IPC stream'.
    Guards: an empty object (an interrupted upload) being read as zero groups."""
    with pytest.raises(SchemaError, match="not a readable Arrow IPC stream"):
        ipc_to_groups(data, "x")


def test_truncated_stream_rejected():
    """Pins: a valid stream cut short is a SchemaError. Guards: a partial object read as complete (§14)."""
    data = groups_to_ipc([Group("g0", 5, [_sample(response_ids=list(range(100)), response_logprobs=[0.0] * 100,
                                                  loss_mask=[1] * 100, token_versions=[1] * 100)])])
    for cut in (len(data) // 3, len(data) // 2, len(data) - 9):
        with pytest.raises(SchemaError):
            ipc_to_groups(data[:cut], "cut")


def test_pending_samples_are_not_stored():
    """Pins: a pending sample (in memory only) cannot be written. Guards: unfinished work in the buffer."""
    with pytest.raises(SchemaError, match="pending"):
        groups_to_ipc([Group("g0", 5, [_sample(status=SampleStatus.PENDING)])])


def test_group_staleness_and_flags():
    """Pins: staleness = current - min(token_versions), None when unknown; aborted if any sample aborted;
    cleared() keeps the prompt and drops generated fields (docs/fully-async.md).
    Guards: unknown versions counted as stale; retried prompts carrying old responses."""
    g = Group("g", 1, [_sample(token_versions=[3, 5]), _sample(sample_index=1, token_versions=[4],
                                                               status=SampleStatus.ABORTED)])
    assert g.oldest_version == 3 and g.staleness(7) == 4 and g.staleness(None) is None
    assert g.aborted and g.samples[0].mixed_version and not g.samples[1].mixed_version
    assert Group("g", 1, [_sample(token_versions=[])]).staleness(9) is None
    c = g.samples[0].cleared("g-retry")
    assert (c.group_id, c.prompt_ids, c.response_ids, c.reward, c.status) == ("g-retry", [1, 2], [], None,
                                                                             SampleStatus.PENDING)


def test_no_pickle_in_data_path():
    """Pins: the samples module never imports pickle (docs/data-path.md).
    Guards: a convenience pickle.loads on data read from storage."""
    import miles_core.samples as mod

    import ast

    tree = ast.parse(open(mod.__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"pickle", "cloudpickle", "dill", "joblib"}


def test_routed_experts_round_trip_and_older_minor_reads_empty():
    """Pins: a MoE sample's routed experts (flattened int32) are stored and read back unchanged; a 1.0
    batch, written before the column existed, reads with none. Guards: routing replay training on
    routes lost in the buffer, or old run roots becoming unreadable."""
    s = _sample(routed_experts=[3, 1, 0, 2, 7, 5])
    [g] = ipc_to_groups(groups_to_ipc([Group("g0", 5, [s])]))
    assert g.samples[0].routed_experts == [3, 1, 0, 2, 7, 5]
    table = _stored_table().drop_columns(["routed_experts"])
    [g] = ipc_to_groups(_ipc_of(_with_version(table, "1.0")))
    assert g.samples[0].routed_experts == []
