"""HF <-> Megatron-core state-dict conversion, for every family the adapters describe.

Megatron ships no HF converter, so this is ours. What goes where is each family's tensor map
(miles_core.models.families: `Family.tensors(spec)`, one `Entry` per Megatron tensor); this module
only applies an entry's kind both ways (packing q/k/v per query group, [gate; up], GPT-2's
transposed Conv1D weights) and shards and gathers under tensor parallelism, and gathers each
expert-parallel rank's routed experts under their global numbers (`gather_ep_state`). Conversion is pure
reshaping (no arithmetic), so HF -> Megatron -> HF is bit-exact. Tied embeddings: Megatron has no
output_layer.weight and HF writes no lm_head.weight.
"""

from __future__ import annotations

import json
import os

import torch

from miles_core.models.safetensors_dir import MissingWeights, load_safetensors_dir
from miles_core.train import collectives
from miles_core.models.families import ADAPTERS, Entry, ModelSpec
from miles_core.models.families.tensors import expert_of, with_expert
from miles_core.models.families.tensors import tp_dim as _tp_dim

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


# ---------------------------------------------------------------------------- entry points

def _parts_to_mcore(spec: ModelSpec, e: Entry, parts: list[Tensor]) -> Tensor:
    """One Megatron tensor from its HF tensors (`Entry.kind`; miles_core.models.families.tensors)."""
    if e.kind == "same":
        return parts[0]
    if e.kind == "qkv":
        return pack_qkv(spec, *parts)
    if e.kind == "gate_up":
        return torch.cat(parts, 0)
    if e.kind == "t":
        return parts[0].t().contiguous()
    q, k, v = torch.chunk(parts[0].t() if parts[0].dim() == 2 else parts[0], 3, dim=0)  # c_attn
    return pack_qkv(spec, q, k, v)


def _mcore_to_parts(spec: ModelSpec, e: Entry, t: Tensor) -> list[Tensor]:
    """The HF tensors of one Megatron tensor (inverse of `_parts_to_mcore`)."""
    if e.kind == "same":
        return [t]
    if e.kind == "qkv":
        return list(_unpack_qkv(spec, t))
    if e.kind == "gate_up":
        return [c.contiguous() for c in torch.chunk(t, 2, dim=0)]
    if e.kind == "t":
        return [t.t().contiguous()]
    cat = torch.cat(_unpack_qkv(spec, t), 0)  # c_attn
    return [cat.t().contiguous() if cat.dim() == 2 else cat]


def tensor_map(spec: ModelSpec) -> list[Entry]:
    """The family adapter's entries for `spec` (every Megatron tensor of the unsharded model)."""
    return ADAPTERS[spec.family].tensors(spec)


def hf_to_megatron(spec: ModelSpec, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF tensors -> Megatron GPTModel tensors (canonical names, without `_extra_state`)."""
    out = {}
    for e in tensor_map(spec):
        try:
            parts = [hf_state[n] for n in e.hf]
        except KeyError as err:
            raise ConversionError(f"{spec.family} checkpoint is missing tensor {err.args[0]!r}") from err
        out[e.mcore] = _parts_to_mcore(spec, e, parts)
    return out


def megatron_to_hf(spec: ModelSpec, mcore_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Megatron GPTModel tensors -> HF tensors, as `save_pretrained` would name them (routed experts
    one by one: `mlp.experts.{e}.gate_proj.weight`, the layout of the published checkpoints)."""
    out = {}
    for e in tensor_map(spec):
        if e.mcore not in mcore_state:
            raise ConversionError(f"Megatron state is missing tensor {e.mcore!r} for {spec.family}")
        out.update(zip(e.hf, _mcore_to_parts(spec, e, mcore_state[e.mcore])))
    return out


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

def check_tp(spec: ModelSpec, tp: int) -> None:
    sizes = [("num_key_value_heads", spec.num_kv_heads), ("vocab_size", spec.vocab_size),
             ("intermediate_size", spec.ffn_hidden_size)]
    if spec.moe:
        sizes.append(("moe_intermediate_size", spec.moe_ffn_hidden_size))
    if spec.shared_expert_ffn_hidden_size:
        sizes.append(("the shared experts' width", spec.shared_expert_ffn_hidden_size))
    problems = [f"{what}={n}" for what, n in sizes if n % tp]
    if problems:
        raise ConversionError(f"--tensor-model-parallel-size={tp} must divide {', '.join(problems)}")


def shard_tensor(spec: ModelSpec, name: str, full: Tensor, rank: int, size: int) -> Tensor:
    """The slice of a full Megatron tensor that TP rank `rank` of `size` holds."""
    dim = _tp_dim(name)
    if size == 1 or dim is None:
        return full
    if spec.gated and name.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], 0).contiguous()
    # qkv is packed per query group, so contiguous chunks are whole groups
    return torch.chunk(full, size, dim=dim)[rank].contiguous()


def unshard_tensor(spec: ModelSpec, name: str, parts: list[Tensor]) -> Tensor:
    """Inverse of `shard_tensor` over all ranks' parts."""
    dim = _tp_dim(name)
    if len(parts) == 1 or dim is None:
        return parts[0]
    if spec.gated and name.endswith("linear_fc1.weight"):
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


# ---------------------------------------------------------------------------- expert parallelism

def gather_ep_state(spec: ModelSpec, local: dict[str, Tensor]) -> dict[str, Tensor]:
    """The whole model from every EP rank's tensors (a collective over the expert-parallel group): each
    rank's routed experts, numbered from 0 in its model, renamed to their global index (EP rank r holds
    experts r * E/EP ... (r + 1) * E/EP - 1, `expert_owner`); every other tensor is the same on all EP
    ranks and kept as is. Call it on TP-gathered tensors (`gather_tp_state`)."""
    from megatron.core import parallel_state

    size = parallel_state.get_expert_model_parallel_world_size()
    if size == 1:
        return local
    group = parallel_state.get_expert_model_parallel_group()
    per = spec.num_experts // size
    out = {}
    for name, t in local.items():
        expert = expert_of(name)
        if expert is None:
            out[name] = t
            continue
        for rank, part in enumerate(collectives.all_gather(t, group)):
            out[with_expert(name, rank * per + expert)] = part
    return out
