"""The prepared GPU check (issue 13 item 7): the Megatron trainer on one CUDA device, end to end.

    python bench/gpu_check.py              # device machine: ~0.48B Llama, bf16, < 8 minutes
    python bench/gpu_check.py --cpu-smoke  # any machine: a tiny Llama on CPU, seconds (CI runs it)

What it does, in one process (no Ray, no engines):
1. writes a random-initialised Llama as an HF checkpoint (`--cpu-smoke`: a tiny one);
2. builds `miles_core.train.trainer.Trainer` on it: on CUDA that is bf16 Megatron DDP +
   Megatron's mixed-precision Adam (`get_megatron_optimizer` -> `ChainedOptimizer`); on CPU fp32
   + torch AdamW. Runs `--warmup` GRPO steps, then `--steps` timed ones;
3. saves a checkpoint (`CheckpointManager`, file://), trains two more steps, then builds a fresh
   Trainer, restores the checkpoint and trains the same two steps: both losses must agree
   (`--loss-rtol`; the second one depends on the restored optimizer state);
4. times the same batches through a plain transformers training step (the HF model in the
   trainer's dtype, torch AdamW, the same loss function) and prints trainer tokens/s against it
   (target ratio >= 1.5; reported, not enforced).
Prints one line per phase and a final JSON summary (also written to `--out/gpu_check.json` when
given, the file tests/gpu/check.sh brings back), and writes the figures in the benches' results
schema (bench/results_file.py) to `--results` (default bench/results/gpu_check.json; with
`--cpu-smoke` only when given, so CI never overwrites a device figure). Exit status 1 when the
checkpoint resume is not exact within tolerance, else 0.

The device machine has torch but not megatron-core: `tests/gpu/check.sh` puts a copy of it on
PYTHONPATH (how to carry it: that script's header).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import results_file  # noqa: E402

# ~0.48B parameters: 24 x (3.1M attention + 14.2M SwiGLU) + 2 x 32.8M untied embeddings.
LLAMA_05B = dict(hidden_size=1024, intermediate_size=4608, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Model size and batch shape. Every sample is prompt_len + response_len tokens (no padding)."""

    model: dict
    groups: int
    samples_per_group: int
    prompt_len: int
    response_len: int
    micro_batch_size: int
    warmup: int
    steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.groups * self.samples_per_group * (self.prompt_len + self.response_len)


GPU_PLAN = Plan(LLAMA_05B, groups=8, samples_per_group=8, prompt_len=128, response_len=384, micro_batch_size=8,
                warmup=2, steps=4)
CPU_SMOKE_PLAN = Plan(LLAMA_TINY, groups=2, samples_per_group=4, prompt_len=6, response_len=10, micro_batch_size=4,
                      warmup=1, steps=1)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_llama(plan: Plan, out_dir: str, device: torch.device, seed: int = 0) -> tuple[str, int]:
    """A random-initialised Llama (rope, GQA, SwiGLU, untied) as an HF directory: (dir, parameters)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, **plan.model)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it is fast (the GPU on the device machine)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    return out_dir, n


def make_batch(plan: Plan, seed: int):
    """GRPO groups of fixed-length samples with rewards and rollout log-probs (deterministic in seed)."""
    from miles_core.samples import Group, Sample, SampleStatus

    rng = random.Random(seed)
    vocab = plan.model["vocab_size"]
    uniform_logp = -math.log(vocab)  # what a random-initialised model gives, about
    groups = []
    for g in range(plan.groups):
        prompt = [rng.randrange(3, vocab) for _ in range(plan.prompt_len)]
        samples = []
        for i in range(plan.samples_per_group):
            resp = [rng.randrange(3, vocab) for _ in range(plan.response_len)]
            n = len(resp)
            logprobs = [uniform_logp + rng.uniform(-0.3, 0.3) for _ in resp]
            samples.append(Sample(f"g{g}", g, i, prompt, resp, logprobs, [1] * n, [0] * n, reward=rng.random(),
                                  status=SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def train_section(plan: Plan):
    from miles_core.config.sections import TrainSection

    return TrainSection(lr=1e-5, micro_batch_size=plan.micro_batch_size, clip_grad=1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def megatron_phase(plan: Plan, hf_dir: str, ckpt_uri: str, device: torch.device) -> dict:
    """Warm-up + timed steps, checkpoint, two more steps; returns timings and the reference losses."""
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.trainer import Trainer

    t0 = time.perf_counter()
    tr = Trainer(train_section(plan), hf_dir, seed=1)
    optimizer = optimizer_name(tr.optimizer)
    log(f"trainer built in {time.perf_counter() - t0:.1f}s: optimizer {optimizer}")
    try:
        step = 0
        for _ in range(plan.warmup):
            tr.train_step(step, make_batch(plan, step))
            step += 1
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(plan.steps):
            m = tr.train_step(step, make_batch(plan, step))
            step += 1
        _sync(device)
        seconds = time.perf_counter() - t0
        log(f"megatron trainer: {plan.steps} steps in {seconds:.2f}s, last loss {m['train/loss']:.5f}, "
            f"grad norm {m['train/grad_norm']:.3f}")
        t0 = time.perf_counter()
        CheckpointManager(Store(ckpt_uri)).save(step - 1, tr, {"bench": True})
        save_s = time.perf_counter() - t0
        after = [tr.train_step(step + i, make_batch(plan, step + i))["train/loss"] for i in range(2)]
        log(f"checkpoint saved in {save_s:.1f}s; next two losses {after}")
    finally:
        tr.close()
    return {"seconds": seconds, "save_seconds": save_s, "next_losses": after, "resume_step": step - 1,
            "optimizer": optimizer}


def optimizer_name(optimizer) -> str:
    """E.g. 'ChainedOptimizer[Float16OptimizerWithFloat16Params]' on GPU, 'AdamW' on CPU."""
    inner = getattr(optimizer, "chained_optimizers", None)
    return type(optimizer).__name__ + (f"[{', '.join(type(o).__name__ for o in inner)}]" if inner else "")


def resume_phase(plan: Plan, hf_dir: str, ckpt_uri: str, step: int) -> dict:
    """A fresh trainer restored from the checkpoint trains the same two steps."""
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.trainer import Trainer

    tr = Trainer(train_section(plan), hf_dir, seed=7)  # another seed: everything must come from the checkpoint
    try:
        t0 = time.perf_counter()
        mgr = CheckpointManager(Store(ckpt_uri))
        restored = mgr.latest()
        mgr.load(restored, tr)
        load_s = time.perf_counter() - t0
        losses = [tr.train_step(restored + 1 + i, make_batch(plan, restored + 1 + i))["train/loss"] for i in range(2)]
        log(f"restored step {restored} in {load_s:.1f}s; next two losses {losses}")
    finally:
        tr.close()
    return {"load_seconds": load_s, "next_losses": losses, "restored_step": restored}


def transformers_phase(plan: Plan, hf_dir: str, device: torch.device) -> dict:
    """The same batches through a plain transformers step: HF model in the trainer's dtype, torch
    AdamW, the trainer's own loss function and micro-batching; returns the timed seconds."""
    from transformers import AutoModelForCausalLM

    from miles_core.train.losses import LossConfig, policy_loss, token_entropy
    from miles_core.train.trainer import _pack, trainable_samples

    cfg = train_section(plan)
    loss_cfg = LossConfig.from_section(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def one_step(step: int) -> float:
        items = trainable_samples(make_batch(plan, step), cfg.normalize_advantages_std)
        total = float(sum(len(s.response_ids) for s, _ in items))
        opt.zero_grad(set_to_none=True)
        for start in range(0, len(items), plan.micro_batch_size):
            batch = _pack(items[start:start + plan.micro_batch_size], loss_cfg.needs_rollout_logprobs, device)
            logits = model(input_ids=batch["tokens"]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
            entropy = token_entropy(logits.detach())  # the trainer reports it too: same work
            loss, _ = policy_loss(loss_cfg, logp, batch["advantages"], batch["mask"], total_tokens=total,
                                  rollout_logp=batch.get("rollout_logp"), ref_logp=None, entropy=entropy)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        return float(loss.detach())

    try:
        for step in range(plan.warmup):
            one_step(step)
        _sync(device)
        t0 = time.perf_counter()
        for step in range(plan.warmup, plan.warmup + plan.steps):
            one_step(step)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        del model, opt
    log(f"transformers baseline: {plan.steps} steps in {seconds:.2f}s")
    return {"seconds": seconds}


def run(plan: Plan, device: torch.device, work: str, loss_rtol: float) -> dict:
    """All phases; returns the summary (see module doc)."""
    t_start = time.perf_counter()
    hf_dir, n_params = write_llama(plan, os.path.join(work, "hf"), device)
    log(f"random Llama: {n_params / 1e9:.3f}B parameters, {plan.tokens_per_step} tokens/step on {device}")
    ckpt = "file://" + os.path.join(work, "ckpt")
    meg = megatron_phase(plan, hf_dir, ckpt, device)
    _free(device)
    back = resume_phase(plan, hf_dir, ckpt, meg["resume_step"])
    _free(device)
    base = transformers_phase(plan, hf_dir, device)
    _free(device)
    tokens = plan.tokens_per_step * plan.steps
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(meg["next_losses"], back["next_losses"])]
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "parameters": n_params, "optimizer": meg["optimizer"], "tokens_per_step": plan.tokens_per_step,
        "megatron_tokens_per_s": tokens / meg["seconds"], "transformers_tokens_per_s": tokens / base["seconds"],
        "checkpoint_save_seconds": meg["save_seconds"], "checkpoint_load_seconds": back["load_seconds"],
        "losses_uninterrupted": meg["next_losses"], "losses_resumed": back["next_losses"],
        "resume_rel_diff": max(diffs), "resume_ok": max(diffs) <= loss_rtol,
        "wall_seconds": time.perf_counter() - t_start,
    }
    summary["ratio"] = summary["megatron_tokens_per_s"] / summary["transformers_tokens_per_s"]
    summary["ratio_target_met"] = summary["ratio"] >= 1.5
    return summary


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (CI): exercises every phase")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: the plan's)")
    ap.add_argument("--loss-rtol", type=float, default=None,
                    help="resume tolerance on the next-step losses (default 1e-3 on GPU, 1e-6 on CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_check.json (default $OUT)")
    results_file.add_results_flag(ap, "gpu_check", default=None)
    args = ap.parse_args(argv)
    results = results_file.ResultsFile("gpu_check", vars(args))
    results_path = args.results if args.results is not None else \
        ("" if args.cpu_smoke else results_file.default_path("gpu_check"))
    if args.cpu_smoke:
        device, plan = torch.device("cpu"), CPU_SMOKE_PLAN
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu-smoke for the CPU path", file=sys.stderr)
        return 2
    else:
        device, plan = torch.device("cuda"), GPU_PLAN
    if args.steps:
        plan = dataclasses.replace(plan, steps=args.steps)
    rtol = args.loss_rtol if args.loss_rtol is not None else (1e-6 if device.type == "cpu" else 1e-3)
    with tempfile.TemporaryDirectory(prefix="miles-gpu-check-") as work:
        summary = run(plan, device, work, rtol)
    text = json.dumps(summary, indent=1)
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            f.write(text)
    figures = {k: v for k, v in summary.items() if not isinstance(v, list)}
    results.write(results_path, figures, [{"phase": "resume", "losses_uninterrupted": summary["losses_uninterrupted"],
                                           "losses_resumed": summary["losses_resumed"]}])
    log(f"megatron {summary['megatron_tokens_per_s']:.0f} tok/s vs transformers "
        f"{summary['transformers_tokens_per_s']:.0f} tok/s: ratio {summary['ratio']:.2f} "
        f"({'meets' if summary['ratio_target_met'] else 'BELOW'} the 1.5 target); resume "
        f"{'exact' if summary['resume_ok'] else 'MISMATCH'} (max rel diff {summary['resume_rel_diff']:.2e})")
    return 0 if summary["resume_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
