"""Log-probs and entropies of target tokens without materialising full-vocabulary logits.

Why: fp32 logits over a whole micro-batch ([batch, seq, vocab], vocab 49,152 for SmolLM2) are the
largest activation of a training step, and the loss only needs the positions whose loss mask can
be non-zero (the response), while the output layer is a fifth of the model's FLOPs. So the caller
passes the final hidden states of the selected positions only, and `token_logprobs` applies the
output layer and the fp32 log-softmax chunk by chunk (at most `CHUNK_BYTES` of fp32 logits per
chunk). With grad enabled and several chunks, each chunk is checkpointed (`torch.utils.checkpoint`):
backward recomputes one chunk's logits at a time instead of keeping them all.

Tensor parallelism: `weight` may be this rank's shard of Megatron's vocab-parallel output layer
(rows `vocab_start:vocab_start + rows` of the vocabulary). The max, the sum of exponentials, the
target logit and the entropy term are then reduced over `tp_group` (Megatron's reduce-from /
copy-to regions carry the gradients), so every rank gets the exact full-vocabulary values without
gathering logits.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from miles_core.train import collectives

Tensor = torch.Tensor

CHUNK_BYTES = 64 * 2**20  # fp32 logits per chunk


def default_chunk_rows(vocab_rows: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits stay within `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab_rows))


def token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, tp_group=None, vocab_start: int = 0,
                   chunk_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """(log-prob of `targets`, entropy), both [N] fp32, under the logits `hidden @ weight.T`.

    hidden: [N, h] final hidden states (after the final norm); weight: [vocab rows, h], this TP
    rank's rows when `tp_group` is given; targets: [N] global token ids. Gradients flow to `hidden`
    and `weight` (all-reduced over `tp_group` for `hidden`, as Megatron's column-parallel layer does).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, h] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    if tp_group is not None:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden, tp_group)
    n = hidden.shape[0]
    step = functools.partial(_chunk, tp_group=tp_group, vocab_start=vocab_start)
    if torch.is_grad_enabled() and n > rows:  # one chunk alone gains nothing from recomputing it
        step = functools.partial(checkpoint, step, use_reentrant=False, preserve_rng_state=False)
    parts = []
    for start in range(0, max(n, 1), rows):  # an empty selection still runs once: the loss keeps a graph
        parts.append(step(hidden[start:start + rows], weight, targets[start:start + rows]))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _chunk(hidden: Tensor, weight: Tensor, targets: Tensor, *, tp_group, vocab_start: int) -> tuple[Tensor, Tensor]:
    logits = (hidden @ weight.t()).float()  # [n, vocab rows], in the model's dtype then fp32, like the full path
    peak = logits.detach().amax(-1, keepdim=True)  # any shift is exact; the max keeps exp finite
    if tp_group is not None:
        collectives.all_reduce(peak, tp_group, op=torch.distributed.ReduceOp.MAX)
    shifted = logits - peak
    exp = shifted.exp()
    sum_exp = _sum(exp.sum(-1), tp_group)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target = _sum(torch.where(mine, picked, torch.zeros_like(picked)), tp_group)
    log_z = sum_exp.log()
    entropy = log_z - _sum((exp * shifted).sum(-1), tp_group) / sum_exp  # -sum p log p = log Z - E_p[shifted]
    return target - log_z, entropy


def _sum(x: Tensor, tp_group) -> Tensor:
    """Sum over the TP ranks' vocabulary shards (forward all-reduce, backward identity)."""
    if tp_group is None:
        return x
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, tp_group)
