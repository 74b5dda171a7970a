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
from miles_core.models.families import Entry, ModelSpec
from miles_core.models.families.tensors import expert_of, expert_owner, tp_dim, with_expert
from miles_core.train.hf_convert import (ConversionError, check_names, check_tp, copy_checked, model_tensors, pack_qkv,
                                         tensor_map)

Tensor = torch.Tensor
Read = Callable[[], Tensor]
log = logging.getLogger(__name__)


def load_hf_checkpoint(models: list, spec: ModelSpec, hf_dir: str) -> None:
    """Copy this TP rank's shards of the HF checkpoint `hf_dir` into every model of `models`; under
    expert parallelism only this EP rank's routed experts are read."""
    from megatron.core import parallel_state as ps

    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep_size, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    check_tp(spec, size)
    owns = [model_tensors(m) for m in models if m is not None]
    with open_checkpoint(hf_dir) as reader:
        reads = rank_tensors(spec, reader, rank, size, ep_rank=ep_rank, ep_size=ep_size)
        for own in owns:
            check_names(spec, own, reads)
        for name, read in reads.items():
            src = read()
            for own in owns:
                copy_checked(name, own[name], src)
        log.info("%s: read %.1f MiB for TP rank %d of %d, EP rank %d of %d", hf_dir, reader.bytes_read / 2**20,
                 rank, size, ep_rank, ep_size)


def open_checkpoint(hf_dir: str) -> SafetensorsReader:
    try:
        return SafetensorsReader(hf_dir)
    except MissingWeights as e:
        raise ConversionError(str(e)) from e


def rank_tensors(spec: ModelSpec, reader: SafetensorsReader, rank: int, size: int, *,
                 ep_rank: int = 0, ep_size: int = 1) -> dict[str, Read]:
    """Megatron name (this rank's: its routed experts numbered from 0) -> a read of TP rank `rank`'s
    shard of it (of `size` ranks); under expert parallelism only EP rank `ep_rank`'s experts. A read
    raises ConversionError naming an HF tensor the checkpoint lacks."""
    s = _RankSlices(reader, rank, size)
    out = {}
    for e in tensor_map(spec):
        name = e.mcore
        expert = expert_of(name)
        if expert is not None:
            owner, local = expert_owner(expert, spec.num_experts, ep_size)
            if owner != ep_rank:
                continue
            name = with_expert(name, local)
        out[name] = partial(_named_read, spec, partial(_read_entry, spec, s, e))
    return out


def _read_entry(spec: ModelSpec, s: "_RankSlices", e: Entry) -> Tensor:
    """This rank's shard of the Megatron tensor of entry `e`, read from its HF tensors' slices."""
    dim = tp_dim(e.mcore)
    if e.kind == "c_attn":
        return _gpt2_qkv(spec, s, e.hf[0])
    if e.kind == "t":  # HF stores it transposed: Megatron's dim d is the HF tensor's 1 - d
        read = s.whole if dim is None else (s.cols if dim == 0 else s.rows)
        return read(e.hf[0]).t().contiguous()
    read = s.whole if dim is None else (s.rows if dim == 0 else s.cols)
    parts = [read(n) for n in e.hf]
    if e.kind == "qkv":  # this rank's query groups: equal chunks of q, k and v are whole groups
        return pack_qkv(spec, *parts)
    if e.kind == "gate_up":
        return torch.cat(parts, 0)
    return parts[0]


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


# ---------------------------------------------------------------------------- gpt2

def _gpt2_qkv(spec: ModelSpec, s: _RankSlices, name: str) -> Tensor:
    """This rank's heads from c_attn = [q | k | v] along its last dim (columns of the weight)."""
    dim = len(s.reader.shape(name)) - 1
    n = s.reader.shape(name)[dim]
    q, k, v = (s.part(name, dim, *chunk_bounds(n, 3, j)) for j in range(3))
    if dim:
        q, k, v = q.t(), k.t(), v.t()
    return pack_qkv(spec, q, k, v)
