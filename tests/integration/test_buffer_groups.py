"""Exactly-once at the group level, compaction and retention of the durable buffer (issue 16 items 4-6).

Under load an object holds many groups, so a reopen that skipped only fully consumed objects would
serve a partially consumed object's consumed groups again. These tests coalesce several groups into
ONE object (asserted), consume part of them, and reopen; they pin the staleness boundary, that a
stale-rejected group in a shared object stays rejected, that compaction makes a reopen read one
record instead of one manifest per step (and serves exactly the same groups), that retention deletes
only objects consumed entirely, and what a custom buffer plug-in is handed. Both backends (file://
and the SeaweedFS S3 server) through `storage_root`.
"""

from __future__ import annotations

import logging
import threading

import pytest

from miles_core.buffer import BufferTimeout, DataBufferError, DropUnused, DurableBuffer, build_buffer
from miles_core.buffer import objects as O
from miles_core.config import embedded_default, replace_fields
from miles_core.metrics import names as N
from miles_core.samples import ipc_to_groups
from miles_core.storage import Store
from tests.integration.test_buffer_durable import make_group

DRAIN_GET_SECONDS = 5  # each get while the loop drains the stale groups (a timeout ends one try, not the test)
GET_SECONDS = 10  # a get of a group already put: answered at once, the bound only ends a broken test

pytest_plugins = ["pytester"]


def open_at(root: str, through: int, capacity: int = 16, **kw) -> DurableBuffer:
    kw.setdefault("unused_handler", DropUnused())
    return DurableBuffer.open(Store(root), capacity_groups=capacity, consumed_through_step=through, **kw)


def put_coalesced(root: str, groups, **kw) -> None:
    """Put `groups` concurrently into a buffer whose capacity they fill: the writer's window closes when
    the buffer is full, so they are committed as one object (asserted)."""
    with open_at(root, -1, capacity=len(groups), coalesce_seconds=30.0, **kw) as buf:
        threads = [threading.Thread(target=buf.put, args=(g,)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    store = Store(root)
    (key,) = store.list(O.GROUPS)
    assert sorted(g.group_id for g in ipc_to_groups(store.get_bytes(key))) == sorted(g.group_id for g in groups)


def ids(buf: DurableBuffer) -> list[str]:
    return sorted(buf.available_group_ids())


def test_partially_consumed_object_serves_exactly_its_unconsumed_groups(storage_root):
    put_coalesced(storage_root, [make_group(i) for i in range(8)])
    with open_at(storage_root, -1) as buf:
        got = [buf.get().group_id for _ in range(3)]
        buf.record_consumed(0, got)
    with open_at(storage_root, 0) as buf:
        assert ids(buf) == sorted(f"g{i:04d}" for i in range(8) if f"g{i:04d}" not in got)
        rest = [buf.get().group_id for _ in range(5)]
        buf.record_consumed(1, rest)
    manifest = Store(storage_root).get_json(O.consumed_key(1))
    assert len(manifest["objects_done"]) == 1  # the shared object is done once its last group is recorded
    with open_at(storage_root, 1) as buf:
        assert ids(buf) == []
    with open_at(storage_root, -1) as buf:  # no checkpoint: every manifest discarded, all 8 served again
        assert len(ids(buf)) == 8


def test_stale_rejected_group_in_a_shared_object_stays_rejected(storage_root):
    put_coalesced(storage_root, [make_group(0, version=1)] + [make_group(i, version=5) for i in (1, 2, 3)])
    handler = DropUnused()
    served = []  # the object's order is the threads' order: get until g0000 was examined
    with open_at(storage_root, -1, max_weight_staleness=2, unused_handler=handler) as buf:
        while handler.dropped_total == 0:  # g0000 (oldest token version 1) is 5 versions old at 6: rejected
            try:
                served.append(buf.get(current_version=6, timeout_seconds=DRAIN_GET_SECONDS).group_id)
            except BufferTimeout:
                break
        buf.record_consumed(0, served[:1])  # the other served groups were never trained: served again
    assert handler.dropped_total == 1 and "g0000" not in served
    assert Store(storage_root).get_json(O.consumed_key(0))["rejected"] == ["g0000"]
    with open_at(storage_root, 0, max_weight_staleness=2) as buf:
        assert ids(buf) == sorted({"g0001", "g0002", "g0003"} - {served[0]})


def test_staleness_boundary(storage_root):
    """A group exactly --max-weight-staleness versions old is served; one version older is rejected and counted."""
    with open_at(storage_root, -1, max_weight_staleness=2) as buf:
        buf.put(make_group(0, version=1))  # at version 4: staleness 3
        buf.put(make_group(1, version=2))  # at version 4: staleness 2
        assert buf.get(current_version=4, timeout_seconds=GET_SECONDS).group_id == "g0001"
        m = buf.get_metrics()
    assert m[N.STALE_GROUPS_FILTERED] == 1 and m[N.MAX_STALENESS] == 3


def _run_steps(root: str, steps: range, per_step: int, compact_at=(), delete=False) -> None:
    with open_at(root, steps.start - 1, capacity=per_step * len(steps) + 1) as buf:
        for step in steps:
            got = []
            for i in range(per_step):
                buf.put(make_group(step * per_step + i))
                got.append(buf.get().group_id)
            buf.record_consumed(step, got)
            if step in compact_at:
                buf.compact(step, delete_consumed_objects=delete)


def _spy_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real_get_bytes = Store.get_bytes
    monkeypatch.setattr(Store, "get_bytes", lambda self, key: (reads.append(key), real_get_bytes(self, key))[1])
    return reads


def test_compaction_bounds_what_a_reopen_reads_and_serves_the_same(storage_root, monkeypatch):
    """After a compaction at step 5, a reopen at step 7 reads the compaction record and the manifests
    of steps 6-7 only (not 8 per-step manifests), and only the objects that hold unconsumed groups."""
    _run_steps(storage_root, range(0, 8), per_step=1, compact_at=(5,))
    with open_at(storage_root, 7) as buf:
        buf.put(make_group(100))  # committed, never consumed
    reads = _spy_reads(monkeypatch)
    with open_at(storage_root, 7) as buf:
        served = ids(buf)
    assert sorted(k for k in reads if k.startswith((O.CONSUMED, O.COMPACTED))) == [
        O.compact_key(5), O.consumed_key(6), O.consumed_key(7)]
    assert len([k for k in reads if k.startswith(O.GROUPS)]) == 1 and served == ["g0100"]
    store = Store(storage_root)
    assert all(store.exists(O.consumed_key(step)) for step in range(8))  # the per-step manifests stay: lineage


def test_a_compaction_record_keeps_the_consumed_groups_of_a_shared_object(storage_root, monkeypatch):
    put_coalesced(storage_root, [make_group(i) for i in range(4)])
    with open_at(storage_root, -1) as buf:
        got = [buf.get().group_id, buf.get().group_id]
        buf.record_consumed(0, got)
        buf.compact(0)
    assert sorted(Store(storage_root).get_json(O.compact_key(0))["consumed"]) == sorted(got)
    reads = _spy_reads(monkeypatch)
    with open_at(storage_root, 0) as buf:
        assert ids(buf) == sorted({f"g{i:04d}" for i in range(4)} - set(got))
    assert [k for k in reads if k.startswith((O.CONSUMED, O.COMPACTED))] == [O.compact_key(0)]


def test_a_resume_before_the_compacted_step_serves_the_later_groups_again(storage_root):
    """A resume that fell back past a damaged checkpoint: the compaction record after the resume step is
    discarded and the groups consumed after it are served again (their model state is gone)."""
    _run_steps(storage_root, range(0, 4), per_step=1, compact_at=(3,))
    with open_at(storage_root, 1) as buf:
        assert ids(buf) == ["g0002", "g0003"]
    store = Store(storage_root)
    assert not store.list(O.COMPACTED) and not store.exists(O.consumed_key(2))


def test_a_resume_before_a_compaction_that_deleted_objects_is_refused(storage_root):
    _run_steps(storage_root, range(0, 4), per_step=1, compact_at=(3,), delete=True)
    with pytest.raises(DataBufferError, match=r"after step 1.*consumed through step 3 were deleted"):
        open_at(storage_root, 1)


def test_retention_deletes_only_objects_consumed_entirely(storage_root):
    _run_steps(storage_root, range(0, 3), per_step=2, compact_at=(2,), delete=True)
    store = Store(storage_root)
    with open_at(storage_root, 2) as buf:
        buf.put(make_group(50))
        buf.put(make_group(51))
        buf.record_consumed(3, [buf.get().group_id])  # g0050 consumed; g0051's object stays
        buf.compact(3, delete_consumed_objects=True)
    left = [g.group_id for k in store.list(O.GROUPS) for g in ipc_to_groups(store.get_bytes(k))]
    assert left == ["g0051"]
    assert store.list(O.COMPACTED) == [O.compact_key(3)]
    with open_at(storage_root, 3) as buf:
        assert ids(buf) == ["g0051"]


def test_the_resume_step_is_required(storage_root):
    cfg = replace_fields(embedded_default(), storage_root=storage_root)
    with pytest.raises(TypeError, match="consumed_through_step"):
        build_buffer(cfg, DropUnused())  # noqa - the missing argument is the point
    with pytest.raises(ValueError, match="consumed_through_step=None"):
        DurableBuffer.open(Store(storage_root), capacity_groups=1, unused_handler=DropUnused(),
                           consumed_through_step=None)


class StoreAwareBuffer:
    def __init__(self, config, handler, *, store, consumed_through_step):
        self.store, self.step = store, consumed_through_step

    def put(self, group): ...

    def get(self, **context): ...

    def get_metrics(self):
        return {}


class PlainBuffer(StoreAwareBuffer):
    def __init__(self, config, handler):
        self.store = self.step = None


def test_a_plugin_gets_the_store_and_the_resume_step_or_a_warning(tmp_path, caplog):
    cfg = replace_fields(embedded_default(), storage_root=str(tmp_path),
                         custom_async_data_buffer_path=f"{__name__}:StoreAwareBuffer")
    buf = build_buffer(cfg, DropUnused(), consumed_through_step=7)
    assert buf.step == 7 and buf.store.uri() == Store(cfg.run_uri).uri()
    cfg = replace_fields(cfg, custom_async_data_buffer_path=f"{__name__}:PlainBuffer")
    with caplog.at_level(logging.WARNING, logger="miles_core.buffer.contract"):
        build_buffer(cfg, DropUnused(), consumed_through_step=7)
    assert "exactly-once across segments is lost" in caplog.text and "PlainBuffer" in caplog.text


HANGING_TEST = """
from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.storage import Store

def test_hang(tmp_path):
    with DurableBuffer.open(Store(f"file://{tmp_path}"), capacity_groups=1, unused_handler=DropUnused(),
                            consumed_through_step=-1) as buf:
        buf.get()  # empty, nothing will ever put: blocks forever
"""


def test_no_test_can_hang_the_suite(pytestconfig, pytester):
    """pytest-timeout bounds every test (pyproject.toml): with the suite's method, a get() that blocks
    forever fails with the timeout (and the buffer is closed on the way out) instead of hanging CI."""
    assert pytestconfig.pluginmanager.hasplugin("timeout") and float(pytestconfig.getini("timeout")) > 0
    pytester.makepyfile(test_hang=HANGING_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "timeout=2",
                                           "-o", f"timeout_method={pytestconfig.getini('timeout_method')}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_hang*Timeout (>2.0s) from pytest-timeout*"])
