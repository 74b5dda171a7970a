"""Weight-sync benchmark: snapshot export + engine reload vs a raw copy of the same bytes.

    .venv/bin/python bench/weights.py [--models tiny,smollm] [--repeats 3]

For each model (the embedded default builtin:tiny-gpt, and a random Llama the size of
SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152) it
runs the real path: a Megatron-core Trainer on CPU, `WeightSync.push` (export the safetensors
snapshot to a file:// run root, pause the engine, `update_weights_from_disk` on the project's CPU
engine server over HTTP, resume, publish). The baseline, measured in the same run, is a raw
copy of the snapshot's bytes (read + write + fsync of model.safetensors). Printed:
ratio = baseline seconds / push seconds (target >= 0.5), and the pause the engine sees.
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


async def bench_model(name: str, repeats: int, work: str) -> dict:
    from miles_core.config.sections import TrainSection
    from miles_core.engines.client import EngineClient
    from miles_core.engines.cpu_server import CpuEngineServer, serve
    from miles_core.storage import Store
    from miles_core.train.trainer import Trainer
    from miles_core.weights.sync import DiskWeightTransport, WeightSync

    hf = make_checkpoint(name, os.path.join(work, f"{name}-hf"))
    trainer = Trainer(TrainSection(), hf)
    server = CpuEngineServer(hf)
    port = free_port()
    runner = await serve(server, "127.0.0.1", port)
    store = Store(os.path.join(work, f"{name}-run"))
    pushes, pauses, copies = [], [], []
    try:
        async with EngineClient([f"http://127.0.0.1:{port}"], control_timeout_seconds=600) as client:
            sync = WeightSync([client], DiskWeightTransport(trainer, store), lambda v: None, "retract")
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
    return {"model": name, "bytes": nbytes, "push_s": push, "pause_s": statistics.median(pauses),
            "export_s": statistics.median(r.export_seconds for r in sync.history), "raw_copy_s": copy,
            "ratio": copy / push}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("no GPU in this environment: disk transport only (the NCCL path needs CUDA + SGLang)" if not
          torch.cuda.is_available() else "CUDA present; this bench still measures the disk transport")
    with tempfile.TemporaryDirectory(prefix="miles-bench-weights-") as work:
        for name in args.models.split(","):
            r = asyncio.run(bench_model(name, args.repeats, work))
            print(f"{r['model']:>7}: {r['bytes'] / 2**20:8.1f} MiB  push {r['push_s']:.3f}s "
                  f"(export {r['export_s']:.3f}s, engine pause {r['pause_s']:.3f}s)  raw copy {r['raw_copy_s']:.3f}s  "
                  f"ratio {r['ratio']:.2f} (target >= 0.5)")


if __name__ == "__main__":
    main()
