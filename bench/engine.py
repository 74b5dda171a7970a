"""CPU engine throughput against transformers `generate` on the same weights, one core each.

    .venv/bin/python bench/engine.py [--repeats 5] [--batch 32] [--bucket-size 16] [--threads 1] [--no-http]

1. Long tail (compute matters): builtin:tiny-llama widened to hidden 256, 4 layers, 4 heads.
   `batch` requests, prompts of 4-8 tokens, max_new_tokens ~ lognormal (median 12, sigma 0.9,
   clipped to [1, 120]), EOS ignored so both sides generate exactly the requested lengths, sampling
   at temperature 1. transformers generates the batch at once (left-padded), so every row runs
   until the longest is done; the CPU engine batches continuously and drops finished requests.
   A second, length-bucketed transformers baseline takes the padding away the usual way: sort the
   requests by requested length, cut them into buckets of `--bucket-size` neighbours (buckets whose
   longest requests are equal are merged, so equal lengths stay one batch), and `generate` each
   bucket to its own longest, one bucket after another.
   Throughput counts only the requested tokens (useful tokens / wall seconds).
   The CPU engine is timed twice: in-process (`BatchEngine`, compute only) and end to end over
   HTTP (a real server process, `EngineClient`, streaming with per-token versions).
2. The embedded default (docs/quickstart.md): builtin:tiny-gpt (2 layers, width 128, 13-token vocab),
   32 prompts x 8 samples = 256 requests, prompt 5 tokens, <= 5 new tokens: seconds per batch.

Prints each throughput and the ratio engine / transformers against both baselines (target >= 2x
on the long tail against the padded one). Medians of `repeats` runs, engine and both baselines
interleaved (the machine is shared); no timed asserts here, this is informational. Written to
bench/results/engine.json (`--results`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.engines.batching import BatchEngine, Request, SamplingParams  # noqa: E402
from miles_core.engines.model import CausalLM  # noqa: E402
from miles_core.models.builtin import PAD_ID, SEP_ID, materialize_checkpoint  # noqa: E402


def workload(batch: int, seed: int, tail: bool) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        if tail:
            prompt = [rng.randrange(10) for _ in range(rng.randint(3, 7))] + [SEP_ID]
            n = max(1, min(120, round(rng.lognormvariate(2.5, 0.9))))
        else:
            prompt, n = [rng.randrange(10) for _ in range(4)] + [SEP_ID], 5
        out.append((prompt, n))
    return out


def run_engine(path: str, work, seed: int) -> float:
    engine = BatchEngine(CausalLM.load(path), seed=seed)
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(work):
        engine.add(Request(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    produced = 0
    while engine.num_requests:
        produced += sum(e.token is not None for e in engine.step())
    dt = time.perf_counter() - t0
    assert produced == sum(n for _, n in work)
    return dt


def run_hf(model, work) -> float:
    width = max(len(p) for p, _ in work)
    ids = torch.full((len(work), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(work):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    longest = max(n for _, n in work)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD_ID)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + longest
    return dt


def buckets(work, size: int) -> list[list[tuple[list[int], int]]]:
    """The requests sorted by requested length, cut into runs of `size`; runs with equal longest merged."""
    ordered = sorted(work, key=lambda r: r[1])
    out: list[list[tuple[list[int], int]]] = []
    for i in range(0, len(ordered), size):
        chunk = ordered[i:i + size]
        if out and out[-1][-1][1] == chunk[-1][1]:
            out[-1].extend(chunk)
        else:
            out.append(chunk)
    return out


def run_hf_bucketed(model, work, size: int) -> float:
    """transformers `generate` over the length buckets, one after another: seconds for all of them."""
    return sum(run_hf(model, bucket) for bucket in buckets(work, size))


def padded_tokens(work, size: int | None) -> int:
    """Tokens `generate` computes: every row to its batch's longest (one batch, or the buckets)."""
    groups = [work] if size is None else buckets(work, size)
    return sum(len(b) * max(n for _, n in b) for b in groups)


async def run_http(url: str, work, repeats: int) -> float:
    """Median of `repeats` batches through one long-lived client (as the rollout worker holds one), after
    one untimed batch that opens the connection pool."""
    from miles_core.engines.client import EngineClient

    async def batch(c) -> float:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(c.generate(p, {"max_new_tokens": n, "ignore_eos": True}) for p, n in work))
        dt = time.perf_counter() - t0
        assert sum(len(r.output_ids) for r in res) == sum(n for _, n in work)
        assert all(len(set(r.token_versions)) == 1 for r in res)
        return dt

    async with EngineClient([url]) as c:
        await batch(c)
        return statistics.median([await batch(c) for _ in range(repeats)])


def bench_http(path: str, work, repeats: int) -> float:
    from miles_core.engines.launcher import EngineLaunchSpec, EngineServer

    server = EngineServer(EngineLaunchSpec("cpu", path, startup_timeout_seconds=120))
    server.start()
    try:
        return asyncio.run(run_http(server.url, work, repeats))
    finally:
        server.stop()


def measure(title: str, path: str, work, args) -> dict:
    """One case: the engine and both transformers baselines, interleaved `repeats` times; medians."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    run_engine(path, work[:4], 0)  # warm-up
    run_hf(hf, work[:4])
    times: dict[str, list[float]] = {"engine": [], "padded": [], "bucketed": []}
    for r in range(args.repeats):  # interleaved, so every side sees the same machine load
        times["engine"].append(run_engine(path, work, r))
        times["padded"].append(run_hf(hf, work))
        times["bucketed"].append(run_hf_bucketed(hf, work, args.bucket_size))
    med = {k: statistics.median(v) for k, v in times.items()}
    lens = sorted(n for _, n in work)
    row = {"case": title, "requests": len(work), "useful_tokens": sum(lens), "max_new_tokens_p50": lens[len(lens) // 2],
           "max_new_tokens_max": lens[-1], "padded_tokens": padded_tokens(work, None),
           "bucketed_tokens": padded_tokens(work, args.bucket_size), "buckets": len(buckets(work, args.bucket_size)),
           "engine_s": med["engine"], "padded_s": med["padded"], "bucketed_s": med["bucketed"],
           "ratio_vs_padded": med["padded"] / med["engine"], "ratio_vs_bucketed": med["bucketed"] / med["engine"],
           "times": times}
    if not args.no_http:
        row["http_s"] = bench_http(path, work, args.repeats)
        row["http_ratio_vs_padded"] = med["padded"] / row["http_s"]
        row["http_ratio_vs_bucketed"] = med["bucketed"] / row["http_s"]
    print_case(row)
    return row


def print_case(r: dict) -> None:
    useful = r["useful_tokens"]
    print(f"\n{r['case']}")
    print(f"  requests {r['requests']}, useful tokens {useful}, max_new_tokens p50 {r['max_new_tokens_p50']} max "
          f"{r['max_new_tokens_max']}; transformers generates {r['padded_tokens']} padded to the longest, "
          f"{r['bucketed_tokens']} in {r['buckets']} length bucket(s)")
    for side in ("padded", "bucketed"):
        seconds = r[f"{side}_s"]
        print(f"  transformers generate, {side:<9}: {useful / seconds:10.0f} tok/s  ({seconds * 1e3:8.1f} ms)")
    print(f"  CPU engine (in-proc)            : {useful / r['engine_s']:10.0f} tok/s  ({r['engine_s'] * 1e3:8.1f} ms)"
          f"   ratio {r['ratio_vs_padded']:5.2f}x vs padded, {r['ratio_vs_bucketed']:5.2f}x vs bucketed")
    if "http_s" in r:
        print(f"  CPU engine (HTTP, SSE)          : {useful / r['http_s']:10.0f} tok/s  ({r['http_s'] * 1e3:8.1f} ms)"
              f"   ratio {r['http_ratio_vs_padded']:5.2f}x vs padded, {r['http_ratio_vs_bucketed']:5.2f}x vs bucketed")
    print(f"  (medians of {len(r['times']['engine'])} interleaved runs)", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-size", type=int, default=16,
                    help="requests per length bucket of the bucketed baseline (16: the fastest of 4, 8, 16 here)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-http", action="store_true", help="skip the end-to-end HTTP measurements")
    ap.add_argument("--cases", default="tail,default", help="long tail (tail) and/or the embedded default (default)")
    add_results_flag(ap, "engine")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = ResultsFile("engine", vars(args))
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    tmp = tempfile.mkdtemp(prefix="bench-engine-")
    cases = {
        "tail": ("long tail: tiny-llama h256 x4 layers, batch %d" % args.batch, "builtin:tiny-llama",
                 dict(num_layers=4, hidden_size=256, num_heads=4), workload(args.batch, 0, tail=True)),
        "default": ("embedded default: tiny-gpt h128 x2 layers, 256 requests, 5+5 tokens", "builtin:tiny-gpt",
                    dict(num_layers=2, hidden_size=128, num_heads=4), workload(256, 1, tail=False)),
    }
    rows = []
    for key in args.cases.split(","):
        title, name, shape, work = cases[key]
        path = materialize_checkpoint(name, 0, os.path.join(tmp, name.split(":")[1]), **shape)
        rows.append({"key": key, **measure(title, path, work, args)})
    figures = {f"{r['key']}_{k}": r[k] for r in rows for k in r if "ratio" in k}
    figures |= {f"{r['key']}_{k}": r[k] for r in rows for k in ("engine_s", "padded_s", "bucketed_s")}
    return results.write(args.results, figures, rows)


if __name__ == "__main__":
    main()
