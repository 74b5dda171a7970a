"""Durable buffer throughput against raw writes of the same bytes to the same store (DESIGN §6.2).

    .venv/bin/python bench/buffer.py [--groups 400] [--producers 4] [--stores file,s3]

For each store (a local file:// directory, and a SeaweedFS S3 server started here):
- raw: `producers` threads write every group's Arrow IPC bytes (serialized beforehand, untimed)
  as one object each with Store.put_bytes;
- buffer: `producers` threads `put` the same groups (serialization, coalescing and commit
  included) while one trainer thread `get`s them and records consumption every 32 groups;
- naive: the same threads serialize each group and write it as its own object (informational);
- ratio = buffer groups/s / raw groups/s (target >= 0.8), p50/p99 put latency.
Then the in-memory index cost: a buffer reopened over N committed groups, Python bytes per group
(tracemalloc) and Arrow payload bytes per group (rows held until get).
Groups: 8 samples x ~1k tokens (prompt 128, response 700-1024) with log-probs and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402

from miles_core.buffer import DropUnused, DurableBuffer  # noqa: E402
from miles_core.samples import Group, Sample, SampleStatus, groups_to_ipc  # noqa: E402
from miles_core.storage import Store  # noqa: E402

STEP_GROUPS = 32


def realistic_group(i: int, rng: random.Random) -> Group:
    gid = f"bench-{i:06d}"
    samples = []
    for j in range(8):
        n = rng.randrange(700, 1025)
        version = 10 + i // 64
        samples.append(Sample(
            group_id=gid, prompt_index=i, sample_index=j,
            prompt_ids=[rng.randrange(150_000) for _ in range(128)],
            response_ids=[rng.randrange(150_000) for _ in range(n)],
            response_logprobs=[-rng.random() * 4 for _ in range(n)],
            loss_mask=[1] * n,
            token_versions=[version] * (n // 2) + [version + 1] * (n - n // 2),
            reward=float(rng.random() < 0.5), status=SampleStatus.COMPLETED, finish_reason="stop",
            label=json.dumps("42"), metadata=json.dumps({"epoch": 0, "position": i}),
            generation_seconds=1.5))
    return Group(gid, i, samples)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_threads(n: int, target) -> None:
    threads = [threading.Thread(target=target, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def bench_raw(store: Store, blobs: list[bytes], producers: int) -> float:
    def worker(k):
        for i in range(k, len(blobs), producers):
            store.put_bytes(f"raw/{i:08d}.arrow", blobs[i])

    t0 = time.perf_counter()
    run_threads(producers, worker)
    return len(blobs) / (time.perf_counter() - t0)


def bench_naive(store: Store, groups: list[Group], producers: int) -> float:
    """The obvious durable put: serialize each group and write it as its own object."""
    def worker(k):
        for i in range(k, len(groups), producers):
            store.put_bytes(f"naive/{i:08d}.arrow", groups_to_ipc([groups[i]]))

    t0 = time.perf_counter()
    run_threads(producers, worker)
    return len(groups) / (time.perf_counter() - t0)


def bench_buffer(store: Store, groups: list[Group], producers: int, coalesce: float) -> dict:
    buf = DurableBuffer.open(store, capacity_groups=2 * STEP_GROUPS, unused_handler=DropUnused(),
                             coalesce_seconds=coalesce, consumed_through_step=-1)
    latencies: list[float] = []
    lock = threading.Lock()

    def producer(k):
        mine = []
        for i in range(k, len(groups), producers):
            t = time.perf_counter()
            buf.put(groups[i])
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)

    def trainer():
        ids, step = [], 0
        for _ in range(len(groups)):
            ids.append(buf.get(current_version=12).group_id)
            if len(ids) == STEP_GROUPS:
                buf.record_consumed(step, ids)
                ids, step = [], step + 1
        if ids:
            buf.record_consumed(step, ids)

    t0 = time.perf_counter()
    consumer = threading.Thread(target=trainer)
    consumer.start()
    run_threads(producers, producer)
    consumer.join()
    elapsed = time.perf_counter() - t0
    metrics = buf.get_metrics()
    buf.close()
    objects = len(store.list("buffer/groups/"))
    return {"groups_per_s": len(groups) / elapsed, "p50": percentile(latencies, 0.5),
            "p99": percentile(latencies, 0.99), "objects": objects, "bytes": metrics["rollout/fully_async/bytes_written"]}


def bench_index_memory(store: Store, groups: list[Group]) -> dict:
    with DurableBuffer.open(store, capacity_groups=len(groups), unused_handler=DropUnused(), coalesce_seconds=0.0,
                            consumed_through_step=-1) as buf:
        for g in groups:
            buf.put(g)
    arrow0 = pa.total_allocated_bytes()
    tracemalloc.start()
    buf = DurableBuffer.open(store, capacity_groups=len(groups), unused_handler=DropUnused(), consumed_through_step=-1)
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # Groups found on reopen are held as zero-copy Arrow slices of the object bytes read back
    # (traced as Python bytes), so the payload is the objects' size; the rest is the index.
    payload = sum(store.list_sizes("buffer/groups/").values())
    arrow_pool = pa.total_allocated_bytes() - arrow0
    n = buf.queue_size
    buf.close()
    return {"groups": n, "index_bytes_per_group": max(0, traced + arrow_pool - payload) / n,
            "payload_bytes_per_group": payload / n}


def open_s3():
    from tests.support.seaweed import start_seaweed

    server = start_seaweed()
    os.environ.update(server.env())
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=server.endpoint)
    fs.mkdir("miles-bench")
    return server, "s3://miles-bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--coalesce-seconds", type=float, default=0.0)
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each measurement (shared CPUs are noisy)")
    args = ap.parse_args()

    rng = random.Random(0)
    t = time.perf_counter()
    groups = [realistic_group(i, rng) for i in range(args.groups)]
    blobs = [groups_to_ipc([g]) for g in groups]
    mb = sum(map(len, blobs)) / 1e6
    print(f"{args.groups} groups, {mb:.1f} MB of Arrow ({mb * 1e3 / args.groups:.0f} KB/group), "
          f"{args.producers} producer threads, coalesce {args.coalesce_seconds}s (built in {time.perf_counter() - t:.1f}s)")

    tmp = tempfile.mkdtemp(prefix="miles-bench-buffer-")
    server = None
    results = {}
    try:
        for kind in args.stores.split(","):
            if kind == "file":
                base = f"file://{tmp}"
            elif kind == "s3":
                server, base = open_s3()
            else:
                raise SystemExit(f"--stores: unknown store {kind!r}; use file and/or s3")
            raw = max(bench_raw(Store(f"{base}/{uuid.uuid4().hex[:8]}"), blobs, args.producers)
                      for _ in range(args.repeats))
            buf = max((bench_buffer(Store(f"{base}/{uuid.uuid4().hex[:8]}"), groups, args.producers,
                                    args.coalesce_seconds) for _ in range(args.repeats)),
                      key=lambda r: r["groups_per_s"])
            naive = max(bench_naive(Store(f"{base}/{uuid.uuid4().hex[:8]}"), groups, args.producers)
                        for _ in range(args.repeats))
            ratio = buf["groups_per_s"] / raw
            results[kind] = ratio
            print(f"[{kind}] raw    {raw:8.1f} groups/s  {raw * mb / args.groups:6.1f} MB/s  ({args.groups} objects)")
            print(f"[{kind}] buffer {buf['groups_per_s']:8.1f} groups/s  {buf['groups_per_s'] * mb / args.groups:6.1f} MB/s"
                  f"  ({buf['objects']} objects)  put p50 {buf['p50'] * 1e3:.1f} ms  p99 {buf['p99'] * 1e3:.1f} ms")
            print(f"[{kind}] naive  {naive:8.1f} groups/s  (serialize + one object per group, same threads)")
            print(f"[{kind}] ratio buffer/raw = {ratio:.2f}  (target >= 0.8: {'ok' if ratio >= 0.8 else 'BELOW'})"
                  f"   buffer/naive = {buf['groups_per_s'] / naive:.2f}")
        mem = bench_index_memory(Store(f"file://{tmp}/index"), groups[:200])
        print(f"index after reopen over {mem['groups']} groups: {mem['index_bytes_per_group']:.0f} B/group "
              f"(index), plus {mem['payload_bytes_per_group'] / 1e3:.0f} KB/group of Arrow rows held until get")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
