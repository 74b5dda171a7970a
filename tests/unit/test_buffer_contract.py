"""The DataBuffer slot and the buffer's pure logic (docs/data-path.md), on a local file:// root.

Backend behaviour (file:// and S3) is pinned in tests/integration/test_buffer_durable.py.
"""

from __future__ import annotations

import json
import threading

import pytest

from miles_core.buffer import (
    BufferClosed,
    DataBuffer,
    DataBufferError,
    DropUnused,
    DurableBuffer,
    RetryUnused,
    build_buffer,
    build_unused_handler,
)
from miles_core.buffer.contract import BufferExtras, retry_group_id
from miles_core.config import ConfigError, embedded_default, replace_fields
from miles_core.config.plugins import PluginError
from miles_core.metrics import names as N
from miles_core.prepare.checks import validate
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.storage import StorageUnavailable, Store


def make_group(i: int, version: int = 1) -> Group:
    gid = f"g{i:04d}"
    return Group(gid, i, [Sample(gid, i, j, [1, 2], [3], [-0.1], [1], [version], 0.5, SampleStatus.COMPLETED,
                                 "stop", "{}", json.dumps({"epoch": 0, "position": i})) for j in range(2)])


class ListBuffer:
    """A minimal custom buffer (plugin used only by tests): an unbounded in-memory FIFO."""

    def __init__(self, config, unused_samples_handler):
        self.config, self.handler, self.items = config, unused_samples_handler, []

    def put(self, group):
        self.items.append(group)

    def get(self, **context):
        return self.items.pop(0)

    def get_metrics(self):
        return {N.QUEUE_SIZE: len(self.items)}


class NoGet:
    def __init__(self, config, handler):
        pass

    def put(self, group):
        pass


@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/run"


# A resume step after every recorded one: reopen keeps every consumption manifest (a resume from the
# newest checkpoint of a run that checkpoints every step).
EVERY_RECORDED_STEP = 10**9


def open_buffer(root, capacity=4, **kw):
    kw.setdefault("unused_handler", DropUnused())
    kw.setdefault("coalesce_seconds", 0.0)
    kw.setdefault("consumed_through_step", EVERY_RECORDED_STEP)
    return DurableBuffer.open(Store(root), capacity_groups=capacity, **kw)


def test_custom_buffer_path_is_built_with_config_and_handler(tmp_path):
    """--custom-async-data-buffer-path module:Class replaces the buffer; built as Class(config, handler)."""
    cfg = replace_fields(embedded_default(), storage_root=str(tmp_path), custom_async_data_buffer_path=f"{__name__}:ListBuffer")
    validate(cfg)
    handler = DropUnused()
    buf = build_buffer(cfg, handler, consumed_through_step=-1)
    assert isinstance(buf, ListBuffer) and buf.config is cfg and buf.handler is handler
    assert isinstance(buf, DataBuffer)
    buf.put(make_group(0))
    assert buf.get(current_version=1, anything="ignored").group_id == "g0000"


def test_a_custom_buffer_without_the_extras_gets_what_the_manager_does_without_them(tmp_path):
    """The rollout manager reaches the run buffer's extras only through BufferExtras: the durable buffer's
    own methods answer; a plug-in that has none of them (put/get/get_metrics only) is not gated, commits
    nothing to skip, records and compacts nothing, and reports its `queue_size` when it has one."""
    plain = BufferExtras(ListBuffer(None, DropUnused()))
    assert plain.committed_positions() == set() and plain.groups_received() is None
    assert plain.usable_queue_size(3) == 0 and plain.recent_foreign_writers() == 0
    plain.record_consumed(1, ["g"]), plain.compact(1, delete_consumed_objects=True), plain.close()
    sized = ListBuffer(None, DropUnused())
    sized.queue_size = 4
    assert BufferExtras(sized).usable_queue_size(None) == 4
    buf = open_buffer(str(tmp_path), capacity=8)
    try:
        extras = BufferExtras(buf)
        buf.put(make_group(0))
        assert extras.groups_received() == 1 and extras.usable_queue_size(None) == 1
        assert extras.committed_positions() == buf.committed_positions() != set()
    finally:
        extras.close()
    with pytest.raises(BufferClosed):
        buf.put(make_group(1))


@pytest.mark.parametrize("path, expected", [
    ("no_such_module_xyz:Buffer", "not importable"),
    (f"{__name__}:Missing", "has no attribute 'Missing'"),
    (f"{__name__}:NoGet", "lacks method(s) ['get', 'get_metrics']"),
    ("no-colon", "expected 'module:attr'"),
])
def test_bad_custom_buffer_path_errors_clearly(tmp_path, path, expected):
    """A bad custom buffer path fails with the flag's name and what is wrong, at validate and at build."""
    cfg = replace_fields(embedded_default(), storage_root=str(tmp_path), custom_async_data_buffer_path=path)
    with pytest.raises(PluginError, match="--custom-async-data-buffer-path") as e:
        build_buffer(cfg, DropUnused(), consumed_through_step=-1)
    assert expected in str(e.value)
    with pytest.raises(ConfigError, match="--custom-async-data-buffer-path"):
        validate(cfg)


def test_metric_names_are_the_design_names():
    """The exported names are the §6.3 interface (plus producer blocking and handler counts); a rename breaks users."""
    design = {f"rollout/fully_async/{n}" for n in (
        "queue_size", "aborted_groups_filtered", "stale_groups_filtered", "avg_staleness", "max_staleness",
        "buffer_avg_staleness", "buffer_max_staleness", "put_seconds", "bytes_written", "quarantined")}
    design |= {"rollout/dynamic_filter/drop_{reason}", "perf/producer_blocked_seconds"}
    assert design <= set(N.BUFFER_METRIC_NAMES)
    assert set(N.BUFFER_METRIC_NAMES) - design == {N.UNUSED_DROPPED, N.UNUSED_RECYCLED, N.DUPLICATE_GROUPS_FILTERED}
    assert N.dynamic_filter_drop_metric("Zero Std!") == "rollout/dynamic_filter/drop_zero_std"


def test_every_emitted_metric_is_declared(root):
    """get_metrics never emits a name missing from BUFFER_METRIC_NAMES (dynamic drops match the pattern)."""
    with open_buffer(root, dynamic_filter=lambda g: (g.prompt_index != 1, "x")) as buf:
        for i in range(3):
            buf.put(make_group(i))
        buf.get(current_version=3)
        emitted = set(buf.get_metrics())
    assert {n for n in emitted if not n.startswith("rollout/dynamic_filter/")} <= set(N.BUFFER_METRIC_NAMES)
    assert "rollout/dynamic_filter/drop_x" in emitted


def test_unused_handler_modes():
    """drop counts drops per window; retry needs the data source's recycle and ids get an attempt suffix."""
    drop = build_unused_handler("drop")
    drop.handle(make_group(0), "stale")
    assert drop.metrics() == {N.UNUSED_DROPPED: 1} and drop.metrics() == {N.UNUSED_DROPPED: 0}
    with pytest.raises(ValueError, match="recycle"):
        build_unused_handler("retry")
    with pytest.raises(ValueError, match="drop, retry"):
        build_unused_handler("keep")
    assert isinstance(build_unused_handler("retry", recycle=lambda g: None), RetryUnused)
    assert retry_group_id("g1") == "g1#r1" and retry_group_id("g1#r1") == "g1#r2"


def test_producer_failure_raises_at_next_get_before_queued_data(root):
    """A failed producer (docs/fully-async.md): the next get raises its error even with groups queued."""
    with open_buffer(root) as buf:
        buf.put(make_group(0))
        buf.fail(RuntimeError("engine exploded"))
        with pytest.raises(RuntimeError, match="engine exploded"):
            buf.get()


def test_groups_received_counts_queued_and_handed_out_not_the_stale(root):
    """What the rollout manager's demand gate counts as made (miles_core.rollout.manager): groups
    committed and not yet got, plus those get returned; a group rejected as stale at get leaves it,
    and a reopened buffer counts the groups it holds again (a rejection is durable with the next
    consumption record, so without one the stale group is back, to be rejected again)."""
    with open_buffer(root, max_weight_staleness=1) as buf:
        for i in range(3):
            buf.put(make_group(i, version=1 if i == 0 else 3))
        assert buf.groups_received() == 3
        assert buf.get(current_version=3).group_id == make_group(1).group_id  # group 0 is stale: rejected
        assert buf.groups_received() == 2 and buf.queue_size == 1
    with open_buffer(root, max_weight_staleness=1) as again:
        assert again.groups_received() == 3  # nothing recorded: all three are served again


class FailingStore(Store):
    """A store whose group writes fail, as when storage stays unreachable through every retry."""

    def put_bytes(self, key, data):
        if key.startswith("buffer/groups/"):
            raise StorageUnavailable("storage down (test)")
        super().put_bytes(key, data)


def test_put_raises_when_commit_fails_and_frees_its_slot(tmp_path):
    """put never reports success for an uncommitted group; a failed commit raises and frees the slot."""
    buf = DurableBuffer.open(FailingStore(str(tmp_path)), capacity_groups=1, unused_handler=DropUnused(),
                             consumed_through_step=-1)
    try:
        for i in range(2):  # the second put would block forever if the first leaked its slot
            with pytest.raises(StorageUnavailable):
                buf.put(make_group(i))
        assert buf.queue_size == 0
    finally:
        buf.close()


def test_close_wakes_blocked_callers(root):
    """close() wakes a get waiting on an empty buffer and a put waiting on a full one with BufferClosed."""
    buf = open_buffer(root, capacity=1)
    buf.put(make_group(0))
    errors = []

    def blocked_put():
        try:
            buf.put(make_group(1))
        except BufferClosed as e:
            errors.append(e)

    t = threading.Thread(target=blocked_put)
    t.start()
    t.join(0.2)
    buf.close()
    t.join(10)
    assert len(errors) == 1
    empty = open_buffer(root + "2")
    threading.Timer(0.1, empty.close).start()
    with pytest.raises(BufferClosed):
        empty.get()


def test_raising_dynamic_filter_names_the_flag(root):
    """A dynamic filter that raises gives an error naming --dynamic-sampling-filter-path, with the cause."""
    def bad(group):
        raise KeyError("reward")

    with open_buffer(root, dynamic_filter=bad) as buf:
        with pytest.raises(DataBufferError, match="--dynamic-sampling-filter-path") as e:
            buf.put(make_group(0))
    assert isinstance(e.value.__cause__, KeyError)


def test_record_consumed_steps_must_increase(root):
    """record_consumed is once per step in increasing order (a repeat would overwrite a manifest)."""
    with open_buffer(root) as buf:
        buf.record_consumed(3, [])
        with pytest.raises(ValueError, match="already recorded"):
            buf.record_consumed(3, [])


def test_docs_metric_table_matches_code():
    """docs/data-path.md lists exactly BUFFER_METRIC_NAMES in its metrics table, so the docs cannot drift."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "data-path.md").read_text()
    table = doc[doc.index("## Metrics"):doc.index("## Inspecting")]
    documented = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert documented == set(N.BUFFER_METRIC_NAMES)
