"""Weight-sync benchmark, both transports, each against a raw transfer of the same bytes in the same run.

    .venv/bin/python bench/weights.py [--models tiny,smollm] [--transports store,distributed] [--repeats 5]
                                      [--cache warm,cold]

For each model (the embedded default builtin:tiny-gpt, and a random Llama the size of
SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152) it
runs the real path: a Megatron-core Trainer on CPU and `WeightSync.push` into the project's CPU
engine server.

- store: export the safetensors snapshot (every version an anchor, the dense path: the whole model in
  bf16, docs/weight-versions.md) to a file:// run root, stage it on the engine (served in
  this process: it reads the snapshot in place and builds the model while it could generate), pause,
  `update_weights_from_disk` over HTTP (the staged model is swapped in), resume, publish.
  Baseline: a raw copy of the snapshot's bytes (read + write + fsync of model.safetensors into a new
  file, in the kernel: copy_file_range). Both sides write new files and delete the previous round's
  (the trainer keeps only the newest staged weights), so both reuse the pages freed a round before:
  on this machine memory the kernel has not handed out before costs 2-3x more to write into.
  The first two rounds (they allocate the engine's two sets of reusable buffers) are left out on
  both sides.
- distributed: `DistributedWeightTransport` over gloo (the trainer's HF tensors, pause, per bucket
  of --bucket-mib an `/update_weights_from_distributed` call with a broadcast from rank 0 -- one
  flattened buffer per bucket over gloo -- resume) into an engine server process (as in
  production: its own process, so the broadcast crosses a socket). The first push also forms the
  group and is reported apart; the first two pushes (and two baseline broadcasts) are left out. Baseline: a raw gloo
  broadcast of the same number of bytes (one flat uint8 tensor, one buffer reused on both sides)
  from this process to a second process through the same `init_custom_process_group`, timed until
  the receiver's one-element acknowledgement arrives: the transfer alone, without the HF gather,
  the HTTP calls, or the engine's model build.

Each round measures a push and then its baseline, alternating, so load on the machine falls on both.
Page cache (`--cache`): `warm` runs as it is; `cold` first writes back and drops the page cache
(`sync; echo 3 > /proc/sys/vm/drop_caches`, root only: skipped with a note otherwise) before each
push and each baseline. Cold slows the raw copy's read (from disk); a push reads nothing from disk:
the trainer's weights are in memory, and the engine reads the snapshot it was just written (still
cached) or receives it.

Printed per model, transport and cache state: medians of --repeats rounds of the push (export,
stage, engines paused) and of the baseline, and ratio = baseline seconds / push seconds (target >= 0.5).
Written to bench/results/weights.json (`--results`): one row per model and transport (`push_s`,
`pause_s`, `export_s`, `baseline_s`, `ratio`: warm; the same with `_cold`; every round's seconds);
bench/async_speedup.py reads its push costs from it.
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
    """Read + write + fsync of `src` into the new file `dst`: in the kernel (copy_file_range, the fastest
    copy measured here: no user-space buffer), or through a buffer where the kernel cannot."""
    t = time.perf_counter()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        try:
            left = os.fstat(fi.fileno()).st_size
            while left > 0:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), left)
                if n == 0:
                    break
                left -= n
        except OSError:  # no in-kernel copy between these files: start again through a buffer
            fi.seek(0)
            fo.seek(0)
            fo.truncate()
            shutil.copyfileobj(fi, fo, 16 << 20)
            fo.flush()
        os.fsync(fo.fileno())
    return time.perf_counter() - t


DROP_CACHES = "/proc/sys/vm/drop_caches"
WARM_UP = 2  # rounds left out on both sides: the engine fills its two sets of buffers (the first push forms the group)


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False when this process may not."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def prepare_cache(mode: str) -> None:
    if mode == "cold" and not drop_caches():
        raise PermissionError(f"cannot write {DROP_CACHES}: the cold page cache needs root")


def cache_modes(requested: str) -> list[str]:
    modes = [m for m in requested.split(",") if m]
    if any(m not in ("warm", "cold") for m in modes):
        raise SystemExit(f"--cache {requested!r}: expected warm, cold or both")
    if "cold" in modes and not drop_caches():
        print(f"cold page cache skipped: this process cannot write {DROP_CACHES} (needs root)", flush=True)
        modes.remove("cold")
    return modes


def summarize(rows: dict[str, list[dict]]) -> dict:
    """Per cache mode, medians of each measured key (suffix `_cold` for cold) and the rounds themselves."""
    out = {}
    for mode, rounds in rows.items():
        suffix = "" if mode == "warm" else f"_{mode}"
        for key in rounds[0]:
            out[f"{key}{suffix}"] = statistics.median(r[key] for r in rounds)
        out[f"ratio{suffix}"] = out[f"baseline_s{suffix}"] / out[f"push_s{suffix}"]
        out[f"rounds{suffix}"] = rounds
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def bench_store(name: str, repeats: int, work: str, modes: list[str], **_) -> dict:
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
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    copies: list[str] = []
    try:
        async with EngineClient([f"http://127.0.0.1:{port}"], control_timeout_seconds=600) as client:
            sync = WeightSync([client], StoreWeightTransport(trainer, store, anchor_interval=1), "retract")

            async def one_round(k: int, mode: str | None) -> None:
                if mode:
                    prepare_cache(mode)
                res = await sync.push(k, k + 1)
                src = store.local_path(f"snapshots/step_{k:08d}/model.safetensors")
                copies.append(os.path.join(work, f"{name}-copy-{k}.safetensors"))
                if mode:
                    prepare_cache(mode)
                copy = raw_copy_seconds(src, copies[-1])
                for old in store.list_dirs("snapshots")[:-1]:  # the worker keeps the newest staged weights only
                    store.delete_prefix(f"snapshots/{old}")
                for old in copies[:-1]:
                    os.unlink(old)
                del copies[:-1]
                if mode:
                    rows[mode].append({"push_s": res.total_seconds, "pause_s": res.pause_seconds,
                                       "export_s": res.export_seconds, "stage_s": getattr(res, "stage_seconds", 0.0),
                                       "baseline_s": copy})

            for k in range(WARM_UP):  # the first pushes also allocate the engine's two sets of buffers
                await one_round(k, None)
            k = WARM_UP
            for _ in range(repeats):
                for mode in modes:
                    await one_round(k, mode)
                    k += 1
            assert (await client.get_weight_version()) == {client.urls[0]: k}
    finally:
        await runner.cleanup()
        trainer.close()
    nbytes = os.path.getsize(store.local_path(f"snapshots/step_{k - 1:08d}/model.safetensors"))
    return {"model": name, "transport": "store", "bytes": nbytes, "baseline": "raw copy", **summarize(rows)}


_RECEIVER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from miles_core.weights.distributed import init_custom_process_group
port, nbytes, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=600), 2, 1, group_name="raw")
buf, ack = torch.empty(nbytes, dtype=torch.uint8), torch.ones(1)
for _ in range(repeats):
    dist.broadcast(buf, src=0, group=pg)
    dist.broadcast(ack, src=1, group=pg)
dist.destroy_process_group(pg)
"""


class RawBroadcast:
    """Rank 0 (here) of a two-process gloo group whose other process receives `nbytes` `repeats` times."""

    def __init__(self, nbytes: int, repeats: int):
        import subprocess
        from datetime import timedelta

        from miles_core.weights.distributed import init_custom_process_group

        port = free_port()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
        self.proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port), str(nbytes), str(repeats)], env=env)
        self.pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=600), 2, 0,
                                            group_name="raw")
        self.buf, self.ack = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(1)

    def seconds(self) -> float:
        """One broadcast of the bytes, until the receiver acknowledges it."""
        import torch.distributed as dist

        t = time.perf_counter()
        dist.broadcast(self.buf, src=0, group=self.pg)
        dist.broadcast(self.ack, src=1, group=self.pg)
        return time.perf_counter() - t

    def close(self) -> None:
        from miles_core.weights.distributed import destroy_custom_process_group

        destroy_custom_process_group(self.pg)
        self.proc.wait(timeout=60)


async def bench_distributed(name: str, repeats: int, work: str, modes: list[str], bucket_bytes: int = 512 << 20) -> dict:
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
    nbytes = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    raw = None
    try:
        async with EngineClient([server.url], control_timeout_seconds=600) as client:
            sync = WeightSync([client], transport, "retract")
            first = await sync.push(0, 1)  # forms the group
            for k in range(1, WARM_UP):  # the first pushes also allocate the engine's two sets of buffers
                await sync.push(k, k + 1)
            raw = RawBroadcast(nbytes, WARM_UP + repeats * len(modes))
            for _ in range(WARM_UP):  # as many of the baseline's first broadcasts are left out
                raw.seconds()
            k = WARM_UP
            for _ in range(repeats):
                for mode in modes:
                    prepare_cache(mode)
                    res = await sync.push(k, k + 1)
                    prepare_cache(mode)
                    rows[mode].append({"push_s": res.total_seconds, "pause_s": res.pause_seconds,
                                       "export_s": res.export_seconds, "baseline_s": raw.seconds()})
                    k += 1
            assert (await client.model_info(server.url))["weight_version"] == str(k)
            assert all(h["attempts"] == 1 for h in transport.history)
        await transport.close()
    finally:
        if raw is not None:
            raw.close()
        server.stop()
    trainer.close()
    return {"model": name, "transport": "distributed", "bytes": nbytes, "first_push_s": first.total_seconds,
            "buckets": len(transport.history[-1]["buckets"]), "flattened": getattr(transport, "flatten", False),
            "baseline": "raw gloo broadcast", **summarize(rows)}


def real_smollm2(work: str) -> str:
    """SmolLM2-135M-Instruct as an HF directory (the real-model preset's import of the local GGUF)."""
    from miles_core.config.flags import parse_flags
    from miles_core.prepare.initial_model import ensure_model
    from miles_core.storage.node_local import localize

    cfg = parse_flags(["--preset", "smollm2-arith", "--storage-root", f"file://{work}/import", "--run-id", "v"])
    return localize(ensure_model(cfg), "models")


async def bench_versions(versions: int, work: str, anchor_interval: int = 20, lr: float = 1e-5,
                         model: str = "real") -> dict:
    """Weight versions as bf16 deltas on SmolLM2-135M (`model` real: its real weights; random: the Llama of its
    size from random init), trained between versions by the real
    Megatron trainer (AdamW at `lr`), published to a SeaweedFS S3 server and followed by a reader with its
    own node cache and the CPU engine (docs/weight-versions.md). Per version: bytes written, changed share,
    export, the reader's update (download, apply, verify, write, and the engine's stage), the engine's
    pause. Baseline in the same run: a dense download of the same model (the newest anchor) from the same
    store after every version's update (alternating, as the other benches here do), its median over all.
    Then a late joiner (an empty node cache) rebuilds the newest version: anchors and deltas it read."""
    import s3fs

    from bench.buffer import open_s3
    from miles_core.config.sections import TrainSection
    from miles_core.engines.client import EngineClient
    from miles_core.engines.cpu_server import CpuEngineServer, serve
    from miles_core.storage import Store
    from miles_core.storage import weight_versions as wv
    from miles_core.train.trainer import Trainer
    from miles_core.weights.sync import StoreWeightTransport, WeightSync
    from tests.unit.test_train import make_groups

    hf = real_smollm2(work) if model == "real" else make_checkpoint("smollm", os.path.join(work, "versions-hf"))
    server_s3, bucket = open_s3()
    os.environ["MILES_CACHE_DIR"] = os.path.join(work, "reader-cache")
    trainer = Trainer(TrainSection(lr=lr), hf)
    engine = CpuEngineServer(hf)
    port = free_port()
    runner = await serve(engine, "127.0.0.1", port)
    store = Store(f"{bucket}/versions")
    rows = []
    try:
        async with EngineClient([f"http://127.0.0.1:{port}"], control_timeout_seconds=600) as client:
            transport = StoreWeightTransport(trainer, store, prefix="weights", anchor_interval=anchor_interval)
            sync = WeightSync([client], transport, "retract")
            newest_anchor = 1  # the first versions are anchors
            for k in range(1, versions + 1):
                trainer.train_step(k, make_groups(seed=k))
                before = wv.READS.snapshot()
                res = await sync.push(k, k)
                read = wv.staged_read(before, wv.READS.snapshot())
                written = transport.written
                dense = 2 * written.elements
                if written.anchor:
                    newest_anchor = k
                # the baseline, after every update so that load on the machine falls on both: a dense download
                # of the newest anchor (the same model's bytes) from the same store
                t0 = time.perf_counter()
                with open(os.path.join(work, "dense-download"), "wb") as f:
                    f.write(store.get_bytes(f"weights/step_{newest_anchor:08d}/model.safetensors"))
                down_s = time.perf_counter() - t0
                rows.append({"version": k, "anchor": written.anchor, "bytes": written.bytes, "dense_bytes": dense,
                             "share_of_dense": written.bytes / dense, "changed_share": written.changed / written.elements,
                             "export_s": res.export_seconds, "update_s": res.stage_seconds,
                             "pause_s": res.pause_seconds, "read_bytes": read["read_bytes"],
                             "dense_download_s": down_s})
                r = rows[-1]
                print(f"version {k:3d} {'anchor' if r['anchor'] else 'delta '} {r['bytes'] / 2**20:8.2f} MiB "
                      f"({r['share_of_dense']:.4f} of dense bf16; {r['changed_share']:.4f} of elements changed)  "
                      f"export {r['export_s']:.2f}s  reader update {r['update_s']:.2f}s  pause {r['pause_s']:.3f}s"
                      + f"  dense download {down_s:.2f}s", flush=True)
        late = os.path.join(work, "late-cache")
        os.environ["MILES_CACHE_DIR"] = late
        before = wv.READS.snapshot()
        t0 = time.perf_counter()
        wv.localize_weights(store.uri(f"weights/step_{versions:08d}"))
        late_s = time.perf_counter() - t0
        after = wv.READS.snapshot()
        fs = s3fs.S3FileSystem(endpoint_url=server_s3.endpoint)
        stored = {int(d.rsplit("_", 1)[-1]): fs.du(d) for d in fs.ls(f"{bucket[5:]}/versions/weights")}  # version -> bytes
    finally:
        await runner.cleanup()
        trainer.close()
        server_s3.stop()
    steady = [r for r in rows if r["version"] > 3]
    deltas = [r for r in steady if not r["anchor"]]
    downloads = [r["dense_download_s"] for r in rows]
    out = {
        "model": f"smollm2-{model}", "transport": "versions", "lr": lr, "versions": versions, "rounds": rows,
        "steady_share_of_dense": statistics.median(r["share_of_dense"] for r in deltas) if deltas else None,
        "steady_changed_share": statistics.median(r["changed_share"] for r in deltas) if deltas else None,
        # what one more retained delta version adds to the store: its delta and its small files (config, tokenizer)
        "stored_share_per_version": (statistics.median(stored[r["version"]] for r in deltas) / rows[0]["dense_bytes"]
                                     if deltas else None),
        "update_s": statistics.median(r["update_s"] for r in deltas) if deltas else None,
        "dense_download_s": statistics.median(downloads),
        "pause_s": statistics.median(r["pause_s"] for r in steady) if steady else None,
        "late_joiner": {"seconds": late_s, "anchors_read": after["anchors_read"] - before["anchors_read"],
                        "deltas_applied": after["deltas_applied"] - before["deltas_applied"]},
    }
    if out["update_s"] is not None:
        out["update_vs_dense_download"] = out["update_s"] / out["dense_download_s"]
    print(f"versions: steady delta {out['steady_share_of_dense']} of dense bf16 (goal <= 0.03), stored "
          f"{out['stored_share_per_version']} of dense per delta version (goal <= 0.05), reader update {out['update_s']} s vs dense "
          f"download {out['dense_download_s']:.2f} s (ratio {out.get('update_vs_dense_download')}, goal <= 0.25), "
          f"pause {out['pause_s']} s (goal <= 0.1); late joiner read {out['late_joiner']['anchors_read']} anchor part(s) "
          f"and {out['late_joiner']['deltas_applied']} delta part(s) in {late_s:.2f} s", flush=True)
    return out


def print_row(r: dict, modes: list[str]) -> None:
    store = r["transport"] == "store"
    for mode in modes:
        x = "" if mode == "warm" else f"_{mode}"
        extra = (f"export {r['export_s' + x]:.3f}s, stage {r['stage_s' + x]:.3f}s" if store else
                 f"gather {r['export_s' + x]:.3f}s, {r['buckets']} bucket(s)"
                 f"{' flattened' if r.get('flattened') else ''}, first push with group formation "
                 f"{r['first_push_s']:.3f}s")
        print(f"{r['model']:>7} {r['transport']:>11} {mode}: {r['bytes'] / 2**20:8.1f} MiB  push {r['push_s' + x]:.3f}s "
              f"({extra}, engine pause {r['pause_s' + x]:.3f}s)  {r['baseline']} {r['baseline_s' + x]:.3f}s  "
              f"ratio {r['ratio' + x]:.2f}" + (" (target >= 0.5)" if r["model"] != "tiny" else ""), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm")
    ap.add_argument("--transports", default="store,distributed")
    ap.add_argument("--repeats", type=int, default=5, help="Rounds per cache state (each: a push, then its baseline).")
    ap.add_argument("--cache", default="warm,cold", help="Page-cache states to measure: warm, cold (root only) or both.")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--versions", type=int, default=12, help="Weight versions of the bf16-delta measure (the "
                    "SmolLM2-sized Llama trained at --versions-lr between them, on S3); 0 skips it.")
    ap.add_argument("--versions-lr", type=float, default=1e-5)
    ap.add_argument("--versions-model", default="real", choices=("real", "random"),
                    help="real: SmolLM2-135M-Instruct's weights (the real-model preset's import); random: its shape, random init")
    ap.add_argument("--bucket-mib", type=float, default=512.0, help="Bucket size of the distributed push "
                    "(--update-weight-buffer-size; default 512 MiB).")
    add_results_flag(ap, "weights")
    args = ap.parse_args(argv)
    results = ResultsFile("weights", vars(args))
    torch.set_num_threads(args.threads)
    print("CPU: the distributed transport runs over gloo (NCCL needs CUDA + SGLang)" if not torch.cuda.is_available()
          else "CUDA present; this bench still measures gloo and the CPU engine")
    benches = {"store": bench_store, "distributed": bench_distributed}
    modes = cache_modes(args.cache)
    if not modes:
        raise SystemExit("no page-cache state left to measure")
    rows = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-weights-") as work:
        for name in args.models.split(","):
            for transport in args.transports.split(","):
                rows.append(asyncio.run(benches[transport](name, args.repeats, work, modes,
                                                           bucket_bytes=int(args.bucket_mib * 2**20))))
                print_row(rows[-1], modes)
        versions = asyncio.run(bench_versions(args.versions, work, lr=args.versions_lr,
                                                             model=args.versions_model)) if args.versions else None
    keys = [f"{k}{'' if m == 'warm' else '_' + m}" for m in modes for k in ("push_s", "pause_s", "ratio")]
    figures = {f"{r['model']}_{r['transport']}_{k}": r[k] for r in rows for k in keys}
    if versions is not None:
        figures |= {f"versions_{k}": versions[k] for k in ("steady_share_of_dense", "stored_share_per_version",
                                                            "update_vs_dense_download", "pause_s") if k in versions}
        rows.append(versions)
    return results.write(args.results, figures, rows)


if __name__ == "__main__":
    main()
