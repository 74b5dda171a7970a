"""HF <-> Megatron-core state-dict conversion for the llama, qwen2 and gpt2 families.

Megatron ships no HF converter, so this is ours. The mappings (per layer i):
- llama/qwen2: q/k/v_proj -> linear_qkv packed per query group as [q heads of the group; k; v]
  (weights and Qwen2 biases); o_proj -> linear_proj; gate_proj/up_proj -> linear_fc1 = [gate; up]
  (Megatron's GLU applies the activation to the first half); down_proj -> linear_fc2;
  input_layernorm -> input_layernorm; post_attention_layernorm -> pre_mlp_layernorm.
- gpt2: HF Conv1D weights are stored [in, out], so every linear is transposed; c_attn's
  [q; k; v] columns are packed per head (each head is its own query group); ln_1/ln_2/ln_f,
  wte/wpe -> word/position embeddings.
Conversion is pure reshaping (no arithmetic), so HF -> Megatron -> HF is bit-exact. Tied
embeddings: Megatron has no output_layer.weight and HF writes no lm_head.weight.
"""

from __future__ import annotations

import json
import os

import torch

from miles_core.models.safetensors_dir import MissingWeights, load_safetensors_dir
from miles_core.train import collectives
from miles_core.train.megatron_model import ModelSpec

Tensor = torch.Tensor


class ConversionError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


# ---------------------------------------------------------------------------- checkpoint files

def read_hf_config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def load_hf_state(hf_dir: str) -> dict[str, Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded with an index)."""
    try:
        return load_safetensors_dir(hf_dir)
    except MissingWeights as e:
        raise ConversionError(str(e)) from e


# ---------------------------------------------------------------------------- qkv packing

def pack_qkv(spec: ModelSpec, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Megatron's fused qkv rows [q heads of group 0; k0; v0; q heads of group 1; ...] of the
    query groups in `k` (all of them, or one TP rank's: the group count is read off k's rows)."""
    d = spec.head_dim
    g, per = k.shape[0] // d, q.shape[0] // k.shape[0]
    tail = q.shape[1:]
    parts = (q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail).contiguous()


def _unpack_qkv(spec: ModelSpec, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    g, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


# ---------------------------------------------------------------------------- llama / qwen2

def _llama_to_mcore(spec: ModelSpec, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = pack_qkv(
            spec, hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"])
        if spec.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = pack_qkv(
                spec, hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"])
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], 0)
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def _mcore_to_llama(spec: ModelSpec, mc: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"],
           "model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"]
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = mc[m + "input_layernorm.weight"]
        q, k, v = _unpack_qkv(spec, mc[m + "self_attention.linear_qkv.weight"])
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"], out[h + "self_attn.v_proj.weight"] = q, k, v
        if spec.qkv_bias:
            q, k, v = _unpack_qkv(spec, mc[m + "self_attention.linear_qkv.bias"])
            out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"], out[h + "self_attn.v_proj.bias"] = q, k, v
        out[h + "self_attn.o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = mc[m + "pre_mlp_layernorm.weight"]
        gate, up = torch.chunk(mc[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    return out


# ---------------------------------------------------------------------------- gpt2

def _gpt2_to_mcore(spec: ModelSpec, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    out = {"embedding.word_embeddings.weight": hf["wte.weight"],
           "embedding.position_embeddings.weight": hf["wpe.weight"],
           "decoder.final_layernorm.weight": hf["ln_f.weight"],
           "decoder.final_layernorm.bias": hf["ln_f.bias"]}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        h, m = f"h.{i}.", f"decoder.layers.{i}."
        for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[m + b + ".weight"], out[m + b + ".bias"] = hf[h + a + ".weight"], hf[h + a + ".bias"]
        q, k, v = torch.chunk(hf[h + "attn.c_attn.weight"].t(), 3, dim=0)
        out[m + "self_attention.linear_qkv.weight"] = pack_qkv(spec, q, k, v)
        q, k, v = torch.chunk(hf[h + "attn.c_attn.bias"], 3, dim=0)
        out[m + "self_attention.linear_qkv.bias"] = pack_qkv(spec, q, k, v)
        for a, b in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                     ("mlp.c_proj", "mlp.linear_fc2")):
            out[m + b + ".weight"] = hf[h + a + ".weight"].t().contiguous()
            out[m + b + ".bias"] = hf[h + a + ".bias"]
    return out


def _mcore_to_gpt2(spec: ModelSpec, mc: dict[str, Tensor]) -> dict[str, Tensor]:
    t = "transformer."
    out = {t + "wte.weight": mc["embedding.word_embeddings.weight"],
           t + "wpe.weight": mc["embedding.position_embeddings.weight"],
           t + "ln_f.weight": mc["decoder.final_layernorm.weight"],
           t + "ln_f.bias": mc["decoder.final_layernorm.bias"]}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"]
    for i in range(spec.num_layers):
        h, m = f"{t}h.{i}.", f"decoder.layers.{i}."
        for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
            out[h + a + ".weight"], out[h + a + ".bias"] = mc[m + b + ".weight"], mc[m + b + ".bias"]
        q, k, v = _unpack_qkv(spec, mc[m + "self_attention.linear_qkv.weight"])
        out[h + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t().contiguous()
        q, k, v = _unpack_qkv(spec, mc[m + "self_attention.linear_qkv.bias"])
        out[h + "attn.c_attn.bias"] = torch.cat([q, k, v], 0)
        for a, b in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                     ("mlp.c_proj", "mlp.linear_fc2")):
            out[h + a + ".weight"] = mc[m + b + ".weight"].t().contiguous()
            out[h + a + ".bias"] = mc[m + b + ".bias"]
    return out


# ---------------------------------------------------------------------------- entry points

def hf_to_megatron(spec: ModelSpec, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF tensors -> Megatron GPTModel tensors (names without `_extra_state`)."""
    try:
        return _gpt2_to_mcore(spec, hf_state) if spec.family == "gpt2" else _llama_to_mcore(spec, hf_state)
    except KeyError as e:
        raise ConversionError(f"{spec.family} checkpoint is missing tensor {e.args[0]!r}") from e


def megatron_to_hf(spec: ModelSpec, mcore_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Megatron GPTModel tensors -> HF tensors, as `save_pretrained` would name them."""
    mc = {k: v for k, v in mcore_state.items() if not k.endswith("_extra_state")}
    try:
        return _mcore_to_gpt2(spec, mc) if spec.family == "gpt2" else _mcore_to_llama(spec, mc)
    except KeyError as e:
        raise ConversionError(f"Megatron state is missing tensor {e.args[0]!r} for {spec.family}") from e


def load_into_megatron(model, spec: ModelSpec, hf_state: dict[str, Tensor]) -> None:
    """Copy an HF checkpoint into a built GPTModel (this TP rank's shards); every parameter is covered.
    The trainer reads only its shards instead (miles_core.train.hf_shards); this is the reference."""
    from megatron.core import parallel_state

    mc = hf_to_megatron(spec, hf_state)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        check_tp(spec, tp_size)
        rank = parallel_state.get_tensor_model_parallel_rank()
        mc = {k: shard_tensor(spec, k, v, rank, tp_size) for k, v in mc.items()}
    own = model_tensors(model)
    check_names(spec, own, mc)
    for k, dst in own.items():
        copy_checked(k, dst, mc[k])


# Transformer Engine's layer spec fuses each layer's norms into the next linear layer
# (TELayerNormColumnParallelLinear); the local spec's names are the canonical ones everywhere
# (conversion, TP sharding, checkpoints), so a checkpoint moves between the two specs.
TE_FUSED_NORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                  ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def canonical_name(name: str) -> str:
    """The local layer spec's name of a model tensor (Transformer Engine's fused norms renamed)."""
    for fused, local in TE_FUSED_NORMS:
        if fused in name:
            return name.replace(fused, local)
    return name


def model_tensors(model) -> dict[str, Tensor]:
    """The model's tensors by canonical Megatron name (sharing storage with its parameters), no
    `_extra_state`."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def check_names(spec: ModelSpec, own: dict[str, Tensor], loaded) -> None:
    """ConversionError unless `loaded` names exactly the model's tensors `own`."""
    missing = sorted(set(own) - set(loaded))
    extra = sorted(set(loaded) - set(own))
    if missing or extra:
        raise ConversionError(f"{spec.family}: tensors missing {missing[:5]} / unexpected {extra[:5]}")


@torch.no_grad()
def copy_checked(name: str, dst: Tensor, src: Tensor) -> None:
    if src.shape != dst.shape:
        raise ConversionError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src)


def megatron_state(model) -> dict[str, Tensor]:
    """The model's tensors (detached, CPU) by canonical name, without Megatron's `_extra_state` entries."""
    return {canonical_name(k): v.detach().cpu() for k, v in model.state_dict().items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------- tensor parallelism

def _tp_dim(name: str) -> int | None:
    """Which dim Megatron shards `name` on under tensor parallelism (None: replicated)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                      "word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def check_tp(spec: ModelSpec, tp: int) -> None:
    problems = [f"{what}={n}" for what, n in (("num_key_value_heads", spec.num_kv_heads),
                                              ("vocab_size", spec.vocab_size),
                                              ("intermediate_size", spec.ffn_hidden_size)) if n % tp]
    if problems:
        raise ConversionError(f"--tensor-model-parallel-size={tp} must divide {', '.join(problems)}")


def shard_tensor(spec: ModelSpec, name: str, full: Tensor, rank: int, size: int) -> Tensor:
    """The slice of a full Megatron tensor that TP rank `rank` of `size` holds."""
    dim = _tp_dim(name)
    if size == 1 or dim is None:
        return full
    if spec.family != "gpt2" and name.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], 0).contiguous()
    # qkv is packed per query group, so contiguous chunks are whole groups
    return torch.chunk(full, size, dim=dim)[rank].contiguous()


def unshard_tensor(spec: ModelSpec, name: str, parts: list[Tensor]) -> Tensor:
    """Inverse of `shard_tensor` over all ranks' parts."""
    dim = _tp_dim(name)
    if len(parts) == 1 or dim is None:
        return parts[0]
    if spec.family != "gpt2" and name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim=dim)


def gather_tp_state(spec: ModelSpec, local: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full Megatron tensors from every TP rank's shards (a collective over the TP group)."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return local
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, t in local.items():
        if _tp_dim(name) is None:
            out[name] = t
            continue
        out[name] = unshard_tensor(spec, name, collectives.all_gather(t, group))  # CPU, like `local`
    return out
