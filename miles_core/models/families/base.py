"""What every family adapter shares: the config readers (RoPE, attention width, the checks every
llama-like family makes) and the tensor entries of the decoder layer's pieces."""

from __future__ import annotations

from typing import Any

from miles_core.models.families.spec import ModelSpec, UnsupportedModel
from miles_core.models.families.tensors import Entry

ROPE_TYPES = ("default", "llama3")


class Family:
    """One HF model family: its config.json read into a `ModelSpec` and its tensor map.

    model_type: config.json's; hf_class: its `architectures` entry; config_class: transformers'
    config class (for the builtin tiny models and the tests)."""

    model_type: str = ""
    hf_class: str = ""
    config_class: str = ""
    rope_types: tuple[str, ...] = ("default",)

    def spec(self, cfg: dict[str, Any]) -> ModelSpec:
        raise NotImplementedError

    def tensors(self, spec: ModelSpec) -> list[Entry]:
        raise NotImplementedError

    def refuse(self, what: str, handled: str) -> UnsupportedModel:
        return UnsupportedModel(f"{self.model_type} {what} is not supported ({handled})")


# ---------------------------------------------------------------------------- config readers


def rope_fields(fam: Family, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec's RoPE fields from `rope_parameters` (transformers 5), `rope_scaling` (older
    configs; `type` is the legacy spelling of `rope_type`) and the top-level `rope_theta` /
    `partial_rotary_factor`; a RoPE type the family does not handle is refused by name."""
    params: dict[str, Any] = {}
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field) or {}
        if not isinstance(rope, dict):
            raise UnsupportedModel(f"{fam.model_type} {field}={rope!r}: expected a mapping")
        for key in ("rope_type", "type"):
            kind = rope.get(key, "default")
            if kind not in fam.rope_types:
                raise UnsupportedModel(f"{fam.model_type} {field}.{key}={kind!r} is not supported: "
                                       f"{fam.model_type} handles {' and '.join(fam.rope_types)} RoPE")
            if kind != "default":
                params = {**rope, "rope_type": kind}
    base = cfg.get("rope_parameters") or {}
    theta = float(base.get("rope_theta", (cfg.get("rope_scaling") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    fraction = float(base.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    out: dict[str, Any] = {"rope_theta": theta, "rotary_fraction": fraction}
    if params.get("rope_type") == "llama3":
        out.update(rope_type="llama3", rope_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   rope_original_max_positions=int(params.get("original_max_position_embeddings", 8192)))
    return out


def attention_fields(fam: Family, cfg: dict[str, Any]) -> dict[str, Any]:
    """Heads, KV heads and head_dim (which Qwen3 sets apart from hidden_size / heads)."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise UnsupportedModel(f"{fam.model_type} num_attention_heads={heads} is not a multiple of "
                               f"num_key_value_heads={kv}")
    return {"num_heads": heads, "num_kv_heads": kv,
            "head_dim_": 0 if head_dim * heads == cfg["hidden_size"] else int(head_dim)}


def check_llama_like(fam: Family, cfg: dict[str, Any]) -> None:
    """The options no llama-like adapter handles, refused by name."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise fam.refuse(f"hidden_act={cfg.get('hidden_act')!r}", "only silu")
    if cfg.get("mlp_bias"):
        raise fam.refuse("mlp_bias=true", "MLPs without biases only")
    if cfg.get("use_sliding_window"):
        raise fam.refuse(f"use_sliding_window=true (sliding_window={cfg.get('sliding_window')!r})", "full attention only")
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
        raise fam.refuse("layer_types other than full_attention", "full attention only")


def llama_like_fields(fam: Family, cfg: dict[str, Any], **extra) -> dict[str, Any]:
    """The ModelSpec fields every llama-like family reads the same way."""
    check_llama_like(fam, cfg)
    return dict(family=fam.model_type, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"], ffn_hidden_size=cfg["intermediate_size"],
                max_positions=cfg.get("max_position_embeddings", 4096), norm_eps=cfg.get("rms_norm_eps", 1e-6),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                **attention_fields(fam, cfg), **rope_fields(fam, cfg), **extra)


# ---------------------------------------------------------------------------- tensor entries


def embedding_entries(spec: ModelSpec) -> list[Entry]:
    out = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
           Entry("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not spec.tied_embeddings:
        out.append(Entry("output_layer.weight", ("lm_head.weight",)))
    return out


def attention_entries(spec: ModelSpec, i: int) -> list[Entry]:
    h, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    out = [Entry(m + "linear_qkv.weight", tuple(f"{h}{x}_proj.weight" for x in "qkv"), "qkv"),
           Entry(m + "linear_proj.weight", (h + "o_proj.weight",))]
    if spec.qkv_bias:
        out.append(Entry(m + "linear_qkv.bias", tuple(f"{h}{x}_proj.bias" for x in "qkv"), "qkv"))
    if spec.qk_norm:
        out += [Entry(m + "q_layernorm.weight", (h + "q_norm.weight",)),
                Entry(m + "k_layernorm.weight", (h + "k_norm.weight",))]
    return out


def norm_entries(i: int) -> list[Entry]:
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    return [Entry(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
            Entry(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",))]


def mlp_entries(hf: str, mc: str) -> list[Entry]:
    """A gated MLP at HF prefix `hf` (gate_proj, up_proj, down_proj) as Megatron's at `mc`."""
    return [Entry(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), "gate_up"),
            Entry(mc + "linear_fc2.weight", (hf + "down_proj.weight",))]


def moe_entries(spec: ModelSpec, i: int, *, shared: bool = False, bias_name: str | None = None) -> list[Entry]:
    """A MoE layer's router, routed experts (HF `mlp.experts.{e}.*`, Megatron's SequentialMLP
    `mlp.experts.local_experts.{e}.*`) and, with `shared`, its shared experts."""
    h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    out = [Entry(m + "router.weight", (h + "gate.weight",))]
    if bias_name:
        out.append(Entry(m + "router.expert_bias", (h + bias_name,)))
    for e in range(spec.num_experts):
        out += mlp_entries(f"{h}experts.{e}.", f"{m}experts.local_experts.{e}.")
    if shared:
        out += mlp_entries(h + "shared_experts.", m + "shared_experts.")
    return out


def decoder_entries(spec: ModelSpec, moe_layer=None) -> list[Entry]:
    """Every tensor of a llama-like decoder; `moe_layer(spec, i)`: a MoE layer's MLP entries."""
    out = embedding_entries(spec)
    for i in range(spec.num_layers):
        out += norm_entries(i) + attention_entries(spec, i)
        if spec.is_moe_layer(i):
            out += moe_layer(spec, i)
        else:
            out += mlp_entries(f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp.")
    return out
