"""The HF <-> Megatron tensor map of a model, as data: one `Entry` per Megatron tensor.

A family's adapter lists its entries once (`Family.tensors(spec)`); everything that moves weights
between the two namings reads that list: the trainer's converter (both directions,
miles_core.train.hf_convert), its TP- and EP-sharded checkpoint reads (miles_core.train.hf_shards)
and the shape check of the CPU engine. No torch here: the list is plain data.

Megatron names are canonical: the local layer spec's, with routed experts numbered globally
(`decoder.layers.{i}.mlp.experts.local_experts.{e}`, e over all experts); an expert-parallel rank's
model numbers its own experts from 0 (`expert_local_name`).

How an entry's HF tensors make its Megatron tensor (`kind`):
- "same": one HF tensor, as is;
- "qkv": [q; k; v] packed per query group ([q heads of group 0; k0; v0; ...]), weights and biases;
- "gate_up": [gate; up] (Megatron's gated MLP applies the activation to the first half);
- "t": one HF tensor transposed (GPT-2's Conv1D weights are stored [in, out]);
- "c_attn": GPT-2's [q | k | v] along the last dim, transposed when 2-D, then packed as "qkv".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("same", "qkv", "gate_up", "t", "c_attn")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    kind: str = "same"

    def __post_init__(self):
        assert self.kind in KINDS, self.kind


def tp_dim(name: str) -> int | None:
    """Which dim Megatron shards the tensor `name` on under tensor parallelism (None: replicated).
    Megatron's naming is the same in every family: column-parallel qkv and fc1 (routed and shared
    experts' too) and the vocab-parallel embedding and output layer on rows, row-parallel proj and
    fc2 on columns; norms, routers and the expert bias are whole on every rank."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                      "word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def expert_of(name: str) -> int | None:
    """The (global, in a canonical name) expert index of a routed expert's tensor; None otherwise."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def expert_owner(expert: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """(EP rank, local index) of global expert `expert`: Megatron gives each EP rank a contiguous
    block of num_experts / ep_size experts."""
    per = num_experts // ep_size
    return expert // per, expert % per


def with_expert(name: str, index: int) -> str:
    """`name` with its routed expert renumbered to `index`."""
    return _EXPERT.sub(f".mlp.experts.local_experts.{index}.", name, count=1)
