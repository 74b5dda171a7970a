"""Resume cost of the durable buffer: reopen time against the backlog, not the history (docs/data-path.md).

    .venv/bin/python bench/resume.py [--consumed 95000] [--backlogs 5000,10000] [--stores file,s3]

A run root is laid out as the buffer writes it under load: groups coalesced `--groups-per-object`
to an object, one consumption manifest per step of `--step-groups` groups (with the objects it
finished), `--consumed` groups consumed, then a backlog of committed, unconsumed groups. The
compaction record is made by the product itself (`DurableBuffer.compact` after the last step, as
the checkpointer does). Then `DurableBuffer.open(..., consumed_through_step=last)` is timed (median
of `--repeats`) in three modes, on a local file:// directory and a SeaweedFS S3 server started here:
- history: no compaction record (every per-step manifest is read: the cost before compaction);
- compacted: the record plus the manifests after it (none here), and the backlog's objects;
- compacted+retention: as compacted, with the fully consumed objects deleted
  (`--buffer-delete-consumed-objects`), so the listing shrinks too.
It checks each reopen serves exactly the backlog, prints the table and the memory per buffered
group (tracemalloc: the object bytes its Arrow rows are zero-copy views of, and the index), and
writes everything to bench/results/resume.json (`--results`). Groups are small
(`bench.buffer.small_group`: 2 samples x (8 + 8) tokens): the backlog's decode cost grows with real
group sizes, the history's cost does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.buffer import WRITER, open_s3, write_committed  # noqa: E402
from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.buffer import DropUnused, DurableBuffer  # noqa: E402
from miles_core.buffer import objects as O  # noqa: E402
from miles_core.storage import Store  # noqa: E402


def lay_out(store: Store, total: int, consumed: int, per_object: int, step_groups: int) -> int:
    """Write the objects and per-step manifests; returns the last step."""
    def write_manifest(step: int) -> None:
        first, last = step * step_groups, min(consumed, (step + 1) * step_groups)
        done = [O.group_key(WRITER, seq) for seq in range(first // per_object, last // per_object)
                if (seq + 1) * per_object <= last and (seq + 1) * per_object > first]
        store.put_json(O.consumed_key(step), {"step": step, "consumed": [f"r{i:07d}" for i in range(first, last)],
                                               "rejected": [], "objects_done": done, "written_at": 0.0})

    steps = -(-consumed // step_groups)
    write_committed(store, total, per_object)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(write_manifest, range(steps)))
    return steps - 1


def reopen(store: Store, through: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    buf = DurableBuffer.open(store, capacity_groups=10**7, unused_handler=DropUnused(), consumed_through_step=through)
    seconds = time.perf_counter() - t0
    n = buf.queue_size
    buf.close()
    return seconds, n


def timed(store: Store, through: int, backlog: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        seconds, n = reopen(store, through)
        assert n == backlog, f"reopen served {n} groups, expected the backlog of {backlog}"
        times.append(seconds)
    return statistics.median(times)


def index_memory(store: Store, through: int, backlog: int, per_object: int, consumed: int) -> dict:
    """Python memory a reopened buffer holds per buffered group (tracemalloc), split into the objects'
    bytes it keeps (each group's rows are zero-copy Arrow views over its object's bytes) and the index
    itself (entries, id maps, per-object sets)."""
    tracemalloc.start()
    buf = DurableBuffer.open(store, capacity_groups=10**7, unused_handler=DropUnused(), consumed_through_step=through)
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    buf.close()
    first = consumed // per_object  # the first object holding backlog groups
    sizes = [n for k, n in store.list_sizes(O.GROUPS).items() if (O.split_group_key(k) or ("", -1))[1] >= first]
    payload = sum(sizes) / (consumed + backlog - first * per_object)  # per group in those objects
    return {"python_bytes_per_group": traced / backlog, "object_bytes_per_group": payload,
            "index_bytes_per_group": traced / backlog - payload}


def compact_in_place(store: Store, through: int, delete: bool) -> None:
    """The product's compaction, as the checkpointer runs it after the checkpoint of `through`."""
    with DurableBuffer.open(store, capacity_groups=10**7, unused_handler=DropUnused(),
                            consumed_through_step=through) as buf:
        buf.compact(through, delete_consumed_objects=delete)


def bench_store(root_uri: str, consumed: int, backlog: int, args) -> dict:
    store = Store(root_uri)
    t0 = time.perf_counter()
    last = lay_out(store, consumed + backlog, consumed, args.groups_per_object, args.step_groups)
    layout_s = time.perf_counter() - t0
    row = {"consumed": consumed, "backlog": backlog, "manifests": last + 1,
           "objects": -(-(consumed + backlog) // args.groups_per_object), "layout_seconds": layout_s}
    row["history_s"] = timed(store, last, backlog, args.repeats)
    compact_in_place(store, last, delete=False)
    row["compacted_s"] = timed(store, last, backlog, args.repeats)
    row["memory"] = index_memory(store, last, backlog, args.groups_per_object, consumed)
    compact_in_place(store, last, delete=True)
    row["objects_after_retention"] = len(store.list(O.GROUPS))
    row["compacted_retention_s"] = timed(store, last, backlog, args.repeats)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--consumed", type=int, default=95_000)
    ap.add_argument("--backlogs", default="5000,10000")
    ap.add_argument("--groups-per-object", type=int, default=32)
    ap.add_argument("--step-groups", type=int, default=32)
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--repeats", type=int, default=3)
    add_results_flag(ap, "resume")
    args = ap.parse_args(argv)
    results, rows = ResultsFile("resume", vars(args)), []
    server = None
    try:
        for kind in args.stores.split(","):
            for backlog in map(int, args.backlogs.split(",")):
                tmp = tempfile.mkdtemp(prefix="miles-resume-")
                if kind == "s3":
                    if server is None:
                        server, bucket = open_s3()
                    root = f"{bucket}/resume-{backlog}"
                else:
                    root = f"file://{tmp}/run"
                row = {"store": kind, **bench_store(root, args.consumed, backlog, args)}
                rows.append(row)
                print(f"{kind:4s} consumed={row['consumed']} backlog={backlog:6d}: history {row['history_s']:.2f}s "
                      f"({row['manifests']} manifests, {row['objects']} objects) | compacted {row['compacted_s']:.2f}s"
                      f" | +retention {row['compacted_retention_s']:.2f}s ({row['objects_after_retention']} "
                      f"objects left) | memory {row['memory']['python_bytes_per_group']:.0f} B per buffered group "
                      f"({row['memory']['object_bytes_per_group']:.0f} B its rows, "
                      f"{row['memory']['index_bytes_per_group']:.0f} B index)", flush=True)
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
    return results.write(args.results, figures_of(rows), rows)


def figures_of(rows: list[dict]) -> dict:
    """Per store and backlog: each reopen's median seconds, and the history's cost over the compacted one."""
    figures = {}
    for r in rows:
        key = f"{r['store']}_backlog_{r['backlog']}"
        figures |= {f"{key}_history_s": r["history_s"], f"{key}_compacted_s": r["compacted_s"],
                    f"{key}_compacted_retention_s": r["compacted_retention_s"],
                    f"{key}_ratio_history_over_compacted": r["history_s"] / r["compacted_s"],
                    f"{key}_index_bytes_per_group": r["memory"]["index_bytes_per_group"]}
    return figures


if __name__ == "__main__":
    main()
