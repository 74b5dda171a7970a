"""The prepared GPU check: the Megatron trainer on one CUDA device, end to end, phase by phase.

    python bench/gpu_check.py              # device machine: ~0.48B Llama, bf16, about 3 minutes
    python bench/gpu_check.py --cpu-smoke  # any machine: a tiny Llama on CPU, every phase (CI runs it)

One process (no Ray, no engine servers). It writes a random-initialised Llama as an HF checkpoint
(`--cpu-smoke`: a tiny one), then runs seven phases; each is timed and ends `pass`, `fail` or `skip`
(with the reason), and a phase whose input phase did not pass is skipped:
- train: `Trainer` with --bf16 and --use-distributed-optimizer: Megatron DDP + Megatron's
  `DistributedOptimizer` (fp32 main params and Adam moments; on one GPU DP=1, so it shards over one
  rank) in a `ChainedOptimizer`. `--warmup` GRPO steps, then `--steps` timed ones, whose peak memory
  is measured; then a checkpoint save (`CheckpointManager`, file://) and two more steps.
- checkpoint: a fresh trainer (another seed) restores the checkpoint and makes the same two steps:
  both losses must agree within `--loss-rtol` (the second one reads the restored Adam moments). The
  restored trainer then scores probe samples (`Trainer.logprobs`) and exports its weights.
- memory: `miles_core.prepare.memory.estimate` for the train phase's config against the peak of its
  timed steps, within 25%: on CUDA `torch.cuda.max_memory_allocated()` against the estimate less its
  `overhead` term (CUDA context and allocator slack, which that counter does not see). On CPU the peak
  of live tensor storage (a dispatch-mode counter, `StoragePeak`) against `estimate(..., gpu=False)`,
  reported but not enforced: the smoke model is a few hundred kB, where fixed costs dominate.
- long_seq: one sample of the model's maximum length (2,048 tokens; micro-batch 1) through a bf16
  trainer of the layers `--transformer-impl auto` builds on this machine: the s x s attention state
  dominates its activations (Megatron's unfused attention: the fp32 softmax output and the bf16
  probabilities; Transformer Engine's fused attention: none). Its peak against the estimate for
  that implementation, within 25% on CUDA.
- engine: the CPU engine's model (`miles_core.engines.model.CausalLM`) loaded onto the device from
  the exported weights; the probe samples' log-probs teacher-forced through its own prefill + decode
  path (what the engine returns while generating) equal the trainer's: mean |diff| <= 0.02 and max
  |diff| <= 0.1 nats. The trainer runs in bf16 and the engine in fp32 on the same bf16 weights, so
  the gap is the trainer's bf16 rounding (2^-8 relative per op): 0.004 mean, 0.017 max on a 24-layer
  width-512 Llama on CPU. A wrong weight mapping or RoPE convention moves log-probs by their spread
  (0.37 nats there), which the summary reports beside the gap.
- packing: the same ragged batches through --use-dynamic-batch-size (micro-batches packed to
  --max-tokens-per-gpu) and through padded micro-batches with the same token budget; the first
  step's losses (same starting weights) agree within |diff| <= 2e-3 + 1e-2 |loss| (bf16); tokens/s
  of both.
- baseline: the train phase's batches through a plain transformers step (the HF model in the
  trainer's dtype, torch AdamW, the trainer's loss function and micro-batches); trainer tokens/s
  against it (target ratio >= 1.5; reported, not enforced).
Flags this revision's `TrainSection` lacks are reported (`flags_missing`), and a phase that needs one
is skipped with "flag not available".

Prints one line per phase and a JSON summary, also written to `--out/gpu_check.json` after every
phase (a killed run keeps what finished). At the end the figures go in the benches' results schema
(bench/results_file.py) to `--results` (default bench/results/gpu_check.json; with `--cpu-smoke`
only when given, so CI never overwrites a device figure). Exit status 1 when a phase failed, 2
without CUDA (and no `--cpu-smoke`), else 0. On CUDA each phase also has a time limit
(`GPU_PHASE_SECONDS`); tests/gpu/check.sh bounds the whole run.

The device machine has torch but not megatron-core: `tests/gpu/check.sh` puts a copy of it on
PYTHONPATH (how to carry it: that script's header).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import results_file  # noqa: E402

# ~0.48B parameters: 24 x (3.1M attention + 14.2M SwiGLU) + 2 x 32.8M untied embeddings.
LLAMA_05B = dict(hidden_size=1024, intermediate_size=4608, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Model size and batch shapes. The train phase's samples are prompt_len + response_len tokens
    (no padding); the packing phase's are ragged (at most that); the engine phase scores
    `probe_samples` samples of prompt_len + probe_response_len tokens."""

    model: dict
    groups: int
    samples_per_group: int
    prompt_len: int
    response_len: int
    micro_batch_size: int
    warmup: int
    steps: int
    packed_micro_batch_size: int  # packing phase: padded micro-batches of this many samples, or this x
    packing_steps: int            # (prompt_len + response_len) tokens packed; timed steps after the first
    probe_samples: int
    probe_response_len: int
    long_seq: int = 0             # long_seq phase: one sample of this many tokens (the model's maximum)

    @property
    def tokens_per_step(self) -> int:
        return self.groups * self.samples_per_group * (self.prompt_len + self.response_len)

    @property
    def token_budget(self) -> int:
        """--max-tokens-per-gpu of the packing phase: what a padded micro-batch holds at most."""
        return self.packed_micro_batch_size * (self.prompt_len + self.response_len)


GPU_PLAN = Plan(LLAMA_05B, groups=8, samples_per_group=8, prompt_len=128, response_len=384, micro_batch_size=8,
                warmup=2, steps=4, packed_micro_batch_size=4, packing_steps=2, probe_samples=8, probe_response_len=64,
                long_seq=2048)
CPU_SMOKE_PLAN = Plan(LLAMA_TINY, groups=2, samples_per_group=4, prompt_len=6, response_len=10, micro_batch_size=4,
                      warmup=1, steps=1, packed_micro_batch_size=2, packing_steps=1, probe_samples=4,
                      probe_response_len=6, long_seq=64)


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """What each phase accepts (module doc says why)."""

    resume_rtol: float                   # checkpoint: next-step losses, relative
    logprob_mean: float = 0.02           # engine: mean |trainer - engine| log-prob, nats (bf16 trainer)
    logprob_max: float = 0.1             # engine: max |trainer - engine|
    packing_atol: float = 2e-3           # packing: |packed - padded| first-step loss <= atol + rtol |padded|
    packing_rtol: float = 1e-2
    memory_rel: float = 0.25             # memory: |estimate - measured| / measured
    ratio_target: float = 1.5            # baseline: trainer / transformers tokens/s (reported only)


# Large enough that the second resumed step depends measurably on the restored Adam moments: a
# restore of the weights alone moves that loss by ~2e-2 relative on the smoke model (1e-5: ~1e-3,
# the GPU tolerance).
LR = 1e-3
# The trainer flags of the train, checkpoint and memory phases, and those the packing phase adds.
TRAIN_FLAGS = {"bf16": True, "use_distributed_optimizer": True, "actor_num_gpus_per_node": 1}  # one rank
PACKING_FLAGS = ("use_dynamic_batch_size", "max_tokens_per_gpu")
# Seconds each phase may take on CUDA before it is stopped (and fails); tests/gpu/check.sh bounds the whole run.
GPU_PHASE_SECONDS = {"train": 150, "checkpoint": 120, "memory": 30, "long_seq": 90, "engine": 90, "packing": 120,
                     "baseline": 90}


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


def make_batch(plan: Plan, seed: int, ragged: bool = False):
    """GRPO groups with rewards and rollout log-probs (deterministic in seed): every sample
    prompt_len + response_len tokens, or with `ragged` a prompt of 1/2..1 of prompt_len tokens per
    group and a response of 1/4..1 of response_len tokens per sample."""
    from miles_core.samples import Group, Sample, SampleStatus

    rng = random.Random(seed)
    vocab = plan.model["vocab_size"]
    uniform_logp = -math.log(vocab)  # what a random-initialised model gives, about
    groups = []
    for g in range(plan.groups):
        p_len = rng.randint(max(1, plan.prompt_len // 2), plan.prompt_len) if ragged else plan.prompt_len
        prompt = [rng.randrange(3, vocab) for _ in range(p_len)]
        samples = []
        for i in range(plan.samples_per_group):
            r_len = rng.randint(max(1, plan.response_len // 4), plan.response_len) if ragged else plan.response_len
            resp = [rng.randrange(3, vocab) for _ in range(r_len)]
            n = len(resp)
            logprobs = [uniform_logp + rng.uniform(-0.3, 0.3) for _ in resp]
            samples.append(Sample(f"g{g}", g, i, prompt, resp, logprobs, [1] * n, [0] * n, reward=rng.random(),
                                  status=SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def probe_samples(plan: Plan) -> list:
    """The engine phase's samples: one prompt length, one response length (a batched prefill + decode)."""
    probe = dataclasses.replace(plan, groups=1, samples_per_group=plan.probe_samples,
                                response_len=plan.probe_response_len)
    return make_batch(probe, seed=999)[0].samples


def batch_tokens(groups) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)


def train_fields() -> set[str]:
    from miles_core.config.sections import TrainSection

    return {f.name for f in dataclasses.fields(TrainSection)}


def missing_flags(names) -> list[str]:
    """The flags among `names` (TrainSection field names) this revision does not have, as --flags."""
    have = train_fields()
    return ["--" + n.replace("_", "-") for n in names if n not in have]


def train_section(plan: Plan, **flags):
    """The trainer's section: TRAIN_FLAGS plus `flags`, less those this revision lacks."""
    from miles_core.config.sections import TrainSection

    have = train_fields()
    wanted = {"lr": LR, "micro_batch_size": plan.micro_batch_size, "clip_grad": 1.0, **TRAIN_FLAGS, **flags}
    return TrainSection(**{k: v for k, v in wanted.items() if k in have})


def run_config(plan: Plan, train):
    """The RunConfig the memory estimate reads: `train` plus the batch shape of the train phase."""
    from miles_core.config import RunConfig, replace_fields

    return replace_fields(dataclasses.replace(RunConfig(), train=train), rollout_batch_size=plan.groups,
                          n_samples_per_prompt=plan.samples_per_group, max_seq_len=plan.prompt_len + plan.response_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def optimizer_name(optimizer) -> str:
    """E.g. 'ChainedOptimizer[DistributedOptimizer]' with --use-distributed-optimizer, 'AdamW' (fp32 CPU)."""
    inner = getattr(optimizer, "chained_optimizers", None)
    return type(optimizer).__name__ + (f"[{', '.join(type(o).__name__ for o in inner)}]" if inner else "")


# ----------------------------------------------------------------------------- peak memory


class CudaPeak:
    """Peak of `torch.cuda.max_memory_allocated()` over a block (`resident`: allocated at its start)."""

    def __enter__(self) -> "CudaPeak":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.resident = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()
        self.reserved = torch.cuda.max_memory_reserved()


def _is_tensor(obj) -> bool:
    """isinstance(obj, torch.Tensor), False for objects that raise on it (flytekit's lazy stand-ins
    for packages that are not installed raise ImportError on any attribute)."""
    try:
        return isinstance(obj, torch.Tensor)
    except ImportError:
        return False


class StoragePeak(TorchDispatchMode):
    """Peak bytes of live CPU tensor storage over a block: every storage alive at its start (found
    through the garbage collector: weights, gradient buffers, optimizer state) plus each one an op
    creates in the block, counted until it is freed. Slow (Python on every op): the CPU smoke only."""

    def __enter__(self) -> "StoragePeak":
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on some lazy objects warns of deprecated attributes
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if _is_tensor(obj)]
        for t in tensors:
            self._count(t, track_free=False)
        del tensors
        self.resident = self.now
        return super().__enter__()

    def _count(self, t: torch.Tensor, track_free: bool = True) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, meta)
            return
        key, n = storage.data_ptr(), storage.nbytes()
        if not n or key in self.live:
            return
        self.live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        if track_free:
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def peak_meter(device: torch.device):
    return CudaPeak() if device.type == "cuda" else StoragePeak()


# ----------------------------------------------------------------------------- phases


class Skip(Exception):
    """A phase that cannot run in this revision or after an earlier failure; the message says why."""


class PhaseTimeout(Exception):
    pass


@dataclasses.dataclass
class Context:
    """What the phases share: the plan, the device, the HF checkpoint, and what one phase leaves the next."""

    plan: Plan
    device: torch.device
    work: str
    tol: Tolerances
    hf_dir: str = ""
    parameters: int = 0
    state: dict = dataclasses.field(default_factory=dict)
    phases: dict = dataclasses.field(default_factory=dict)

    @property
    def ckpt_uri(self) -> str:
        return "file://" + os.path.join(self.work, "ckpt")


def train_phase(ctx: Context) -> dict:
    """Warm-up, timed steps, one step under the peak-memory meter, checkpoint, two more steps."""
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.trainer import Trainer

    plan, device = ctx.plan, ctx.device
    t0 = time.perf_counter()
    tr = Trainer(train_section(plan), ctx.hf_dir, seed=1)
    build_s = time.perf_counter() - t0
    optimizer = optimizer_name(tr.optimizer)
    log(f"trainer built in {build_s:.1f}s: optimizer {optimizer}")
    try:
        step = 0
        for _ in range(plan.warmup):
            tr.train_step(step, make_batch(plan, step))
            step += 1
        batches = [make_batch(plan, step + i) for i in range(plan.steps)]
        _sync(device)
        t0 = time.perf_counter()
        for batch in batches:
            m = tr.train_step(step, batch)
            step += 1
        _sync(device)
        seconds = time.perf_counter() - t0
        batch = make_batch(plan, step)
        with peak_meter(device) as meter:
            tr.train_step(step, batch)
        step += 1
        t0 = time.perf_counter()
        CheckpointManager(Store(ctx.ckpt_uri)).save(step - 1, tr, {"bench": True})
        save_s = time.perf_counter() - t0
        after = [tr.train_step(step + i, make_batch(plan, step + i))["train/loss"] for i in range(2)]
    finally:
        tr.close()
    ctx.state.update(resume_step=step - 1, next_losses=after, meter=meter)
    log(f"{plan.steps} steps in {seconds:.2f}s, last loss {m['train/loss']:.5f}, grad norm "
        f"{m['train/grad_norm']:.3f}; checkpoint saved in {save_s:.1f}s; next two losses {after}")
    missing = missing_flags(TRAIN_FLAGS)
    distributed = TRAIN_FLAGS.get("use_distributed_optimizer") and "use_distributed_optimizer" in train_fields()
    ok = all(math.isfinite(x) for x in after) and math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 \
        and (not distributed or "DistributedOptimizer" in optimizer)
    return {"ok": ok, "optimizer": optimizer, "flags": {k: v for k, v in TRAIN_FLAGS.items() if k in train_fields()},
            "flags_missing": missing, "build_seconds": build_s, "steps_seconds": seconds,
            "tokens_per_s": plan.tokens_per_step * plan.steps / seconds, "last_loss": m["train/loss"],
            "grad_norm": m["train/grad_norm"], "save_seconds": save_s, "next_losses": after}


def checkpoint_phase(ctx: Context) -> dict:
    """A fresh trainer restored from the checkpoint trains the same two steps; then it scores the
    probe samples and exports its weights (the engine phase's inputs)."""
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager
    from miles_core.train.trainer import Trainer

    plan = ctx.plan
    tr = Trainer(train_section(plan), ctx.hf_dir, seed=7)  # another seed: everything must come from the checkpoint
    try:
        t0 = time.perf_counter()
        mgr = CheckpointManager(Store(ctx.ckpt_uri))
        restored = mgr.latest()
        mgr.load(restored, tr)
        load_s = time.perf_counter() - t0
        losses = [tr.train_step(restored + 1 + i, make_batch(plan, restored + 1 + i))["train/loss"] for i in range(2)]
        ctx.state["probe_logprobs"] = tr.logprobs(probe_samples(plan))
        ctx.state["export_dir"] = tr.export_hf(os.path.join(ctx.work, "export"))
    finally:
        tr.close()
    expected = ctx.state["next_losses"]
    diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(expected, losses))
    log(f"restored step {restored} in {load_s:.1f}s; next two losses {losses} (uninterrupted {expected}, "
        f"max rel diff {diff:.2e}, tolerance {ctx.tol.resume_rtol:g})")
    return {"ok": restored == ctx.state["resume_step"] and diff <= ctx.tol.resume_rtol, "restored_step": restored,
            "load_seconds": load_s, "next_losses": losses, "rel_diff": diff, "rtol": ctx.tol.resume_rtol}


def memory_phase(ctx: Context) -> dict:
    """The estimate for the train phase's config against the peak of its metered step (module doc)."""
    from miles_core.prepare.memory import GIB, estimate

    with open(os.path.join(ctx.hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    cfg = run_config(ctx.plan, train_section(ctx.plan))
    cuda = ctx.device.type == "cuda"
    est = estimate(hf_config, cfg, gpu=cuda)
    meter = ctx.state["meter"]
    predicted = est.total - est.overhead  # what the allocator counts: no CUDA context, no slack
    rel = (predicted - meter.peak) / meter.peak
    breakdown = {f.name: getattr(est, f.name) for f in dataclasses.fields(est)}
    log(f"memory: estimate {predicted / GIB:.3f} GiB ({est.describe()}) vs measured peak {meter.peak / GIB:.3f} "
        f"GiB (resident {meter.resident / GIB:.3f} GiB): {rel:+.1%}"
        + ("" if cuda else " (CPU: reported, not enforced)"))
    out = {"ok": abs(rel) <= ctx.tol.memory_rel or not cuda, "enforced": cuda, "measure":
           "torch.cuda.max_memory_allocated" if cuda else "StoragePeak (live CPU tensor storage)",
           "estimate_bytes": predicted, "estimate_total_bytes": est.total, "measured_peak_bytes": meter.peak,
           "measured_resident_bytes": meter.resident, "estimate_static_bytes": est.weights + est.grads + est.optimizer,
           "rel_error": rel, "tolerance": ctx.tol.memory_rel, "breakdown": breakdown}
    if cuda:
        out["measured_peak_reserved_bytes"] = meter.reserved
    return out


def long_seq_phase(ctx: Context) -> dict:
    """The memory of a long sequence: one sample of `plan.long_seq` tokens (micro-batch 1), where the s x s
    attention state dominates, through a bf16 trainer of the layers `--transformer-impl auto` builds here
    (Megatron's unfused attention keeps the softmax output in fp32 and the probabilities in bf16;
    Transformer Engine's fused attention keeps none); its peak against the estimate for that
    implementation, within 25% on CUDA (on CPU reported, not enforced, as the memory phase)."""
    from miles_core.prepare.memory import GIB, estimate, impl_on_this_node
    from miles_core.train.trainer import Trainer

    n = ctx.plan.long_seq
    plan = dataclasses.replace(ctx.plan, groups=1, samples_per_group=2, prompt_len=n // 4, response_len=n - n // 4,
                               micro_batch_size=1)
    train = train_section(plan)
    impl = impl_on_this_node(train) if ctx.device.type == "cuda" else "local"
    tr = Trainer(train, ctx.hf_dir, seed=3)
    try:
        tr.train_step(0, make_batch(plan, 0))  # the optimizer's state exists before the metered step, as in a run
        with peak_meter(ctx.device) as meter:
            tr.train_step(1, make_batch(plan, 1))
        built = getattr(tr.model, "miles_transformer_impl", impl)
    finally:
        tr.close()
    with open(os.path.join(ctx.hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    cuda = ctx.device.type == "cuda"
    est = estimate(hf_config, run_config(plan, dataclasses.replace(train, transformer_impl=built)), gpu=cuda)
    predicted = est.total - est.overhead
    rel = (predicted - meter.peak) / meter.peak
    log(f"long_seq: {n} tokens, --transformer-impl {built}: estimate {predicted / GIB:.3f} GiB ({est.describe()}) vs "
        f"measured peak {meter.peak / GIB:.3f} GiB: {rel:+.1%}" + ("" if cuda else " (CPU: reported, not enforced)"))
    return {"ok": abs(rel) <= ctx.tol.memory_rel or not cuda, "enforced": cuda, "tokens": n, "transformer_impl": built,
            "estimate_bytes": predicted, "measured_peak_bytes": meter.peak, "activations_bytes": est.activations,
            "rel_error": rel, "tolerance": ctx.tol.memory_rel}


def engine_phase(ctx: Context) -> dict:
    """The CPU engine's model on the device, on the exported weights, against the trainer's log-probs."""
    from miles_core.engines.model import CausalLM, read_safetensors, read_spec

    export, device = ctx.state["export_dir"], ctx.device
    samples = probe_samples(ctx.plan)
    t0 = time.perf_counter()
    with torch.device(device):  # the engine's own factory calls (positions, cache, RoPE tables) land there too
        model = CausalLM(read_spec(export), {k: v.to(device) for k, v in read_safetensors(export).items()}, export)
        ours = teacher_forced_logprobs(model, samples)
    seconds = time.perf_counter() - t0
    theirs = torch.tensor(ctx.state["probe_logprobs"], dtype=torch.float64)
    gap = (ours.double().cpu() - theirs).abs()
    spread = float((theirs - theirs.mean()).abs().mean())
    tol = ctx.tol
    log(f"engine on {ours.device}: {gap.numel()} log-probs, mean |diff| {gap.mean():.2e} (<= {tol.logprob_mean}), max "
        f"{gap.max():.2e} (<= {tol.logprob_max}); the log-probs' own spread {spread:.3f}")
    return {"ok": ours.device.type == device.type and gap.mean() <= tol.logprob_mean and gap.max() <= tol.logprob_max,
            "engine_device": str(ours.device), "tokens": gap.numel(), "mean_abs_diff": float(gap.mean()),
            "max_abs_diff": float(gap.max()), "tolerance_mean": tol.logprob_mean, "tolerance_max": tol.logprob_max,
            "logprob_spread": spread, "seconds_engine": seconds}


def teacher_forced_logprobs(model, samples) -> torch.Tensor:
    """[n, r] log-probs of the samples' response tokens through the engine's path: one batched prefill
    of the prompts (whose last logits give the first response token's), then one decode step per
    response token fed back; `log_softmax` of the unmodified logits, as BatchEngine returns them.
    The samples share one prompt length and one response length. Factory calls follow the
    caller's default device."""
    prompts = torch.tensor([s.prompt_ids for s in samples])
    responses = torch.tensor([s.response_ids for s in samples])
    (n, p), r = prompts.shape, responses.shape[1]
    cache = model.new_cache(n, p + r)
    logits = model.prefill(cache, 0, prompts, torch.full((n,), p))
    out = [_picked(logits, responses[:, 0])]
    for j in range(1, r):
        logits = model.decode(cache, responses[:, j - 1], torch.full((n,), p + j - 1))
        out.append(_picked(logits, responses[:, j]))
    return torch.stack(out, 1)


def _picked(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


def packing_phase(ctx: Context) -> dict:
    """Ragged batches through padded micro-batches and through token-budget packing, same weights."""
    missing = missing_flags(PACKING_FLAGS)
    if missing:
        raise Skip(f"flag not available in this revision: {', '.join(missing)}")
    plan = ctx.plan
    batches = [make_batch(plan, 100 + i, ragged=True) for i in range(1 + plan.packing_steps)]
    padded = packing_side(ctx, batches, micro_batch_size=plan.packed_micro_batch_size)
    packed = packing_side(ctx, batches, use_dynamic_batch_size=True, max_tokens_per_gpu=plan.token_budget)
    diff = abs(packed["first_loss"] - padded["first_loss"])
    bound = ctx.tol.packing_atol + ctx.tol.packing_rtol * abs(padded["first_loss"])
    log(f"packing: first-step loss padded {padded['first_loss']:.6f} vs packed {packed['first_loss']:.6f} "
        f"(|diff| {diff:.2e} <= {bound:.2e}); tokens/s padded {padded['tokens_per_s']:.0f} "
        f"({padded['micro_batches']:.0f} micro-batches, {padded['padding_fraction']:.0%} padding) vs packed "
        f"{packed['tokens_per_s']:.0f} ({packed['micro_batches']:.0f} micro-batches)")
    return {"ok": diff <= bound, "loss_abs_diff": diff, "loss_bound": bound, "token_budget": plan.token_budget,
            "padded_micro_batch_size": plan.packed_micro_batch_size, "padded": padded, "packed": packed,
            "speedup": packed["tokens_per_s"] / padded["tokens_per_s"]}


def packing_side(ctx: Context, batches, **flags) -> dict:
    """A fresh trainer: the first batch (the compared loss, also the warm-up), then the rest timed."""
    from miles_core.train.trainer import Trainer

    tr = Trainer(train_section(ctx.plan, **flags), ctx.hf_dir, seed=1)
    try:
        first = tr.train_step(0, batches[0])
        _sync(ctx.device)
        t0 = time.perf_counter()
        later = [tr.train_step(i, b) for i, b in enumerate(batches[1:], 1)]
        _sync(ctx.device)
        seconds = time.perf_counter() - t0
    finally:
        tr.close()
    return {"first_loss": first["train/loss"], "later_losses": [m["train/loss"] for m in later],
            "micro_batches": first.get("train/micro_batches", float("nan")),
            "padding_fraction": first.get("train/padding_fraction", float("nan")),
            "seconds": seconds, "tokens_per_s": sum(batch_tokens(b) for b in batches[1:]) / seconds}


def baseline_phase(ctx: Context) -> dict:
    """The train phase's batches through a plain transformers step: the HF model in the trainer's
    dtype, torch AdamW, the trainer's own loss function and micro-batching; tokens/s of both."""
    from transformers import AutoModelForCausalLM

    plan, device = ctx.plan, ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" or "bf16" in train_fields() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ctx.hf_dir, dtype=dtype).to(device)
    model.train()
    cfg = train_section(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    for step in range(plan.warmup):
        transformers_step(model, opt, cfg, plan, make_batch(plan, step), device)
    batches = [make_batch(plan, step) for step in range(plan.warmup, plan.warmup + plan.steps)]
    _sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        transformers_step(model, opt, cfg, plan, batch, device)
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens_per_s = plan.tokens_per_step * plan.steps / seconds
    trainer = ctx.phases.get("train", {}).get("tokens_per_s")
    ratio = trainer / tokens_per_s if trainer else None
    log(f"transformers baseline: {plan.steps} steps in {seconds:.2f}s, {tokens_per_s:.0f} tokens/s; trainer "
        f"{trainer or float('nan'):.0f} tokens/s: ratio {ratio or float('nan'):.2f} (target {ctx.tol.ratio_target})")
    met = ratio is not None and ratio >= ctx.tol.ratio_target
    return {"ok": True, "steps_seconds": seconds, "tokens_per_s": tokens_per_s, "ratio": ratio,
            "ratio_target": ctx.tol.ratio_target, "ratio_target_met": met}


def transformers_step(model, opt, cfg, plan: Plan, groups, device: torch.device) -> float:
    """One optimizer step of the plain transformers baseline over `groups`; returns the last micro-batch's loss."""
    from miles_core.rank_batches import trainable_samples
    from miles_core.train.losses import LossConfig, policy_loss, token_entropy
    from miles_core.train.trainer import _pack

    loss_cfg = LossConfig.from_section(cfg)
    items = trainable_samples(groups, cfg.normalize_advantages_std)
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


# ----------------------------------------------------------------------------- running the phases

# (name, function, the phases it needs)
PHASES = (("train", train_phase, ()), ("checkpoint", checkpoint_phase, ("train",)),
          ("memory", memory_phase, ("train",)), ("long_seq", long_seq_phase, ("train",)),
          ("engine", engine_phase, ("checkpoint",)),
          ("packing", packing_phase, ()), ("baseline", baseline_phase, ()))


def run_phase(ctx: Context, name: str, fn, needs: tuple[str, ...], seconds: int | None) -> dict:
    """Run one phase; record {"status": pass | fail | skip, "seconds", its figures or the reason / error}."""
    log(f"phase {name} ...")
    t0 = time.perf_counter()
    try:
        unmet = [n for n in needs if ctx.phases.get(n, {}).get("status") != "pass"]
        if unmet:
            raise Skip(f"needs the {', '.join(unmet)} phase, which did not pass")
        with time_limit(seconds):
            figures = fn(ctx)
        status = "pass" if figures.pop("ok") else "fail"
    except Skip as e:
        figures, status = {"reason": str(e)}, "skip"
    except Exception as e:  # noqa: BLE001 - a failed phase is a result; the next phases still run
        traceback.print_exc()
        figures, status = {"error": f"{type(e).__name__}: {e}"}, "fail"
    finally:
        _free(ctx.device)
    record = {"status": status, "seconds": time.perf_counter() - t0, **figures}  # the phase's wall time
    log(f"phase {name}: {status.upper()} in {record['seconds']:.1f}s"
        + (f" ({figures.get('reason') or figures.get('error')})" if status != "pass" else ""))
    return record


@contextlib.contextmanager
def time_limit(seconds: int | None):
    """PhaseTimeout after `seconds` (SIGALRM, main thread; None: no limit). A phase stuck inside one
    C call is stopped by tests/gpu/check.sh's `timeout` instead."""
    if not seconds:
        yield
        return

    def expired(signum, frame):
        raise PhaseTimeout(f"the phase ran past its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def environment(device: torch.device) -> dict:
    import megatron.core
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "megatron_core": megatron.core.__version__, "megatron_core_path": os.path.dirname(megatron.core.__file__),
           "transformers": transformers.__version__, "device": "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, device_memory_bytes=props.total_memory)
    return env


def summary(ctx: Context, env: dict, wall: float) -> dict:
    """The flat figures (one key each, the ones docs/benchmarks.md quotes) and every phase's record."""
    ph = ctx.phases
    train, ckpt, base = ph.get("train", {}), ph.get("checkpoint", {}), ph.get("baseline", {})
    failed = [n for n, r in ph.items() if r["status"] == "fail"]
    skipped = [n for n, r in ph.items() if r["status"] == "skip"]
    return {"device": env["device"], "environment": env, "parameters": ctx.parameters,
            "tokens_per_step": ctx.plan.tokens_per_step, "optimizer": train.get("optimizer"),
            "flags_missing": missing_flags([*TRAIN_FLAGS, *PACKING_FLAGS]),
            "megatron_tokens_per_s": train.get("tokens_per_s"), "transformers_tokens_per_s": base.get("tokens_per_s"),
            "ratio": base.get("ratio"), "ratio_target_met": base.get("ratio_target_met"),
            "checkpoint_save_seconds": train.get("save_seconds"), "checkpoint_load_seconds": ckpt.get("load_seconds"),
            "losses_uninterrupted": train.get("next_losses"), "losses_resumed": ckpt.get("next_losses"),
            "resume_rel_diff": ckpt.get("rel_diff"), "resume_ok": ckpt.get("status") == "pass",
            "memory_rel_error": ph.get("memory", {}).get("rel_error"),
            "long_seq_rel_error": ph.get("long_seq", {}).get("rel_error"),
            "long_seq_transformer_impl": ph.get("long_seq", {}).get("transformer_impl"),
            "engine_max_abs_diff": ph.get("engine", {}).get("max_abs_diff"),
            "packing_speedup": ph.get("packing", {}).get("speedup"),
            "phases_failed": failed, "phases_skipped": skipped, "ok": not failed,
            "complete": len(ph) == len(PHASES), "wall_seconds": wall, "phases": ph}


def results_figures(s: dict) -> tuple[dict, list[dict]]:
    """(figures, rows) in the results schema: the scalar summary figures plus each phase's status; one row per phase."""
    figures = {k: v for k, v in s.items() if isinstance(v, (int, float, str, type(None)))}
    figures.update({f"{name}_status": r["status"] for name, r in s["phases"].items()})
    rows = [{"phase": name, **r} for name, r in s["phases"].items()] or [{"phase": None}]
    return figures, rows


def run(ctx: Context, write) -> dict:
    """Every phase in order; `write(summary)` after each (a killed run keeps what finished)."""
    t_start = time.perf_counter()
    env = environment(ctx.device)
    ctx.hf_dir, ctx.parameters = write_llama(ctx.plan, os.path.join(ctx.work, "hf"), ctx.device)
    log(f"random Llama: {ctx.parameters / 1e6:.2f}M parameters, {ctx.plan.tokens_per_step} tokens/step on "
        f"{env['device']}; torch {env['torch']}, megatron-core {env['megatron_core']}")
    missing = missing_flags([*TRAIN_FLAGS, *PACKING_FLAGS])
    if missing:
        log(f"flags not available in this revision (their phases skip or run without them): {', '.join(missing)}")
    limits = GPU_PHASE_SECONDS if ctx.device.type == "cuda" else {}
    for name, fn, needs in PHASES:
        ctx.phases[name] = run_phase(ctx, name, fn, needs, limits.get(name))
        write(summary(ctx, env, time.perf_counter() - t_start))
    return summary(ctx, env, time.perf_counter() - t_start)


def _free(device: torch.device) -> None:
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

    def write(s: dict) -> None:
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
                json.dump(results_file.finite(s), f, indent=1, allow_nan=False)

    with tempfile.TemporaryDirectory(prefix="miles-gpu-check-") as work:
        s = run(Context(plan, device, work, Tolerances(resume_rtol=rtol)), write)
    results.write(results_path, *results_figures(s))
    print(json.dumps(results_file.finite({k: v for k, v in s.items() if k != "phases"}), indent=1), flush=True)
    statuses = ", ".join(f"{name} {r['status']}" for name, r in s["phases"].items())
    log(f"phases: {statuses}; megatron "
        f"{s['megatron_tokens_per_s'] or float('nan'):.0f} tok/s vs transformers "
        f"{s['transformers_tokens_per_s'] or float('nan'):.0f} tok/s (ratio {s['ratio'] or float('nan'):.2f}, "
        f"target {Tolerances.ratio_target}); resume {'exact' if s['resume_ok'] else 'MISMATCH'}")
    return 1 if s["phases_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
