"""CPU engine throughput against transformers `generate` on the same weights, one core each.

    .venv/bin/python bench/engine.py [--repeats 3] [--batch 32] [--threads 1]

1. Long tail (compute matters): builtin:tiny-llama widened to hidden 256, 4 layers, 4 heads.
   `batch` requests, prompts of 4-8 tokens, max_new_tokens ~ lognormal (median 12, sigma 0.9,
   clipped to [1, 120]), EOS ignored so both sides generate exactly the requested lengths, sampling
   at temperature 1. transformers generates the batch at once (left-padded), so every row runs
   until the longest is done; the CPU engine batches continuously and drops finished requests.
   Throughput counts only the requested tokens (useful tokens / wall seconds).
   The CPU engine is timed twice: in-process (`BatchEngine`, compute only) and end to end over
   HTTP (a real server process, `EngineClient`, streaming with per-token versions).
2. The embedded default (DESIGN §10): builtin:tiny-gpt (2 layers, width 128, 13-token vocab),
   32 prompts x 8 samples = 256 requests, prompt 5 tokens, <= 5 new tokens: seconds per batch.

Prints each throughput and the ratio engine / transformers (target >= 2x on the long tail). Best
of `repeats` runs, engine and transformers interleaved (the machine is shared); no timed asserts
here, this is informational.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

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


async def run_http(url: str, work, repeats: int) -> float:
    """Best of `repeats` batches through one long-lived client (as the rollout worker holds one), after
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
        return min([await batch(c) for _ in range(repeats)])


def bench_http(path: str, work, repeats: int) -> float:
    from miles_core.engines.launcher import EngineLaunchSpec, EngineServer

    server = EngineServer(EngineLaunchSpec("cpu", path, startup_timeout_seconds=120))
    server.start()
    try:
        return asyncio.run(run_http(server.url, work, repeats))
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-http", action="store_true", help="skip the end-to-end HTTP measurements")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from transformers import AutoModelForCausalLM

    tmp = tempfile.mkdtemp(prefix="bench-engine-")
    cases = [
        ("long tail: tiny-llama h256 x4 layers, batch %d" % args.batch, "builtin:tiny-llama",
         dict(num_layers=4, hidden_size=256, num_heads=4), workload(args.batch, 0, tail=True)),
        ("embedded default: tiny-gpt h128 x2 layers, 256 requests, 5+5 tokens", "builtin:tiny-gpt",
         dict(num_layers=2, hidden_size=128, num_heads=4), workload(256, 1, tail=False)),
    ]
    for title, name, shape, work in cases:
        path = materialize_checkpoint(name, 0, os.path.join(tmp, name.split(":")[1]), **shape)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        useful = sum(n for _, n in work)
        lens = sorted(n for _, n in work)
        run_engine(path, work[:4], 0)  # warm-up
        run_hf(hf, work[:4])
        t_engine = t_hf = float("inf")
        for r in range(args.repeats):  # interleaved, so both sides see the same machine load
            t_engine = min(t_engine, run_engine(path, work, r))
            t_hf = min(t_hf, run_hf(hf, work))
        print(f"\n{title}")
        print(f"  requests {len(work)}, useful tokens {useful}, max_new_tokens p50 {lens[len(lens) // 2]} "
              f"max {lens[-1]}; transformers generates {len(work) * lens[-1]} (padded to the longest)")
        print(f"  transformers generate : {useful / t_hf:10.0f} tok/s  ({t_hf * 1e3:8.1f} ms)")
        print(f"  CPU engine (in-proc)  : {useful / t_engine:10.0f} tok/s  ({t_engine * 1e3:8.1f} ms)"
              f"   ratio {t_hf / t_engine:5.2f}x")
        if not args.no_http:
            t_http = bench_http(path, work, args.repeats)
            print(f"  CPU engine (HTTP, SSE): {useful / t_http:10.0f} tok/s  ({t_http * 1e3:8.1f} ms)"
                  f"   ratio {t_hf / t_http:5.2f}x")


if __name__ == "__main__":
    main()
