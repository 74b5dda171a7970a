"""Data parallelism of the trainer: the sums ranks share.

Each DP rank receives its own part of the rollout (miles_core.rank_batches, cut on the rollout side:
`shard` picks the samples, each part carries the global token count); the peers of one DP rank (its
TP group) receive the same part. The loss of every micro-batch is divided by the *global* token count,
so summing gradients over DP ranks (`all_reduce_grads`, or Megatron's DDP with
`calculate_per_token_loss` on GPU) gives exactly the DP=1 gradient of the same batch.

- default split: contiguous runs of (almost) equal sample counts, in batch order;
- `--balance-data`: longest first onto the rank with the fewest tokens so far (LPT), each rank's
  samples then back in batch order, so token counts differ by at most one sample's length.

Under --sequence-parallel the norms' gradients are partial sums per TP rank:
`all_reduce_sequence_parallel_grads` sums them over the TP group before the DP reduce and the clip.

Under expert parallelism (--expert-model-parallel-size) a rank's routed experts are its own (Megatron
marks their parameters `allreduce=False`): their gradients are summed over the expert-DP group (the
ranks holding the same experts), not the DP group (`split_expert_params`), and the clip's norm adds
the other EP ranks' experts (`ExpertGroups`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_core.train import collectives


def all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the gradients of `params` over `group` (one coalesced buffer per dtype)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    flat = torch._utils._flatten_dense_tensors(grads)
    collectives.all_reduce(flat, group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def split_expert_params(params: list[torch.nn.Parameter]) -> tuple[list, list]:
    """(dense parameters, expert-parallel ones): Megatron marks a routed expert's parameters
    `allreduce=False` when EP > 1 (tensor_parallel/layers.py); they are summed over expert DP instead."""
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    return [p for p in params if getattr(p, "allreduce", True)], experts


@dataclass(frozen=True)
class ExpertGroups:
    """The groups the clip's norm sums expert-parallel parameters over: an expert TP-sharded parameter
    over EP x expert TP (every shard of every expert once), a replicated one over EP alone."""

    ep: object
    ep_and_tp: object

    @classmethod
    def current(cls) -> "ExpertGroups":
        from megatron.core import parallel_state as ps

        return cls(ps.get_expert_model_parallel_group(), ps.get_expert_tensor_and_model_parallel_group())


def all_reduce_sequence_parallel_grads(params: list[torch.nn.Parameter], tp_group) -> None:
    """Sum over the TP group the gradients of the parameters Megatron marks `sequence_parallel`
    (norm weights and biases, row-parallel biases: replicated, but under --sequence-parallel each TP
    rank saw only its slice of the sequence, so each holds a partial sum). Afterwards they are the
    same on every TP rank, as the clip's "replicated, counted once" rule expects; call it before the
    DP reduce. Does nothing without sequence parallelism (nothing is marked)."""
    marked = [p for p in params if getattr(p, "sequence_parallel", False)]
    if marked and tp_group is not None and dist.get_world_size(tp_group) > 1:
        all_reduce_grads(marked, tp_group)


def all_reduce_sums(sums: dict[str, float], group) -> dict[str, float]:
    """Metric sums over every DP rank (keys sorted, so every rank packs them in the same order)."""
    if group is None or dist.get_world_size(group) == 1 or not sums:
        return sums
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    collectives.all_reduce(t, group)
    return dict(zip(keys, t.tolist()))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, tp_group,
                   experts: ExpertGroups | None = None) -> float:
    """`torch.nn.utils.clip_grad_norm_` over a tensor- (and expert-) parallel model: Megatron marks
    sharded parameters `tensor_model_parallel`; their squared norms are summed over the TP group, the
    replicated ones (identical on every TP rank) are counted once. Under expert parallelism
    (`experts`) the expert-parallel parameters' squares are summed over `experts`' groups instead.
    Returns the total norm."""
    with_grad = [p for p in params if p.grad is not None]
    # [dense sharded, dense replicated, expert sharded, expert replicated]
    sq = [torch.zeros((), dtype=torch.float64) for _ in range(4)]
    for p in with_grad:
        expert = experts is not None and not getattr(p, "allreduce", True)
        sq[2 * expert + (not getattr(p, "tensor_model_parallel", False))] += p.grad.detach().double().pow(2).sum()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        collectives.all_reduce(sq[0], tp_group)
    if experts is not None:
        collectives.all_reduce(sq[2], experts.ep_and_tp)
        collectives.all_reduce(sq[3], experts.ep)
    total = float(sum(sq).sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in with_grad:
            p.grad.mul_(coef)
    return total
