"""The one description of a model every role reads: `ModelSpec`, built from an HF config.json by
its family's adapter (miles_core.models.families), never by hand.

It is plain data (no torch): the importer and the validation before a run read it, the trainer
builds Megatron's config from it, the CPU engine its forward, the memory estimate its counts. The
checkpoint metadata stores `dataclasses.asdict(spec)`, so every field is a JSON value.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModel(ValueError):
    """A config.json the project cannot train or serve; the message names the field and what is handled."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # the HF model_type of the adapter that read it (miles_core.models.families.FAMILIES)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int  # a dense layer's MLP width
    max_positions: int
    norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    head_dim_: int = 0  # 0: hidden_size // num_heads (config.json's head_dim where it sets one)
    # layout
    norm: str = "rms"  # "rms" | "layer"
    activation: str = "silu"  # "silu" (gated: SwiGLU) | "gelu_tanh"
    gated: bool = True
    linear_bias: bool = False  # biases on every linear layer (gpt2)
    positions: str = "rope"  # "rope" | "learned"
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, GLM's use_qk_norm)
    # RoPE
    rope_type: str = "default"  # "default" | "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    rotary_fraction: float = 1.0  # partial rotary: the first fraction of each head's dims is rotated
    # mixture of experts (num_experts 0: dense)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    router_score: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    expert_bias: bool = False  # GLM's e_score_correction_bias: added to the scores for the choice only
    routed_scaling_factor: float = 1.0
    router_groups: int = 0  # grouped top-k: experts in this many groups (0 or 1: none) ...
    router_group_topk: int = 0  # ... of which the best this many are eligible
    moe_layers: tuple[int, ...] = ()  # the indices of the layers whose MLP is a MoE layer
    aux_loss_coef: float = 0.0  # transformers' router_aux_loss_coef (qwen3_moe)

    # from_hf_config(cfg): the spec of an HF config.json dict, read by its family's adapter; set by
    # miles_core.models.families (it is `spec_of`), which knows the adapters this module does not.

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    # ---- counts (the memory estimate's; no torch) --------------------------------------------
    def attention_parameters(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = h * (q + 2 * kv) + q * h
        if self.qkv_bias or self.linear_bias:
            out += q + 2 * kv
        if self.linear_bias:
            out += h
        if self.qk_norm:
            out += 2 * self.head_dim
        return out

    def mlp_parameters(self, width: int) -> int:
        h = self.hidden_size
        return (3 if self.gated else 2) * h * width + ((width + h) if self.linear_bias else 0)

    def expert_parameters(self) -> int:
        """Parameters of the routed experts of every MoE layer (what expert parallelism divides)."""
        return len(self.moe_layers) * self.num_experts * self.mlp_parameters(self.moe_ffn_hidden_size)

    def parameters(self) -> int:
        """Every parameter of the model (embeddings, norms, routers and experts included)."""
        h = self.hidden_size
        norms = (2 if self.linear_bias else 1) * h
        total = 0
        for i in range(self.num_layers):
            total += self.attention_parameters() + 2 * norms
            if self.is_moe_layer(i):
                total += self.num_experts * h + (self.num_experts if self.expert_bias else 0)
                total += self.mlp_parameters(self.shared_expert_ffn_hidden_size) if self.shared_expert_ffn_hidden_size else 0
            else:
                total += self.mlp_parameters(self.ffn_hidden_size)
        total += self.expert_parameters()
        total += self.vocab_size * h * (1 if self.tied_embeddings else 2) + norms
        if self.positions == "learned":
            total += self.max_positions * h
        return total

    def active_parameters(self) -> int:
        """Parameters one token passes through (the routed experts: its top-k of them)."""
        if not self.moe:
            return self.parameters()
        return self.parameters() - len(self.moe_layers) * (self.num_experts - self.moe_topk) * \
            self.mlp_parameters(self.moe_ffn_hidden_size)
