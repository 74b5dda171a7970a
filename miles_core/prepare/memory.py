"""The trainer's memory per GPU, estimated from the model's HF config and the run's flags before
anything starts.

    est = estimate(hf_config, cfg)      # MemoryEstimate, bytes per trainer rank
    est.describe()                      # "weights 0.25 GiB, grads ..., total 3.1 GiB per GPU"
    memory_problems(hf_config, cfg, 80) # [] or one problem naming the flags that would make it fit
    memory_fit(hf_config, cfg, 80, "--gpu-memory-gb is 80")  # (problems, warnings): see LOWER_BOUND

What a rank holds (TP size t, DP size d, P parameters, P/t of them on each rank, w the weights'
width: 2 bytes in bf16 (always on GPU; --bf16 on CPU), 4 in fp32):
- weights: w B/param;
- gradients: fp32, 4 B/param (Megatron's main-grad buffer; `param.grad` on the CPU default);
- optimizer: Adam's m and v in fp32 (8 B/param) plus, with bf16 weights, an fp32 master copy (4):
  12 B/param in bf16, 8 in fp32. --use-distributed-optimizer shards all of it over the d DP ranks
  (Megatron's ZeRO-1): 12/d. Without it every DP rank keeps all of it: 2 + 4 + 12 = 18 B/param;
- a reference copy of the weights with --use-kl-loss (w B/param);
- activations of one micro-batch of n tokens: b samples padded to s tokens (n = b·s), or with
  --use-dynamic-batch-size one row of n = --max-tokens-per-gpu tokens (b = 1, s = n: the local
  layer spec's unfused attention masks a full n x n score matrix, plus an n x n bool mask). Every
  layer of the local (unfused) layer spec keeps for backward, at the weights' width (counted from
  the autograd graph of megatron-core 0.16.1's local spec): the two norm inputs and outputs (4·n·h,
  divided by t under --sequence-parallel), Q after RoPE, K and V repeated to every head and the
  context (4·n·h/t), the MLP's fc1 output, its activation and fc2's input (4·n·f/t for a gated MLP,
  3f/t otherwise) and the attention probabilities plus, at the peak, the scores being turned into
  them (2·b·(a/t)·s²). Backward holds one more layer's worth of activation gradients at a time, and
  the embedding output, final norm and its output add 3·n·h once. Recomputation keeps less:
  --recompute-granularity full keeps each recomputed layer's input (n·h, /t with sequence parallel)
  and holds one chunk's full activations while it is recomputed (uniform: L/k inputs + k layers;
  block: k inputs + the L - k other layers); selective drops the probabilities of every layer but
  the one being recomputed. tests/unit/test_memory_measured.py holds the estimate to a CPU run's
  peak of live tensors (torch's MemTracker);
- the log-probs' logits: the output layer runs on the loss positions only, in chunks of at most
  64 MiB of fp32 logits (miles_core.train.token_logprobs), and a chunk's logits, shifted logits,
  exponentials and their product and gradients are alive at once: LOGIT_COPIES x one chunk;
- 1 GiB for the CUDA context, NCCL buffers and the allocator's slack (0 on CPU).
The padded length s is --max-seq-len when set, else the model's maximum positions (an upper bound:
responses are capped by --rollout-max-response-len, prompts only by the dataset). Host memory is not
in the estimate: each rank reads only its TP shard of the HF checkpoint (miles_core.train.hf_shards).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from miles_core.config import RunConfig, replace_fields

GIB = 1024 ** 3
CUDA_OVERHEAD_BYTES = 1 * GIB


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model, read from its HF config.json."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    positions: int
    tied: bool
    gated: bool  # a gated (SwiGLU) MLP: llama, qwen2

    @classmethod
    def from_hf_config(cls, c: dict) -> "Shape":
        if c.get("model_type") == "gpt2":
            h = c["n_embd"]
            return cls(c["vocab_size"], h, c["n_layer"], c["n_head"], c["n_head"], c.get("n_inner") or 4 * h,
                       c["n_positions"], bool(c.get("tie_word_embeddings", True)), gated=False)
        heads = c["num_attention_heads"]
        return cls(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads") or heads, c["intermediate_size"],
                   c.get("max_position_embeddings", 4096), bool(c.get("tie_word_embeddings", False)), gated=True)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def parameters(self) -> int:
        """Every parameter of the model (embeddings and norms included)."""
        h, f = self.hidden, self.ffn
        attention = h * h + 2 * h * self.kv_dim + h * h
        mlp = (3 if self.gated else 2) * h * f
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab * h * (1 if self.tied else 2)
        positions = 0 if self.gated else self.positions * h  # gpt2's learned positions; llama/qwen2 use RoPE
        return self.layers * per_layer + embeddings + positions + h


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


def _sizes(cfg: RunConfig) -> tuple[int, int]:
    """(TP, DP) of the trainer."""
    t = cfg.train
    tp = max(1, t.tensor_model_parallel_size)
    return tp, max(1, t.actor_num_nodes * t.actor_num_gpus_per_node // tp)


def micro_batch_samples(cfg: RunConfig) -> int:
    """Samples in one micro-batch of one DP rank: --micro-batch-size, at most the rank's share of a step."""
    per_step = cfg.train.global_batch_size or cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return max(1, min(cfg.train.micro_batch_size, -(-per_step // _sizes(cfg)[1])))


def padded_length(shape: Shape, cfg: RunConfig) -> int:
    return min(cfg.data.max_seq_len or shape.positions, shape.positions)


def micro_batch_layout(shape: Shape, cfg: RunConfig) -> tuple[int, int]:
    """(b, s) of one micro-batch: b samples of s tokens, or one packed row of the token budget
    (at least one padded sample: a longer sample gets a micro-batch of its own)."""
    if cfg.train.use_dynamic_batch_size and cfg.train.max_tokens_per_gpu:
        return 1, max(cfg.train.max_tokens_per_gpu, padded_length(shape, cfg))
    return micro_batch_samples(cfg), padded_length(shape, cfg)


def estimate(hf_config: dict, cfg: RunConfig, *, gpu: bool = True) -> MemoryEstimate:
    """Bytes per trainer rank (see the module docstring); `gpu=False`: the trainer on a CPU."""
    shape = Shape.from_hf_config(hf_config)
    t = cfg.train
    tp, dp = _sizes(cfg)
    params = shape.parameters() / tp
    bf16 = gpu or t.bf16
    width = 2 if bf16 else 4
    optimizer = (12 if bf16 else 8) * params / (dp if t.use_distributed_optimizer else 1)
    b, s = micro_batch_layout(shape, cfg)
    return MemoryEstimate(
        weights=width * params, grads=4 * params, optimizer=optimizer,
        reference=width * params if t.use_kl_loss else 0.0,
        activations=_activations(shape, cfg, b, s, tp, width),
        logits=_logits(shape, b * s, tp), overhead=CUDA_OVERHEAD_BYTES if gpu else 0.0)


def _activations(shape: Shape, cfg: RunConfig, b: int, s: int, tp: int, width: int) -> float:
    """Activation bytes one micro-batch keeps for backward, under the recompute flags (module doc)."""
    t = cfg.train
    sp = tp if t.sequence_parallel else 1
    h = shape.hidden
    per_token = 4 * h / sp + 4 * h / tp + (4 if shape.gated else 3) * shape.ffn / tp
    layer_tokens = width * b * s * per_token
    scores = width * 2 * b * (shape.heads / tp) * s * s
    once = width * b * s * 3 * h / sp + (s * s if t.use_dynamic_batch_size else 0)  # + the packed row's bool mask
    layer, layers = layer_tokens + scores, shape.layers
    working = layer  # backward: the gradients of one layer's activations
    if t.recompute_granularity == "selective":
        return layers * layer_tokens + scores + working + once
    if t.recompute_granularity == "full":
        saved = width * b * s * h / sp  # a recomputed layer's input
        k = min(t.recompute_num_layers or layers, layers)
        if t.recompute_method == "block":
            return (layers - k) * layer + k * saved + layer + working + once
        return -(-layers // k) * saved + k * layer + working + once
    return layers * layer + working + once


LOGIT_COPIES = 6  # fp32 logits, shifted, exp, exp x shifted; their gradients in backward
# miles_core.train.token_logprobs.CHUNK_BYTES, repeated so that validation never imports torch
# (tests/unit/test_memory_estimate.py checks they agree)
CHUNK_BYTES = 64 * 2**20


def _logits(shape: Shape, tokens: int, tp: int) -> float:
    """Bytes of the chunked log-prob computation's logits (miles_core.train.token_logprobs)."""
    vocab_rows = shape.vocab / tp
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
    for flags in _changes(cfg):
        fits = _fits(hf_config, replace_fields(cfg, **_fields(flags)), budget_gb)
        if fits and not any(f.split()[0] == flags[0] for f in fixes):  # a flag's first fitting value only
            fixes.append(" ".join(flags))
    if not fixes:
        return "No single change of the memory flags fits: add trainer GPUs."
    return f"Would fit: {' or '.join(fixes)}."


def _changes(cfg: RunConfig) -> list[tuple[str, ...]]:
    """Candidate single changes, most preferred first (a flag's first fitting value wins)."""
    t = cfg.train
    tp, dp = _sizes(cfg)
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
    out += [("--tensor-model-parallel-size", str(n)) for n in (2, 4, 8) if tp < n <= ranks and ranks % n == 0]
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
