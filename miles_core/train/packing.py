"""Token-budget micro-batches (miles' --use-dynamic-batch-size with --max-tokens-per-gpu): which
samples share a micro-batch, and a micro-batch as one packed row without padding.

    groups = plan_micro_batches(lengths, max_tokens)   # [[sample index, ...], ...]
    batch = pack_rows(tokens, targets, device)           # one row [1, T] of the samples back to back
    layout.add(positions, tokens)                        # LayoutCounts: micro-batches and their padding

`plan_micro_batches` is first-fit decreasing: samples longest first (ties by index), each into the
first micro-batch it fits in, a new one when none has room. Every micro-batch then holds at most
`max_tokens` tokens, except that a sample longer than the budget gets a micro-batch of its own (as
miles does). The plan is deterministic, so the TP peers of a DP rank make the same one; FFD uses
at most 11/9 of the fewest micro-batches possible (+ 6/9).

`pack_rows` concatenates the samples' tokens into one row [1, T] with
- position ids restarting at 0 for each sample (learned absolute positions, gpt2, read them);
- a block-diagonal causal attention mask [1, 1, T, T], Megatron's convention (bool, True where
  attention is *not* allowed): a token attends to the earlier tokens of its own sample only.
  RoPE (llama, qwen2) rotates by the index in the row; its attention scores depend only on the
  distance between two tokens, so inside a block they equal the unpacked ones;
- the per-target tensors (loss mask, advantages, rollout log-probs) on the [1, T - 1] target
  positions, each sample's values followed by 0 at the position that would predict the next
  sample's first token.
So the log-probs of a packed row equal those of the samples run one by one, up to float error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped into micro-batches of at most `max_tokens` tokens each (a
    longer sample alone). Each micro-batch's indices ascending; micro-batches by their first index."""
    if max_tokens is None or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: --use-dynamic-batch-size needs --max-tokens-per-gpu >= 1")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        home = next((b for b, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if home is None:
            bins.append([])
            loads.append(0)
            home = len(bins) - 1
        bins[home].append(i)
        loads[home] += lengths[i]
    return sorted(sorted(b) for b in bins)


def position_ids(lengths: list[int], device=None) -> Tensor:
    """[1, T]: 0..n-1 for each sample of length n, back to back."""
    return torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)


def block_causal_mask(lengths: list[int], device=None) -> Tensor:
    """[1, 1, T, T] bool, True where attention is not allowed: across samples, or to a later token."""
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    t = seg.numel()
    later = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1)
    return (later | (seg.unsqueeze(0) != seg.unsqueeze(1))).view(1, 1, t, t)


def pack_rows(tokens: list[Tensor], targets: list[dict[str, Tensor]], device) -> dict[str, Tensor]:
    """One packed row of samples: `tokens[i]` [n_i] token ids, `targets[i]` the sample's per-target
    tensors [n_i - 1] (same keys for every sample). Returns "tokens" [1, T], "position_ids" [1, T],
    "attention_mask" [1, 1, T, T] and each target key on [1, T - 1] (0 across sample boundaries)."""
    lengths = [int(t.numel()) for t in tokens]
    out = {"tokens": torch.cat(tokens).unsqueeze(0), "position_ids": position_ids(lengths),
           "attention_mask": block_causal_mask(lengths)}
    for key in targets[0]:
        parts = [torch.cat([t[key], t[key].new_zeros(1)]) for t in targets]  # 0: predicts the next sample
        out[key] = torch.cat(parts)[:-1].unsqueeze(0)
    return {k: v.to(device) for k, v in out.items()}


@dataclass
class LayoutCounts:
    """A rank's micro-batches of one step: how many, and the token positions they computed
    (padding included) against the real tokens in them."""

    micro_batches: int = 0
    positions: int = 0
    tokens: int = 0

    def add(self, positions: int, tokens: int) -> None:
        self.micro_batches += 1
        self.positions += positions
        self.tokens += tokens

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.positions if self.positions else 0.0
