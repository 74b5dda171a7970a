"""Durable buffer throughput against raw writes of the same objects to the same store (docs/data-path.md).

    .venv/bin/python bench/buffer.py [--groups 400] [--producers 8] [--stores file,s3] [--index-groups 100000]

For each store (a local file:// directory, and a SeaweedFS S3 server started here), `--repeats`
rounds, each of:
- buffer: `producers` threads `put` the groups (serialization, coalescing and commit included)
  while one trainer thread `get`s them and records consumption every 32 groups;
- raw: the same number of threads write the objects that buffer round committed (their bytes read
  back beforehand, untimed), one Store.put_bytes each, so the baseline writes the same count and
  sizes of objects and pays none of the buffer's work: ratio = raw seconds / buffer seconds
  (= buffer groups/s over raw groups/s; target >= 0.8);
- naive: the same threads serialize each group and write it as its own object (informational:
  the obvious durable put, without coalescing).
Printed: medians over the rounds of groups/s, tokens/s (prompt + response, and response only),
MB/s, put p50/p99, the objects written and their sizes, and the ratios.
Then the in-memory index: a buffer reopened over `--index-groups` committed groups (file://; the
index is the same whatever the store) laid out directly with miles_core.buffer.objects in
objects of `--index-groups-per-object`, small groups (2 samples x 8 + 8 tokens: the index does
not grow with a group's size, its rows are the object bytes), Python bytes per group by
tracemalloc, split into the object bytes the rows are zero-copy views of and the rest (the index).
Throughput groups: 8 samples x ~1k tokens (prompt 128, response 700-1024) with log-probs and versions.
Written to bench/results/buffer.json (`--results`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.buffer import DropUnused, DurableBuffer  # noqa: E402
from miles_core.buffer import objects as O  # noqa: E402
from miles_core.samples import Group, Sample, SampleStatus, groups_to_batch, groups_to_ipc  # noqa: E402
from miles_core.storage import Store  # noqa: E402

STEP_GROUPS = 32
WRITER = "w0000000000001-bench000"  # the writer id of objects laid out directly


# ----------------------------------------------------------------------------- groups


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


def small_group(i: int) -> Group:
    """2 samples x (8 prompt + 8 response) tokens: the index's cost per group, not the payload's."""
    gid = f"r{i:07d}"
    samples = [Sample(gid, i, j, list(range(8)), list(range(8)), [-0.5] * 8, [1] * 8, [3] * 8, 1.0,
                      SampleStatus.COMPLETED, "stop", "{}", json.dumps({"epoch": 0, "position": i}))
               for j in range(2)]
    return Group(gid, i, samples)


def write_committed(store: Store, total: int, per_object: int, threads: int = 16) -> int:
    """Commit groups 0..total-1 (small_group) as the buffer lays them out, `per_object` groups (one record
    batch each) to an object of writer WRITER; returns the number of objects."""
    def write_object(seq: int) -> None:
        ids = range(seq * per_object, min(total, (seq + 1) * per_object))
        store.put_bytes(O.group_key(WRITER, seq), O.encode_object([groups_to_batch([small_group(i)]) for i in ids]))

    objects = -(-total // per_object)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write_object, range(objects)))
    return objects


# ----------------------------------------------------------------------------- throughput


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
    """Seconds for `producers` threads to write `blobs`, one object each."""
    def worker(k):
        for i in range(k, len(blobs), producers):
            store.put_bytes(f"raw/{i:08d}.arrow", blobs[i])

    t0 = time.perf_counter()
    run_threads(producers, worker)
    return time.perf_counter() - t0


def bench_naive(store: Store, groups: list[Group], producers: int) -> float:
    """Seconds for the obvious durable put: serialize each group and write it as its own object."""
    def worker(k):
        for i in range(k, len(groups), producers):
            store.put_bytes(f"naive/{i:08d}.arrow", groups_to_ipc([groups[i]]))

    t0 = time.perf_counter()
    run_threads(producers, worker)
    return time.perf_counter() - t0


def bench_buffer(store: Store, groups: list[Group], producers: int, coalesce: float) -> dict:
    """Seconds for `producers` threads to put every group while a trainer gets them; put latencies."""
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
    seconds = time.perf_counter() - t0
    buf.close()
    return {"seconds": seconds, "p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)}


def buffer_objects(store: Store) -> list[bytes]:
    """The bytes of every object the buffer committed (read back untimed: the raw baseline's input)."""
    keys = sorted(store.list_sizes(O.GROUPS))
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(store.get_bytes, keys))


def one_round(base: str, groups: list[Group], args) -> dict:
    """The buffer, then raw writes of the very objects it committed, then naive: one round, one store."""
    store = Store(f"{base}/{uuid.uuid4().hex[:8]}")
    buf = bench_buffer(store, groups, args.producers, args.coalesce_seconds)
    blobs = buffer_objects(store)
    raw = bench_raw(Store(f"{base}/{uuid.uuid4().hex[:8]}"), blobs, args.producers)
    naive = bench_naive(Store(f"{base}/{uuid.uuid4().hex[:8]}"), groups, args.producers)
    sizes = sorted(map(len, blobs))
    return {"buffer_s": buf["seconds"], "raw_s": raw, "naive_s": naive, "put_p50_s": buf["p50"],
            "put_p99_s": buf["p99"], "objects": len(blobs), "object_bytes_median": statistics.median(sizes),
            "object_bytes_max": sizes[-1], "bytes": sum(sizes)}


def throughput(kind: str, base: str, groups: list[Group], args) -> dict:
    """Medians over `repeats` rounds on one store."""
    rounds = [one_round(base, groups, args) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    n, tokens, response = len(groups), *group_tokens(groups)
    row = {"kind": "throughput", "store": kind, "groups": n, "rounds": rounds, **med,
           "buffer_groups_per_s": n / med["buffer_s"], "raw_groups_per_s": n / med["raw_s"],
           "naive_groups_per_s": n / med["naive_s"], "buffer_tokens_per_s": tokens / med["buffer_s"],
           "buffer_response_tokens_per_s": response / med["buffer_s"],
           "buffer_mb_per_s": med["bytes"] / 1e6 / med["buffer_s"],
           "raw_mb_per_s": med["bytes"] / 1e6 / med["raw_s"]}
    row["ratio"] = statistics.median(r["raw_s"] / r["buffer_s"] for r in rounds)
    row["ratio_naive"] = statistics.median(r["naive_s"] / r["buffer_s"] for r in rounds)
    print_throughput(row, args.repeats)
    return row


def group_tokens(groups: list[Group]) -> tuple[int, int]:
    """(prompt + response tokens, response tokens) over every sample."""
    samples = [s for g in groups for s in g.samples]
    response = sum(len(s.response_ids) for s in samples)
    return sum(len(s.prompt_ids) for s in samples) + response, response


def print_throughput(r: dict, repeats: int) -> None:
    k = r["store"]
    print(f"[{k}] buffer {r['buffer_groups_per_s']:8.1f} groups/s  {r['buffer_tokens_per_s'] / 1e3:7.1f}k tokens/s "
          f"({r['buffer_response_tokens_per_s'] / 1e3:.1f}k response)  {r['buffer_mb_per_s']:6.1f} MB/s  "
          f"put p50 {r['put_p50_s'] * 1e3:.1f} ms  p99 {r['put_p99_s'] * 1e3:.1f} ms")
    print(f"[{k}] raw    {r['raw_groups_per_s']:8.1f} groups/s  {r['raw_mb_per_s']:6.1f} MB/s  (the buffer's "
          f"{r['objects']:.0f} objects, median {r['object_bytes_median'] / 1e6:.2f} MB, max "
          f"{r['object_bytes_max'] / 1e6:.2f} MB)")
    print(f"[{k}] naive  {r['naive_groups_per_s']:8.1f} groups/s  (serialize + one object per group, same threads)")
    print(f"[{k}] ratio raw s / buffer s = {r['ratio']:.2f}  (target >= 0.8: {'ok' if r['ratio'] >= 0.8 else 'BELOW'})"
          f"   naive s / buffer s = {r['ratio_naive']:.2f}   (medians of {repeats} rounds)", flush=True)


# ----------------------------------------------------------------------------- index memory


def index_memory(store: Store, groups: int, per_object: int) -> dict:
    """Python bytes per group of a buffer reopened over `groups` committed groups (tracemalloc)."""
    t0 = time.perf_counter()
    objects = write_committed(store, groups, per_object)
    layout_s = time.perf_counter() - t0
    arrow0 = pa.total_allocated_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    buf = DurableBuffer.open(store, capacity_groups=groups, unused_handler=DropUnused(), consumed_through_step=-1)
    reopen_s = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # Groups found on reopen are held as zero-copy Arrow slices of the object bytes read back
    # (traced as Python bytes), so the payload is the objects' size; the rest is the index.
    payload = sum(store.list_sizes(O.GROUPS).values())
    held = traced + pa.total_allocated_bytes() - arrow0
    n = buf.queue_size
    buf.close()
    row = {"kind": "index_memory", "store": "file", "groups": n, "objects": objects, "groups_per_object": per_object,
           "group": "2 samples x (8 + 8) tokens", "layout_seconds": layout_s, "reopen_seconds_traced": reopen_s,
           "python_bytes_per_group": held / n, "object_bytes_per_group": payload / n,
           "index_bytes_per_group": max(0, held - payload) / n}
    print(f"index after reopen over {n} groups ({objects} objects of {per_object}): "
          f"{row['index_bytes_per_group']:.0f} B/group (index), plus {row['object_bytes_per_group']:.0f} B/group "
          f"of object bytes its rows view (reopen {reopen_s:.1f} s under tracemalloc)", flush=True)
    return row


# ----------------------------------------------------------------------------- main


def open_s3():
    from tests.support.seaweed import start_seaweed

    server = start_seaweed()
    os.environ.update(server.env())
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=server.endpoint)
    fs.mkdir("miles-bench")
    return server, "s3://miles-bench"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--coalesce-seconds", type=float, default=0.0)
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per store; medians are reported")
    ap.add_argument("--index-groups", type=int, default=100_000, help="committed groups of the index measure")
    ap.add_argument("--index-groups-per-object", type=int, default=32)
    add_results_flag(ap, "buffer")
    args = ap.parse_args(argv)
    unknown = set(args.stores.split(",")) - {"file", "s3"}
    if unknown:
        ap.error(f"--stores: unknown store(s) {', '.join(sorted(unknown))}; use file and/or s3")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = ResultsFile("buffer", vars(args))
    rng = random.Random(0)
    t = time.perf_counter()
    groups = [realistic_group(i, rng) for i in range(args.groups)]
    mb = sum(len(groups_to_ipc([g])) for g in groups[:20]) / min(20, len(groups)) / 1e3
    print(f"{args.groups} groups (~{mb:.0f} KB of Arrow each), {args.producers} producer threads, coalesce "
          f"{args.coalesce_seconds}s (built in {time.perf_counter() - t:.1f}s)")
    tmp = tempfile.mkdtemp(prefix="miles-bench-buffer-")
    server, rows = None, []
    try:
        for kind in args.stores.split(","):
            if kind == "s3":
                server, base = open_s3()
            else:
                base = f"file://{tmp}"
            rows.append(throughput(kind, base, groups, args))
        rows.append(index_memory(Store(f"file://{tmp}/index"), args.index_groups, args.index_groups_per_object))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {f"{r['store']}_{k}": r[k] for r in rows if r["kind"] == "throughput"
               for k in ("ratio", "ratio_naive", "buffer_groups_per_s", "buffer_tokens_per_s", "raw_groups_per_s")}
    figures |= {"index_groups": rows[-1]["groups"], "index_bytes_per_group": rows[-1]["index_bytes_per_group"],
                "index_python_bytes_per_group": rows[-1]["python_bytes_per_group"]}
    print("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in figures.items() if k.endswith("_ratio")))
    return results.write(args.results, figures, rows)


if __name__ == "__main__":
    main()
