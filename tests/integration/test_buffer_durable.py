"""The durable buffer on real storage: file:// and a real S3 server (SeaweedFS), docs/data-path.md.

Every test runs on both backends through the `storage_root` fixture. Waits are bounded by
events or timeouts; nothing asserts on wall-clock speed (that is bench/buffer.py's job).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from miles_core.buffer import DropUnused, DurableBuffer, RetryUnused, build_buffer, build_unused_handler
from miles_core.buffer.inspect import inspect_buffer
from miles_core.cli import main as cli_main
from miles_core.config import embedded_default, replace_fields
from miles_core.metrics import names as N
from miles_core.samples import Group, Sample, SampleStatus, groups_to_ipc, ipc_to_groups
from miles_core.storage import Store

EMPTY_GET_SECONDS = 0.05  # a get of an empty buffer: its BufferTimeout is what the test checks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_group(i: int, version: int | None = 1, status=SampleStatus.COMPLETED, n: int = 2, epoch: int = 0) -> Group:
    gid = f"g{i:04d}"
    versions = [] if version is None else [version, version + 1]
    samples = [Sample(gid, i, j, [1, 2, 3], [4, 5], [-0.5, -0.25], [1, 1], list(versions), 1.0,
                      status if j == 0 else SampleStatus.COMPLETED, "stop", "{}",
                      json.dumps({"epoch": epoch, "position": i})) for j in range(n)]
    return Group(gid, i, samples)


# A resume step after every recorded one: reopen keeps every consumption manifest (a resume from the
# newest checkpoint of a run that checkpoints every step).
EVERY_RECORDED_STEP = 10**9


def open_buffer(root: str, capacity: int = 8, **kw) -> DurableBuffer:
    kw.setdefault("unused_handler", DropUnused())
    kw.setdefault("coalesce_seconds", 0.0)
    kw.setdefault("consumed_through_step", EVERY_RECORDED_STEP)
    return DurableBuffer.open(Store(root), capacity_groups=capacity, **kw)


def put_all(buf: DurableBuffer, groups: list[Group]) -> None:
    for g in groups:
        buf.put(g)


def test_put_returns_after_commit_and_get_is_fifo(storage_root):
    """put returns only when the group's object is committed; get serves groups in put order."""
    store = Store(storage_root)
    with open_buffer(storage_root) as buf:
        for i in range(3):
            buf.put(make_group(i))
            keys = store.list("buffer/groups/")
            stored = {g.group_id for k in keys for g in ipc_to_groups(store.get_bytes(k))}
            assert f"g{i:04d}" in stored
            assert all(k.startswith("buffer/groups/w") and k.endswith(".arrow") for k in keys)
        assert [buf.get().group_id for _ in range(3)] == ["g0000", "g0001", "g0002"]


def test_concurrent_puts_are_coalesced_and_each_returns_committed(storage_root):
    """Puts arriving within buffer_coalesce_seconds share one object; each put returns after that commit."""
    store = Store(storage_root)
    seen_after_return: dict[str, bool] = {}

    with open_buffer(storage_root, capacity=16, coalesce_seconds=0.3) as buf:
        def producer(i):
            buf.put(make_group(i))
            objs = [g.group_id for k in store.list("buffer/groups/") for g in ipc_to_groups(store.get_bytes(k))]
            seen_after_return[f"g{i:04d}"] = f"g{i:04d}" in objs

        threads = [threading.Thread(target=producer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(seen_after_return.values()) and len(seen_after_return) == 6
        assert len(store.list("buffer/groups/")) < 6
        assert buf.queue_size == 6


def test_aborted_group_rejected_at_put_and_handed_to_handler(storage_root):
    """A group with any aborted sample is never stored, counted, and handed to the unused handler."""
    seen = []

    class Spy:
        def handle(self, group, reason):
            seen.append((group.group_id, reason))

    with open_buffer(storage_root, unused_handler=Spy()) as buf:
        buf.put(make_group(1, status=SampleStatus.ABORTED))
        buf.put(make_group(2))
        m = buf.get_metrics()
        assert seen == [("g0001", "aborted")]
        assert m[N.ABORTED_GROUPS_FILTERED] == 1 and m[N.QUEUE_SIZE] == 1
        assert buf.available_group_ids() == ["g0002"]
    assert inspect_buffer(storage_root)["committed"] == 1


def test_dynamic_filter_drops_with_reason(storage_root):
    """The dynamic filter drops always (not via the handler) and counts drop_{reason}."""
    handler = DropUnused()

    def zero_std(group):
        return (group.prompt_index % 2 == 0, "zero std")

    with open_buffer(storage_root, unused_handler=handler, dynamic_filter=zero_std) as buf:
        put_all(buf, [make_group(i) for i in range(4)])
        m = buf.get_metrics()
    assert m["rollout/dynamic_filter/drop_zero_std"] == 2
    assert m[N.QUEUE_SIZE] == 2 and m[N.UNUSED_DROPPED] == 0


def test_stale_groups_rejected_at_get_and_counted_in_staleness(storage_root):
    """get rejects staleness > max_weight_staleness (to the handler), records every examined group's
    staleness (stale ones too), and an unknown version is neither stale nor counted."""
    with open_buffer(storage_root, max_weight_staleness=2) as buf:
        buf.put(make_group(0, version=1))   # staleness 5 at v=6: stale
        buf.put(make_group(1, version=None))  # unknown: not stale, not counted
        buf.put(make_group(2, version=5))   # staleness 1
        assert buf.get(current_version=6).group_id == "g0001"
        assert buf.get(current_version=6).group_id == "g0002"
        m = buf.get_metrics()
    assert m[N.STALE_GROUPS_FILTERED] == 1
    assert m[N.AVG_STALENESS] == 3.0 and m[N.MAX_STALENESS] == 5
    assert m[N.UNUSED_DROPPED] == 1


def test_retry_handler_recycles_cleared_prompt_group(storage_root):
    """retry hands the original prompt (generated fields cleared, new attempt id) to the data source."""
    recycled: list[Group] = []
    with open_buffer(storage_root, max_weight_staleness=0, unused_handler=RetryUnused(recycled.append)) as buf:
        buf.put(make_group(7, version=1))
        buf.put(make_group(8, version=3))
        assert buf.get(current_version=3).group_id == "g0008"
        m = buf.get_metrics()
    assert m[N.UNUSED_RECYCLED] == 1
    (g,) = recycled
    assert g.group_id == "g0007#r1" and g.prompt_index == 7
    assert all(s.prompt_ids == [1, 2, 3] and not s.response_ids and not s.token_versions
               and s.status == SampleStatus.PENDING and s.reward is None for s in g.samples)


def test_metrics_window_resets(storage_root):
    """get_metrics covers the window since the last call; counters restart at 0, staleness stats vanish."""
    with open_buffer(storage_root) as buf:
        put_all(buf, [make_group(i, version=1) for i in range(3)])
        buf.get(current_version=4)
        first = buf.get_metrics()
        second = buf.get_metrics()
    assert first[N.BYTES_WRITTEN] > 0 and first[N.PUT_SECONDS] > 0 and first[N.MAX_STALENESS] == 3
    assert first[N.BUFFER_MAX_STALENESS] == 3 and first[N.BUFFER_AVG_STALENESS] == 3
    assert second[N.BYTES_WRITTEN] == 0 and N.PUT_SECONDS not in second and N.AVG_STALENESS not in second
    assert second[N.QUEUE_SIZE] == 2  # a level, not a counter


def test_blocked_producer_wakes_on_every_get(storage_root):
    """With the buffer full, put blocks (no eviction); each get frees exactly one slot and wakes it."""
    with open_buffer(storage_root, capacity=2) as buf:
        put_all(buf, [make_group(0), make_group(1)])
        returned = [threading.Event(), threading.Event()]

        def producer():
            for k, i in enumerate((2, 3)):
                buf.put(make_group(i))
                returned[k].set()

        t = threading.Thread(target=producer)
        t.start()
        assert not returned[0].wait(0.3)  # full: blocked
        assert buf.get().group_id == "g0000"
        assert returned[0].wait(20)
        assert not returned[1].wait(0.3)  # full again
        assert buf.get().group_id == "g0001"
        assert returned[1].wait(20)
        t.join(20)
        assert buf.available_group_ids() == ["g0002", "g0003"]
        assert buf.get_metrics()[N.PRODUCER_BLOCKED_SECONDS] > 0


def test_get_ignores_unknown_context_keys_and_times_out(storage_root):
    """get accepts unknown context keys; timeout_seconds bounds the wait on an empty buffer."""
    from miles_core.buffer import BufferTimeout

    with open_buffer(storage_root) as buf:
        buf.put(make_group(0))
        assert buf.get(current_version=None, step=3, whatever="x").group_id == "g0000"
        with pytest.raises(BufferTimeout):
            buf.get(timeout_seconds=EMPTY_GET_SECONDS)


CHILD = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, {root!r})
    from tests.integration.test_buffer_durable import make_group, open_buffer
    buf = open_buffer({uri!r}, capacity=1000, coalesce_seconds=0.01)
    i = 0
    while True:
        buf.put(make_group(i))
        print(f"g{{i:04d}}", flush=True)
        i += 1
""")


def test_sigkill_after_put_keeps_every_committed_group(storage_root):
    """A producer SIGKILLed right after put returned loses nothing: a reopened buffer serves every
    group whose put returned (put means committed, not queued in memory)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=ROOT, uri=storage_root)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    acked = []
    try:
        while len(acked) < 5:
            line = proc.stdout.readline()
            assert line, "child exited early"
            acked.append(line.strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with open_buffer(storage_root, capacity=1000) as buf:
        assert set(acked) <= set(buf.available_group_ids())


def test_consumed_groups_never_come_back(storage_root):
    """Groups recorded consumed (and ids rejected at get) are not served by a reopened buffer."""
    with open_buffer(storage_root, max_weight_staleness=1) as buf:
        put_all(buf, [make_group(0, version=1), make_group(1, version=5), make_group(2, version=5),
                      make_group(3, version=5)])
        got = buf.get(current_version=5)  # g0000 is stale (4 > 1) and rejected
        assert got.group_id == "g0001"
        buf.record_consumed(0, [got.group_id])
        buf.get(current_version=5)  # g0002 got but never recorded: comes back
    with open_buffer(storage_root) as buf:
        assert buf.available_group_ids() == ["g0002", "g0003"]
        assert buf.committed_positions() == {(0, 2), (0, 3)}
        manifest = Store(storage_root).get_json("buffer/consumed/00000000.json")
        assert manifest["consumed"] == ["g0001"] and manifest["rejected"] == ["g0000"]


def test_reopen_discards_manifests_after_resume_step(storage_root):
    """Reopening at consumed_through_step=k deletes manifests of steps > k, so those groups (which the
    restored model never trained on) are served again; None keeps every manifest."""
    with open_buffer(storage_root) as buf:
        put_all(buf, [make_group(i) for i in range(6)])
        for step in range(3):
            ids = [buf.get().group_id, buf.get().group_id]
            buf.record_consumed(step, ids)
    with open_buffer(storage_root) as buf:
        assert buf.available_group_ids() == []
    store = Store(storage_root)
    with open_buffer(storage_root, consumed_through_step=0) as buf:
        assert buf.available_group_ids() == ["g0002", "g0003", "g0004", "g0005"]
        buf.record_consumed(1, [buf.get().group_id])  # the resumed run goes on from step 1
    assert store.list("buffer/consumed/") == ["buffer/consumed/00000000.json", "buffer/consumed/00000001.json"]
    with open_buffer(storage_root, consumed_through_step=1) as buf:
        assert buf.available_group_ids() == ["g0003", "g0004", "g0005"]


def test_fully_consumed_objects_are_not_reread(storage_root):
    """Objects whose groups are all consumed are named in the manifest (objects_done) and never read
    again on reopen, so resume cost follows the unconsumed backlog, not the run's history."""
    store = Store(storage_root)
    with open_buffer(storage_root) as buf:
        put_all(buf, [make_group(0), make_group(1), make_group(2)])
        buf.record_consumed(0, [buf.get().group_id, buf.get().group_id])
    keys = store.list("buffer/groups/")
    assert store.get_json("buffer/consumed/00000000.json")["objects_done"] == keys[:2]
    store.put_bytes(keys[0], b"garbage that would be quarantined if it were read")
    with open_buffer(storage_root) as buf:
        assert buf.available_group_ids() == ["g0002"]
        assert buf.get_metrics()[N.QUARANTINED] == 0


def test_corrupt_object_is_quarantined_and_counted(storage_root):
    """An undecodable object is moved to buffer/quarantine/ with a reason sidecar and counted; the
    other groups are still served and open never crashes."""
    store = Store(storage_root)
    with open_buffer(storage_root) as buf:
        buf.put(make_group(0))
    store.put_bytes("buffer/groups/wbad/000000000000.arrow", b"not arrow at all")
    store.put_bytes("buffer/groups/wbad/000000000001.arrow", groups_to_ipc([make_group(9)])[:-40])
    with open_buffer(storage_root) as buf:
        assert buf.available_group_ids() == ["g0000"]
        assert buf.get_metrics()[N.QUARANTINED] == 2
    q = store.list("buffer/quarantine/")
    assert "buffer/quarantine/wbad/000000000000.arrow" in q
    reason = store.get_json("buffer/quarantine/wbad/000000000000.arrow.reason.json")
    assert reason["source"] == "buffer/groups/wbad/000000000000.arrow" and "Arrow" in reason["reason"]
    assert not any(k.startswith("buffer/groups/wbad") for k in store.list("buffer/groups/"))
    assert inspect_buffer(storage_root)["quarantined"] == 2


def test_inspect_counts_and_cli(storage_root, capsys):
    """`miles buffer inspect RUN_URI` prints committed/consumed/available/quarantined counts, bytes and versions."""
    with open_buffer(storage_root) as buf:
        put_all(buf, [make_group(i, version=i + 1) for i in range(4)])
        buf.record_consumed(0, [buf.get().group_id])
    assert cli_main(["buffer", "inspect", storage_root]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["committed"] == 4 and out["consumed"] == 1 and out["available"] == 3
    assert out["quarantined"] == 0 and out["bytes"] > 0 and out["last_consumed_step"] == 0
    assert out["oldest_version"] == 2 and out["newest_version"] == 5


def test_build_buffer_from_config(storage_root):
    """build_buffer wires the config: capacity from the factor, staleness, coalescing, run root store."""
    cfg = replace_fields(embedded_default(), storage_root=storage_root, run_id="r1", rollout_batch_size=2,
                         async_data_buffer_capacity_factor=1.5, max_weight_staleness=3)
    buf = build_buffer(cfg, build_unused_handler("drop"), consumed_through_step=-1)
    try:
        assert isinstance(buf, DurableBuffer)
        assert buf.capacity == 3 and buf.max_weight_staleness == 3
        buf.put(make_group(0))
        assert buf.store.root_uri == Store(cfg.run_uri).root_uri
    finally:
        buf.close()
    assert inspect_buffer(cfg.run_uri)["available"] == 1
