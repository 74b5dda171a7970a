"""Weight-sync benchmark, both transports, each against a raw transfer of the same bytes in the same run.

    .venv/bin/python bench/weights.py [--models tiny,smollm] [--transports store,distributed] [--repeats 3]

For each model (the embedded default builtin:tiny-gpt, and a random Llama the size of
SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152) it
runs the real path: a Megatron-core Trainer on CPU and `WeightSync.push` into the project's CPU
engine server.

- store: export the safetensors snapshot to a file:// run root, pause the engine (served in this
  process), `update_weights_from_disk` over HTTP, resume, publish. Baseline: a raw copy of the
  snapshot's bytes (read + write + fsync of model.safetensors).
- distributed: `DistributedWeightTransport` over gloo (the trainer's HF tensors, pause, per bucket
  of --bucket-mib an `/update_weights_from_distributed` call with a broadcast from rank 0, resume)
  into an engine server process (as in production: its own process, so the broadcast crosses a
  socket). The first push also forms the group and is reported apart; the median is over the
  pushes after it. Baseline: a raw gloo broadcast of the same number of bytes (one flat uint8
  tensor) from this process to a second process through the same `init_custom_process_group`,
  timed until the receiver's one-element acknowledgement arrives: the transfer alone, without the
  HF gather, the HTTP calls, or the engine's model rebuild.

Printed: ratio = baseline seconds / push seconds (store target >= 0.5), and the pause the engine sees.
Written to bench/results/weights.json (`--results`): one row per model and transport (`push_s`,
`pause_s`, `export_s`, `baseline_s`, `ratio`); bench/async_speedup.py reads its push costs from it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402


def make_checkpoint(name: str, out: str) -> str:
    from miles_core.models.builtin import digit_tokenizer, materialize_checkpoint

    if name == "tiny":
        return materialize_checkpoint("builtin:tiny-gpt", 1, out)
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    digit_tokenizer().save_pretrained(out)  # any tokenizer: the engine needs one to start
    return out


def raw_copy_seconds(src: str, dst: str) -> float:
    t = time.perf_counter()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 16 << 20)
        fo.flush()
        os.fsync(fo.fileno())
    return time.perf_counter() - t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def bench_store(name: str, repeats: int, work: str, **_) -> dict:
    from miles_core.config.sections import TrainSection
    from miles_core.engines.client import EngineClient
    from miles_core.engines.cpu_server import CpuEngineServer, serve
    from miles_core.storage import Store
    from miles_core.train.trainer import Trainer
    from miles_core.weights.sync import StoreWeightTransport, WeightSync

    hf = make_checkpoint(name, os.path.join(work, f"{name}-hf"))
    trainer = Trainer(TrainSection(), hf)
    server = CpuEngineServer(hf)
    port = free_port()
    runner = await serve(server, "127.0.0.1", port)
    store = Store(os.path.join(work, f"{name}-run"))
    pushes, pauses, copies = [], [], []
    try:
        async with EngineClient([f"http://127.0.0.1:{port}"], control_timeout_seconds=600) as client:
            sync = WeightSync([client], StoreWeightTransport(trainer, store), lambda v: None, "retract")
            for k in range(repeats):
                res = await sync.push(k)
                pushes.append(res.total_seconds)
                pauses.append(res.pause_seconds)
                src = store.local_path(f"snapshots/step_{k:08d}/model.safetensors")
                copies.append(raw_copy_seconds(src, os.path.join(work, f"{name}-copy.safetensors")))
            assert (await client.get_weight_version()) == {client.urls[0]: repeats}
    finally:
        await runner.cleanup()
        trainer.close()
    nbytes = os.path.getsize(store.local_path("snapshots/step_00000000/model.safetensors"))
    push, copy = statistics.median(pushes), statistics.median(copies)
    return {"model": name, "transport": "store", "bytes": nbytes, "push_s": push,
            "pause_s": statistics.median(pauses), "export_s": statistics.median(r.export_seconds for r in sync.history),
            "baseline_s": copy, "baseline": "raw copy", "ratio": copy / push}


_RECEIVER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from miles_core.weights.distributed import init_custom_process_group
port, nbytes, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=300), 2, 1, group_name="raw")
buf, ack = torch.empty(nbytes, dtype=torch.uint8), torch.ones(1)
for _ in range(repeats):
    dist.broadcast(buf, src=0, group=pg)
    dist.broadcast(ack, src=1, group=pg)
dist.destroy_process_group(pg)
"""


def raw_broadcast_seconds(nbytes: int, repeats: int) -> list[float]:
    """Rank 0 (here) broadcasts `nbytes` to a second process over gloo, `repeats` times; seconds until acked."""
    import subprocess
    from datetime import timedelta

    import torch.distributed as dist

    from miles_core.weights.distributed import destroy_custom_process_group, init_custom_process_group

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port), str(nbytes), str(repeats)], env=env)
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=300), 2, 0, group_name="raw")
    buf, ack, out = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(1), []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            dist.broadcast(buf, src=0, group=pg)
            dist.broadcast(ack, src=1, group=pg)
            out.append(time.perf_counter() - t)
    finally:
        destroy_custom_process_group(pg)
        proc.wait(timeout=60)
    return out


async def bench_distributed(name: str, repeats: int, work: str, bucket_bytes: int = 512 << 20) -> dict:
    from miles_core.config.sections import TrainSection
    from miles_core.engines.client import EngineClient
    from miles_core.engines.launcher import EngineLaunchSpec, EngineServer
    from miles_core.train.trainer import Trainer
    from miles_core.weights.distributed import DistributedWeightTransport
    from miles_core.weights.sync import WeightSync

    hf = make_checkpoint(name, os.path.join(work, f"{name}-hf"))
    trainer = Trainer(TrainSection(), hf)
    server = EngineServer(EngineLaunchSpec("cpu", hf, startup_timeout_seconds=300), f"bench-{name}",
                          log_dir=os.path.join(work, "logs"))
    server.start()
    transport = DistributedWeightTransport(trainer.hf_state_dict, [server.url], master_address="127.0.0.1",
                                           backend="gloo", bucket_bytes=bucket_bytes, timeout_seconds=600,
                                           engine_generations=lambda: [server.restarts],
                                           restart_engine=lambda i: server.restart())
    try:
        async with EngineClient([server.url], control_timeout_seconds=600) as client:
            sync = WeightSync([client], transport, lambda v: None, "retract")
            for k in range(repeats + 1):
                await sync.push(k)
            assert (await client.model_info(server.url))["weight_version"] == str(repeats + 1)
            assert all(h["attempts"] == 1 for h in transport.history)
        await transport.close()
    finally:
        server.stop()
    nbytes = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
    trainer.close()
    first, rest = sync.history[0], sync.history[1:]
    push = statistics.median(r.total_seconds for r in rest)
    raw = statistics.median(raw_broadcast_seconds(nbytes, repeats))
    return {"model": name, "transport": "distributed", "bytes": nbytes, "push_s": push,
            "pause_s": statistics.median(r.pause_seconds for r in rest),
            "export_s": statistics.median(r.export_seconds for r in rest), "first_push_s": first.total_seconds,
            "buckets": len(transport.history[-1]["buckets"]), "baseline_s": raw, "baseline": "raw gloo broadcast",
            "ratio": raw / push}


def print_row(r: dict) -> None:
    store = r["transport"] == "store"
    extra = (f"export {r['export_s']:.3f}s" if store else
             f"gather {r['export_s']:.3f}s, {r['buckets']} bucket(s), first push with group "
             f"formation {r['first_push_s']:.3f}s")
    print(f"{r['model']:>7} {r['transport']:>11}: {r['bytes'] / 2**20:8.1f} MiB  push {r['push_s']:.3f}s "
          f"({extra}, engine pause {r['pause_s']:.3f}s)  {r['baseline']} {r['baseline_s']:.3f}s  "
          f"ratio {r['ratio']:.2f}" + (" (target >= 0.5)" if store else ""), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm")
    ap.add_argument("--transports", default="store,distributed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-mib", type=float, default=512.0, help="Bucket size of the distributed push "
                    "(--update-weight-buffer-size; default 512 MiB).")
    add_results_flag(ap, "weights")
    args = ap.parse_args(argv)
    results = ResultsFile("weights", vars(args))
    torch.set_num_threads(args.threads)
    print("CPU: the distributed transport runs over gloo (NCCL needs CUDA + SGLang)" if not torch.cuda.is_available()
          else "CUDA present; this bench still measures gloo and the CPU engine")
    benches = {"store": bench_store, "distributed": bench_distributed}
    rows = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-weights-") as work:
        for name in args.models.split(","):
            for transport in args.transports.split(","):
                rows.append(asyncio.run(benches[transport](name, args.repeats, work,
                                                           bucket_bytes=int(args.bucket_mib * 2**20))))
                print_row(rows[-1])
    figures = {f"{r['model']}_{r['transport']}_{k}": r[k] for r in rows for k in ("push_s", "pause_s", "ratio")}
    return results.write(args.results, figures, rows)


if __name__ == "__main__":
    main()
