"""RoPE's inverse frequencies of a `ModelSpec`, computed once for both the trainer (set on Megatron's
rotary embedding) and the CPU engine (its cos/sin tables), so the two never rotate differently."""

from __future__ import annotations

import math

from miles_core.models.families.spec import ModelSpec


def rope_inv_freq(spec: ModelSpec):
    """RoPE's inverse frequencies [rotary_dim / 2] (fp32) as transformers computes them: the default
    ones over the rotated dims (partial rotary: the first `rotary_dim` of each head), and under
    `llama3` scaling Llama 3.1's rescaled ones with the checkpoint's factor, low/high frequency
    factors and original context length (transformers' `_compute_llama3_parameters`: low
    frequencies divided by `factor`, the middle band smoothed; Megatron's own `rope_scaling` fixes
    all but the factor). torch is imported here: the families package is read without it."""
    import torch

    dim = spec.rotary_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if spec.rope_type != "llama3":
        return inv_freq
    factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old = spec.rope_original_max_positions
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
