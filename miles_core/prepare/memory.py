"""The trainer's memory per GPU, estimated from the model's HF config and the run's flags before
anything starts.

    est = estimate(hf_config, cfg)      # MemoryEstimate, bytes per trainer rank
    est.describe()                      # "weights 0.25 GiB, grads ..., total 3.1 GiB per GPU"
    memory_problems(hf_config, cfg)     # [] or one problem naming the flags that would make it fit

What a rank holds (TP size t, DP size d, P parameters, P/t of them on each rank):
- weights: bf16 on GPU (2 B/param), fp32 on CPU (4);
- gradients: Megatron's fp32 main-grad buffer (4 B/param) on GPU; 4 on CPU;
- optimizer: Adam's m and v in fp32 (8 B/param) plus, with bf16 weights, an fp32 master copy (4):
  12 B/param on GPU, 8 on CPU (no master copy). Without the distributed optimizer every DP rank
  keeps all of it: 2 + 4 + 12 = 18 B/param;
- a reference copy of the weights with --use-kl-loss (2 or 4 B/param);
- activations of one micro-batch (b samples padded to s tokens) kept for backward by every layer
  of the local (unfused) layer spec: per layer the two norm inputs, the residual, the attention
  and MLP inputs (each s·b·h), Q/K/V and the context (s·b·(2h + 2·kv)/t), the MLP's hidden
  activations (s·b·3f/t for a gated MLP, 2f/t otherwise) and the unfused attention's score and
  probability matrices (2·b·a·s²/t), at the weights' width;
- the logits of one micro-batch over the full vocabulary on every TP rank (the loss takes a
  log-softmax over all of it): fp32 logits, log-probs and their gradient, 12·b·s·V bytes;
- 1 GiB for the CUDA context, NCCL buffers and the allocator's slack (0 on CPU).
The padded length s is --max-seq-len when set, else the model's maximum positions (an upper bound:
responses are capped by --rollout-max-response-len, prompts only by the dataset).
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


def estimate(hf_config: dict, cfg: RunConfig, *, gpu: bool = True) -> MemoryEstimate:
    """Bytes per trainer rank (see the module docstring); `gpu=False`: the fp32 CPU trainer."""
    shape = Shape.from_hf_config(hf_config)
    tp, _ = _sizes(cfg)
    params = shape.parameters() / tp
    width = 2 if gpu else 4
    b, s = micro_batch_samples(cfg), padded_length(shape, cfg)
    return MemoryEstimate(
        weights=width * params, grads=4 * params, optimizer=(12 if gpu else 8) * params,
        reference=width * params if cfg.train.use_kl_loss else 0.0,
        activations=shape.layers * _layer_activations(shape, b, s, tp, width),
        logits=12.0 * b * s * shape.vocab, overhead=CUDA_OVERHEAD_BYTES if gpu else 0.0)


def _layer_activations(shape: Shape, b: int, s: int, tp: int, width: int) -> float:
    h, f = shape.hidden, shape.ffn
    per_token = 4 * h + (2 * h + 2 * shape.kv_dim) / tp + (3 if shape.gated else 2) * f / tp
    return width * (s * b * per_token + 2 * b * (shape.heads / tp) * s * s)


def memory_problems(hf_config: dict, cfg: RunConfig, budget_gb: float) -> list[str]:
    """[] when the estimate fits `budget_gb` per GPU; else one problem with the estimate and what fits."""
    est = estimate(hf_config, cfg)
    if est.total <= budget_gb * GIB:
        return []
    return [f"the trainer needs about {est.total / GIB:.1f} GiB per GPU ({est.describe()}) and "
            f"--gpu-memory-gb is {budget_gb:g}. {_advice(hf_config, cfg, budget_gb)}"]


def _advice(hf_config: dict, cfg: RunConfig, budget_gb: float) -> str:
    """The smallest change of one flag that fits, when there is one."""
    fixes = []
    for mbs in (64, 32, 16, 8, 4, 2, 1):
        if mbs < cfg.train.micro_batch_size and _fits(hf_config, replace_fields(cfg, micro_batch_size=mbs), budget_gb):
            fixes.append(f"--micro-batch-size {mbs}")
            break
    ranks = cfg.train.actor_num_nodes * cfg.train.actor_num_gpus_per_node
    for tp in (2, 4, 8):
        if cfg.train.tensor_model_parallel_size < tp <= ranks and ranks % tp == 0 and _fits(
                hf_config, replace_fields(cfg, tensor_model_parallel_size=tp), budget_gb):
            fixes.append(f"--tensor-model-parallel-size {tp}")
            break
    if not fixes:
        return "No single change of --micro-batch-size or --tensor-model-parallel-size fits: add trainer GPUs."
    return f"Would fit: {' or '.join(fixes)}."


def _fits(hf_config: dict, cfg: RunConfig, budget_gb: float) -> bool:
    return estimate(hf_config, cfg).total <= budget_gb * GIB
