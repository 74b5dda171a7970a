"""Loading an HF checkpoint into Megatron models, each TP rank reading only the part it holds.

`load_hf_checkpoint(models, spec, hf_dir)` fills every built GPTModel of `models` (the policy and
the KL reference; None entries are skipped) with this tensor-parallel rank's shards, reading each
tensor once for all of them. Instead of the whole checkpoint (hf_convert.load_hf_state), the rank
reads through safetensors' lazy slices (miles_core.models.safetensors_dir.SafetensorsReader) only:
- rows of the column-parallel tensors (qkv and fc1, with their biases) and of the vocab-parallel
  ones (word embeddings, output layer); columns of the row-parallel ones (proj, fc2; gpt2's
  Conv1D weights are stored [in, out], so there rows and columns swap);
- for the fused tensors, its slice of each HF tensor: qkv from its query groups' rows of q, k and v
  (gpt2: its heads' columns of c_attn), fc1 from its rows of gate and of up;
- replicated tensors (norms, position embeddings, row-parallel biases) whole.
Each rank's part is the chunk torch.chunk gives, so the result is exactly
hf_convert.load_into_megatron's. Tensors are read and copied one at a time: beside the models a
rank holds at most one fused shard (the others are views of the memory-mapped file).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from miles_core.models.safetensors_dir import MissingWeights, SafetensorsReader
from miles_core.train.hf_convert import ConversionError, check_names, check_tp, copy_checked, model_tensors, pack_qkv
from miles_core.train.megatron_model import ModelSpec

Tensor = torch.Tensor
Read = Callable[[], Tensor]
log = logging.getLogger(__name__)


def load_hf_checkpoint(models: list, spec: ModelSpec, hf_dir: str) -> None:
    """Copy this TP rank's shards of the HF checkpoint `hf_dir` into every model of `models`."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    check_tp(spec, size)
    owns = [model_tensors(m) for m in models if m is not None]
    with open_checkpoint(hf_dir) as reader:
        reads = rank_tensors(spec, reader, rank, size)
        for own in owns:
            check_names(spec, own, reads)
        for name, read in reads.items():
            src = read()
            for own in owns:
                copy_checked(name, own[name], src)
        log.info("%s: read %.1f MiB for TP rank %d of %d", hf_dir, reader.bytes_read / 2**20, rank, size)


def open_checkpoint(hf_dir: str) -> SafetensorsReader:
    try:
        return SafetensorsReader(hf_dir)
    except MissingWeights as e:
        raise ConversionError(str(e)) from e


def rank_tensors(spec: ModelSpec, reader: SafetensorsReader, rank: int, size: int) -> dict[str, Read]:
    """Megatron name -> a read of TP rank `rank`'s shard of it (of `size` ranks); a read raises
    ConversionError naming an HF tensor the checkpoint lacks."""
    s = _RankSlices(reader, rank, size)
    recipes = _gpt2(spec, s) if spec.family == "gpt2" else _llama(spec, s)
    return {name: partial(_named_read, spec, read) for name, read in recipes.items()}


def _named_read(spec: ModelSpec, read: Read) -> Tensor:
    try:
        return read()
    except KeyError as e:
        raise ConversionError(f"{spec.family} checkpoint is missing tensor {e.args[0]!r}") from e


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of `torch.chunk(range(n), parts)[index]`."""
    step = -(-n // parts)
    return min(index * step, n), min((index + 1) * step, n)


@dataclass(frozen=True)
class _RankSlices:
    """Reads TP rank `rank`'s chunk (of `size`) of HF tensors, along rows or columns."""

    reader: SafetensorsReader
    rank: int
    size: int

    def whole(self, name: str) -> Tensor:
        return self.reader.read(name)

    def rows(self, name: str) -> Tensor:
        return self.part(name, 0, 0, self.reader.shape(name)[0])

    def cols(self, name: str) -> Tensor:
        return self.part(name, 1, 0, self.reader.shape(name)[1])

    def part(self, name: str, dim: int, start: int, stop: int) -> Tensor:
        """This rank's chunk of the range [start, stop) of `name` along `dim`."""
        a, b = chunk_bounds(stop - start, self.size, self.rank)
        return self.reader.read(name, dim, start + a, start + b)


# ---------------------------------------------------------------------------- llama / qwen2

def _llama(spec: ModelSpec, s: _RankSlices) -> dict[str, Read]:
    out = {"embedding.word_embeddings.weight": partial(s.rows, "model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": partial(s.whole, "model.norm.weight")}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = partial(s.rows, "lm_head.weight")
    for i in range(spec.num_layers):
        out.update(_llama_layer(spec, s, f"model.layers.{i}.", f"decoder.layers.{i}."))
    return out


def _llama_layer(spec: ModelSpec, s: _RankSlices, h: str, m: str) -> dict[str, Read]:
    out = {m + "input_layernorm.weight": partial(s.whole, h + "input_layernorm.weight"),
           m + "self_attention.linear_qkv.weight": partial(_llama_qkv, spec, s, h, "weight"),
           m + "self_attention.linear_proj.weight": partial(s.cols, h + "self_attn.o_proj.weight"),
           m + "pre_mlp_layernorm.weight": partial(s.whole, h + "post_attention_layernorm.weight"),
           m + "mlp.linear_fc1.weight": partial(_gate_up, s, h + "mlp."),
           m + "mlp.linear_fc2.weight": partial(s.cols, h + "mlp.down_proj.weight")}
    if spec.qkv_bias:
        out[m + "self_attention.linear_qkv.bias"] = partial(_llama_qkv, spec, s, h, "bias")
    return out


def _llama_qkv(spec: ModelSpec, s: _RankSlices, h: str, kind: str) -> Tensor:
    """This rank's query groups: its rows of q, k and v (equal chunks: whole groups)."""
    q, k, v = (s.rows(f"{h}self_attn.{x}_proj.{kind}") for x in "qkv")
    return pack_qkv(spec, q, k, v)


def _gate_up(s: _RankSlices, mlp: str) -> Tensor:
    return torch.cat([s.rows(mlp + "gate_proj.weight"), s.rows(mlp + "up_proj.weight")], 0)


# ---------------------------------------------------------------------------- gpt2

def _gpt2(spec: ModelSpec, s: _RankSlices) -> dict[str, Read]:
    p = "transformer." if "transformer.wte.weight" in s.reader.names() else ""
    out = {"embedding.word_embeddings.weight": partial(s.rows, p + "wte.weight"),
           "embedding.position_embeddings.weight": partial(s.whole, p + "wpe.weight"),
           "decoder.final_layernorm.weight": partial(s.whole, p + "ln_f.weight"),
           "decoder.final_layernorm.bias": partial(s.whole, p + "ln_f.bias")}
    if not spec.tied_embeddings:
        out["output_layer.weight"] = partial(s.rows, "lm_head.weight")
    for i in range(spec.num_layers):
        out.update(_gpt2_layer(spec, s, f"{p}h.{i}.", f"decoder.layers.{i}."))
    return out


def _gpt2_layer(spec: ModelSpec, s: _RankSlices, h: str, m: str) -> dict[str, Read]:
    out = {}
    for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
        for x in ("weight", "bias"):
            out[f"{m}{b}.{x}"] = partial(s.whole, f"{h}{a}.{x}")
    attn, mlp = h + "attn.", h + "mlp."
    out[m + "self_attention.linear_qkv.weight"] = partial(_gpt2_qkv, spec, s, attn + "c_attn.weight")
    out[m + "self_attention.linear_qkv.bias"] = partial(_gpt2_qkv, spec, s, attn + "c_attn.bias")
    # Conv1D weights are [in, out]: column-parallel reads columns, row-parallel reads rows
    out[m + "self_attention.linear_proj.weight"] = partial(_transposed, s.rows, attn + "c_proj.weight")
    out[m + "self_attention.linear_proj.bias"] = partial(s.whole, attn + "c_proj.bias")
    out[m + "mlp.linear_fc1.weight"] = partial(_transposed, s.cols, mlp + "c_fc.weight")
    out[m + "mlp.linear_fc1.bias"] = partial(s.rows, mlp + "c_fc.bias")
    out[m + "mlp.linear_fc2.weight"] = partial(_transposed, s.rows, mlp + "c_proj.weight")
    out[m + "mlp.linear_fc2.bias"] = partial(s.whole, mlp + "c_proj.bias")
    return out


def _gpt2_qkv(spec: ModelSpec, s: _RankSlices, name: str) -> Tensor:
    """This rank's heads from c_attn = [q | k | v] along its last dim (columns of the weight)."""
    dim = len(s.reader.shape(name)) - 1
    n = s.reader.shape(name)[dim]
    q, k, v = (s.part(name, dim, *chunk_bounds(n, 3, j)) for j in range(3))
    if dim:
        q, k, v = q.t(), k.t(), v.t()
    return pack_qkv(spec, q, k, v)


def _transposed(read: Callable[[str], Tensor], name: str) -> Tensor:
    return read(name).t().contiguous()
