"""The trainer's memory per GPU, estimated from the model's HF config and the run's flags before
anything starts.

    est = estimate(hf_config, cfg)      # MemoryEstimate, bytes per trainer rank
    est.describe()                      # "weights 0.25 GiB, grads ..., total 3.1 GiB per GPU"
    memory_problems(hf_config, cfg, 80) # [] or one problem naming the flags that would make it fit
    memory_fit(hf_config, cfg, 80, "--gpu-memory-gb is 80")  # (problems, warnings): see LOWER_BOUND

The model is read through its family's ModelSpec (miles_core.models.families: the counts every role
agrees on). What a rank holds (TP size t, DP size d, P parameters, w the weights' width: 2 bytes in
bf16 (always on GPU; --bf16 on CPU), 4 in fp32):
- which parameters: the dense ones (attention, norms, dense and shared-expert MLPs, embeddings) over
  the t TP ranks, a MoE layer's router whole on every rank, and the routed experts over the EP x ETP
  ranks (--expert-model-parallel-size e; the expert TP size is Megatron's default, t): each rank
  holds num_experts / e of them, each cut in t. Megatron's expert data-parallel group, over which the
  experts' gradients are reduced and their optimizer state sharded, has world / (t x e) ranks;
- weights: w B/param;
- gradients: fp32, 4 B/param (Megatron's main-grad buffer; `param.grad` on the CPU default);
- optimizer: Adam's m and v in fp32 (8 B/param) plus, with bf16 weights, an fp32 master copy (4):
  12 B/param in bf16, 8 in fp32. --use-distributed-optimizer shards it (Megatron's ZeRO-1) over the d
  DP ranks for dense parameters, over the expert-DP ranks for the routed experts. Without it every
  DP rank keeps all of it: 2 + 4 + 12 = 18 B/param;
- a reference copy of the weights with --use-kl-loss (w B/param);
- activations of one micro-batch of n tokens: b samples padded to s tokens (n = b·s), or with
  --use-dynamic-batch-size one row of n = --max-tokens-per-gpu tokens (b = 1, s = n: the local
  layer spec's unfused attention masks a full n x n score matrix, plus an n x n bool mask). Every
  layer of the local (unfused) layer spec keeps for backward, at the weights' width (counted from
  the autograd graph of megatron-core 0.16.1's local spec): the two norm inputs and outputs (4·n·h,
  divided by t under --sequence-parallel), Q after RoPE, K and V repeated to every head and the
  context (4·n·q/t, q = heads x head_dim: Qwen3's head_dim is its own), with q/k norms their inputs
  (n·(q + kv)/t), the MLP's fc1 output, its activation and fc2's input (4·n·f/t for a gated MLP, 3f/t
  otherwise) and, with the local spec's unfused attention, the softmax output (in fp32 when the
  weights are bf16) and the probabilities: (4 + w)·b·(a/t)·s² bytes in bf16, w·b·(a/t)·s² in fp32,
  with 4·w·b·(a/t)·s² more at the attention's peak (`_attention_planes`; Transformer Engine's fused
  attention, `--transformer-impl transformer_engine`, keeps none). A MoE layer keeps instead of the dense MLP's: the router's logits and scores
  (2·n·E), the n·k token copies dispatched to the experts and their outputs before the combine
  (2·n·k·h), the experts' fc1/activation/fc2 input for those n·k copies at width moe_ffn / t (with
  balanced routing a rank's experts receive n·k copies whatever e is) and a shared expert's MLP.
  Backward holds one more layer's worth of activation gradients at a time, and
  the embedding output, final norm and its output add 3·n·h once. Recomputation keeps less:
  --recompute-granularity full keeps each recomputed layer's input (n·h, /t with sequence parallel)
  and holds one chunk's full activations while it is recomputed (uniform: L/k inputs + k layers;
  block: k inputs + the L - k other layers); selective drops the probabilities of every layer but
  the one being recomputed. tests/integration/test_memory_measured.py holds the estimate to a CPU run's
  peak of live tensors (torch's MemTracker), on dense models and on tiny Qwen3-MoE and GLM-4.5
  (EP=1, its activations mostly the top-k copies and their experts': the estimate is 1.11-1.16x the
  measured peak, 1.34-1.46x under full recompute, as a dense model's);
- the log-probs' logits: the output layer runs on the loss positions only, in chunks of at most
  64 MiB of fp32 logits (miles_core.train.token_logprobs), and a chunk's logits, shifted logits,
  exponentials and their product and gradients are alive at once: LOGIT_COPIES x one chunk;
- 1 GiB for the CUDA context, NCCL buffers and the allocator's slack (0 on CPU).
The padded length s is --max-seq-len when set, else the model's maximum positions (an upper bound:
responses are capped by --rollout-max-response-len, prompts only by the dataset). Host memory is not
in the estimate: each rank reads only its TP (and EP) shard of the HF checkpoint
(miles_core.train.hf_shards). docs/models.md gives the estimate of Qwen3-8B and Qwen3-30B-A3B.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields

from miles_core.config import RunConfig, replace_fields
from miles_core.config.sections import DataSection, TrainSection
from miles_core.models.families import ModelSpec, spec_of

GIB = 1024 ** 3
CUDA_OVERHEAD_BYTES = 1 * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    reference: float
    activations: float
    logits: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GIB:.2f}" for f in fields(self) if getattr(self, f.name))
        return f"{parts}; total {self.total / GIB:.2f} GiB per trainer rank"


def _sizes(t: TrainSection) -> tuple[int, int]:
    """(TP, DP) of the trainer."""
    tp = max(1, t.tensor_model_parallel_size)
    return tp, max(1, t.actor_num_nodes * t.actor_num_gpus_per_node // tp)


def expert_sizes(t: TrainSection) -> tuple[int, int, int]:
    """(expert TP, EP, expert DP) of the trainer: Megatron's expert tensor-parallel size defaults to
    the TP size, and its expert data-parallel group is what is left of the ranks, world / (ETP x EP)."""
    tp, dp = _sizes(t)
    ep = max(1, t.expert_model_parallel_size)
    etp = max(1, t.expert_tensor_parallel_size or tp)
    return etp, ep, max(1, tp * dp // (etp * ep))


def router_parameters(spec: ModelSpec) -> int:
    """The routers' weights and expert biases: whole on every rank."""
    return len(spec.moe_layers) * (spec.num_experts * spec.hidden_size + (spec.num_experts if spec.expert_bias else 0))


def rank_parameters(spec: ModelSpec, t: TrainSection) -> tuple[float, float]:
    """(dense, routed-expert) parameters one trainer rank holds."""
    tp, _ = _sizes(t)
    etp, ep, _ = expert_sizes(t)
    experts, routers = spec.expert_parameters(), router_parameters(spec)
    return (spec.parameters() - experts - routers) / tp + routers, experts / (ep * etp)


def micro_batch_samples(cfg: RunConfig) -> int:
    """Samples in one micro-batch of one DP rank: --micro-batch-size, at most the rank's share of a step."""
    per_step = cfg.train.global_batch_size or cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return max(1, min(cfg.train.micro_batch_size, -(-per_step // _sizes(cfg.train)[1])))


def padded_length(spec: ModelSpec, data: DataSection) -> int:
    return min(data.max_seq_len or spec.max_positions, spec.max_positions)


def micro_batch_layout(spec: ModelSpec, cfg: RunConfig) -> tuple[int, int]:
    """(b, s) of one micro-batch: b samples of s tokens, or one packed row of the token budget
    (at least one padded sample: a longer sample gets a micro-batch of its own)."""
    if cfg.train.use_dynamic_batch_size and cfg.train.max_tokens_per_gpu:
        return 1, max(cfg.train.max_tokens_per_gpu, padded_length(spec, cfg.data))
    return micro_batch_samples(cfg), padded_length(spec, cfg.data)


def estimate(hf_config: dict, cfg: RunConfig, *, gpu: bool = True) -> MemoryEstimate:
    """Bytes per trainer rank (see the module docstring); `gpu=False`: the trainer on a CPU."""
    spec = spec_of(hf_config)
    t = cfg.train
    _, dp = _sizes(cfg.train)
    _, _, edp = expert_sizes(cfg.train)
    dense, experts = rank_parameters(spec, cfg.train)
    params = dense + experts
    bf16 = gpu or t.bf16
    width = 2 if bf16 else 4
    shards = (dp, edp) if t.use_distributed_optimizer else (1, 1)
    optimizer = (12 if bf16 else 8) * (dense / shards[0] + experts / shards[1])
    b, s = micro_batch_layout(spec, cfg)
    return MemoryEstimate(
        weights=width * params, grads=4 * params, optimizer=optimizer,
        reference=width * params if t.use_kl_loss or t.kl_coef != 0 else 0.0,
        activations=_activations(spec, cfg.train, b, s, width),
        logits=_logits(spec, b * s, _sizes(cfg.train)[0]), overhead=CUDA_OVERHEAD_BYTES if gpu else 0.0)


def _mlp_per_token(spec: ModelSpec, width: int, tp: int) -> float:
    """Elements one token's pass through an MLP of `width` keeps (fc1 output, activation, fc2 input)."""
    return (4 if spec.gated else 3) * width / tp


def _layer_per_token(spec: ModelSpec, t: TrainSection, moe: bool) -> float:
    """Elements one token keeps in a layer (norms, attention, the dense or MoE MLP; module doc)."""
    tp, _ = _sizes(t)
    etp, _, _ = expert_sizes(t)
    sp = tp if t.sequence_parallel else 1
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out = 4 * h / sp + 4 * q / tp + ((q + kv) / tp if spec.qk_norm else 0)
    if not moe:
        return out + _mlp_per_token(spec, spec.ffn_hidden_size, tp)
    k = spec.moe_topk
    out += 2 * spec.num_experts + 2 * k * h + k * _mlp_per_token(spec, spec.moe_ffn_hidden_size, etp)
    if spec.shared_expert_ffn_hidden_size:
        out += _mlp_per_token(spec, spec.shared_expert_ffn_hidden_size, tp)
    return out


def _activations(spec: ModelSpec, t: TrainSection, b: int, s: int, width: int) -> float:
    """Activation bytes one micro-batch keeps for backward, under the recompute flags (module doc).
    Dense and MoE layers differ: a chunk being recomputed or the layer whose gradients backward holds
    is counted as the larger of the two, the not recomputed layers at their mean."""
    tp, _ = _sizes(t)
    sp = tp if t.sequence_parallel else 1
    h, layers, moe = spec.hidden_size, spec.num_layers, len(spec.moe_layers)
    kept, peak = _attention_planes(t, b * (spec.num_heads / tp) * s * s, width)
    tokens = [width * b * s * _layer_per_token(spec, t, m) for m in (False, True)]
    layer_tokens = (layers - moe) * tokens[0] + moe * tokens[1]  # every layer's
    largest = max(tokens[0] if moe < layers else 0.0, tokens[1] if moe else 0.0)
    biggest = largest + kept  # one layer's whole activations (a chunk being recomputed holds these)
    mean = layer_tokens / layers + kept
    once = width * b * s * 3 * h / sp + (s * s if t.use_dynamic_batch_size else 0)  # + the packed row's bool mask
    working = largest + peak  # backward: the gradients of one layer's activations, the attention's peak
    if t.recompute_granularity == "selective":
        return layer_tokens + kept + working + once
    if t.recompute_granularity == "full":
        saved = width * b * s * h / sp  # a recomputed layer's input
        k = min(t.recompute_num_layers or layers, layers)
        # the recomputed layer in backward has its s x s state in the attention's peak, not twice
        if t.recompute_method == "block":
            return (layers - k) * mean + k * saved + biggest - kept + working + once
        return -(-layers // k) * saved + k * biggest - kept + working + once
    return layers * mean + working + once


def _attention_planes(t: TrainSection, plane: float, width: int) -> tuple[float, float]:
    """(bytes each layer keeps, bytes at the attention's peak) of the s x s score planes (`plane`
    elements: b x heads/t x s x s), for the attention `--transformer-impl` runs. Megatron's local
    (unfused) attention keeps the softmax output, in fp32 when the weights are bf16
    (attention_softmax_in_fp32), and the probabilities at the weights' width for the value product;
    its peak (the persistent score buffer, the scores being turned into probabilities or their
    gradients in fp32) is 4 planes at the weights' width. Measured on CPU (bf16 and fp32, 2 and 4
    layers, 1,024 and 2,048 tokens): 6 and 4 bytes per element per layer, 8 and 16 at the peak.
    Transformer Engine's fused attention keeps no s x s state."""
    if transformer_impl_of(t) == "transformer_engine":
        return 0.0, 0.0
    return plane * (width + (4 if width < 4 else 0)), plane * 4 * width


def transformer_impl_of(train: TrainSection) -> str:
    """The attention the estimate counts: `auto` is counted as local (the upper bound) before the run,
    which cannot see whether the trainer's nodes have Transformer Engine; a trainer rank resolves it
    first (`impl_on_this_node`)."""
    impl = train.transformer_impl
    return "transformer_engine" if impl == "transformer_engine" else "local"


def transformer_engine_importable() -> bool:
    """Transformer Engine is installed in this process's environment (the project's GPU image builds it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def impl_on_this_node(train: TrainSection) -> str:
    """`--transformer-impl` as a trainer rank with CUDA resolves it here: `auto` is transformer_engine
    where Transformer Engine is installed, else local (miles_core.train.megatron_model.transformer_impl)."""
    if train.transformer_impl != "auto":
        return train.transformer_impl
    return "transformer_engine" if transformer_engine_importable() else "local"


LOGIT_COPIES = 6  # fp32 logits, shifted, exp, exp x shifted; their gradients in backward
# miles_core.train.token_logprobs.CHUNK_BYTES, repeated so that validation never imports torch
# (tests/unit/test_memory_estimate.py checks they agree)
CHUNK_BYTES = 64 * 2**20


def _logits(spec: ModelSpec, tokens: int, tp: int) -> float:
    """Bytes of the chunked log-prob computation's logits (miles_core.train.token_logprobs)."""
    vocab_rows = spec.vocab_size / tp
    rows = min(tokens, max(1, CHUNK_BYTES // (4 * vocab_rows)))
    return LOGIT_COPIES * 4.0 * rows * vocab_rows


# The real peak is at least this share of the estimate (docs/training.md, "Memory per GPU": the
# measured peaks lie 0.71-0.97x of it, the tests hold it to 0.75-1.25x): below it a run cannot fit.
LOWER_BOUND = 0.75


def memory_fit(hf_config: dict, cfg: RunConfig, memory_gb: float, has: str) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the trainer's estimate against `memory_gb` GiB per GPU, `has` saying
    whose memory that is ("--gpu-memory-gb is 80", "this trainer rank's GPU has 139.8 GiB"): a problem (the
    run is refused) when even LOWER_BOUND x the estimate exceeds it, a warning (the run goes on) when
    only the estimate does; each with the estimate and every single change of the flags that fits."""
    est = estimate(hf_config, cfg)
    if est.total <= memory_gb * GIB:
        return [], []
    needs = (f"the trainer needs about {est.total / GIB:.1f} GiB per GPU ({est.describe()}) and {has}. "
             f"{_advice(hf_config, cfg, memory_gb)}")
    if LOWER_BOUND * est.total > memory_gb * GIB:
        return [needs], []
    return [], [f"{needs} The estimate is an upper bound and {LOWER_BOUND:g}x of it fits, so the run goes on; "
                "it may run out of GPU memory."]


def budget_fit(hf_config: dict, cfg: RunConfig, budget_gb: float) -> tuple[list[str], list[str]]:
    """`memory_fit` against --gpu-memory-gb `budget_gb`."""
    return memory_fit(hf_config, cfg, budget_gb, f"--gpu-memory-gb is {budget_gb:g}")


def memory_problems(hf_config: dict, cfg: RunConfig, budget_gb: float) -> list[str]:
    """[] when the trainer can fit `budget_gb` per GPU (`budget_fit`); else one problem with the estimate
    and what fits."""
    return budget_fit(hf_config, cfg, budget_gb)[0]


def device_memory_bytes() -> int | None:
    """Total memory of this process's current CUDA device; None without CUDA (torch imported here only:
    validation never imports it)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _advice(hf_config: dict, cfg: RunConfig, budget_gb: float) -> str:
    """Each single change of the flags that would make the run fit (the smallest such value of each)."""
    fixes = []
    for flags in _changes(cfg.train, spec_of(hf_config)):
        fits = _fits(hf_config, replace_fields(cfg, **_fields(flags)), budget_gb)
        if fits and not any(f.split()[0] == flags[0] for f in fixes):  # a flag's first fitting value only
            fixes.append(" ".join(flags))
    if not fixes:
        return "No single change of the memory flags fits: add trainer GPUs."
    return f"Would fit: {' or '.join(fixes)}."


def _changes(t: TrainSection, spec: ModelSpec) -> list[tuple[str, ...]]:
    """Candidate single changes, most preferred first (a flag's first fitting value wins)."""
    tp, dp = _sizes(t)
    ranks = tp * dp
    out: list[tuple[str, ...]] = []
    if dp > 1 and not t.use_distributed_optimizer:
        out.append(("--use-distributed-optimizer",))
    if t.recompute_granularity != "full":
        out.append(("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"))
    if tp > 1 and not t.sequence_parallel:
        out.append(("--sequence-parallel",))
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu:
        out += [("--max-tokens-per-gpu", str(n)) for n in (32768, 16384, 8192, 4096, 2048) if n < t.max_tokens_per_gpu]
    else:
        out += [("--micro-batch-size", str(m)) for m in (64, 32, 16, 8, 4, 2, 1) if m < t.micro_batch_size]
    # a TP size must leave room for the expert-parallel groups (ETP = TP); a MoE layer trains under TP only
    # with sequence parallelism
    etp, ep, _ = expert_sizes(t)
    sp = ("--sequence-parallel",) if spec.moe and not t.sequence_parallel else ()
    out += [("--tensor-model-parallel-size", str(n), *sp) for n in (2, 4, 8)
            if tp < n <= ranks and ranks % (n * ep) == 0]
    if spec.moe:  # the routed experts over more ranks
        out += [("--expert-model-parallel-size", str(n)) for n in (2, 4, 8, 16, 32, 64)
                if ep < n and ranks % (etp * n) == 0 and spec.num_experts % n == 0]
    return out


def _fields(flags: tuple[str, ...]) -> dict:
    """{field: value} of a flag list like ("--micro-batch-size", "8", "--sequence-parallel")."""
    out, i = {}, 0
    while i < len(flags):
        name = flags[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            out[name] = int(value) if value.isdigit() else value
            i += 2
        else:
            out[name], i = True, i + 1
    return out


def _fits(hf_config: dict, cfg: RunConfig, budget_gb: float) -> bool:
    return estimate(hf_config, cfg).total <= budget_gb * GIB
