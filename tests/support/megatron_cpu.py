"""Megatron-core 0.16.1's GPU optimizer classes, built and stepped on a CPU (tests only).

`get_megatron_optimizer` returns a `ChainedOptimizer` of `Float16OptimizerWithFloat16Params`
under bf16 (megatron/core/optimizer/__init__.py, `_get_megatron_optimizer_based_on_param_groups`
and the final `return ChainedOptimizer(optimizers)`). Those classes insist on CUDA in three
places only: `param.type()` must name a `torch.cuda.*Tensor` (optimizer.py,
`Float16OptimizerWithFloat16Params.__init__`; clip_grads.py, `clip_grad_by_total_norm_fp32`),
and a few scalars are made with `torch.tensor(..., device='cuda')` / `torch.zeros(...,
device='cuda')` (`MixedPrecisionOptimizer.__init__`, `get_grad_norm_fp32`). `cuda_free()` (the
trainer's own `miles_core.train.cpu_shim.megatron_on_cpu`) maps exactly those to the CPU for the
duration of a block, so the real classes run unmodified: their `state_dict()` / `load_state_dict()`
are what the GPU trainer's checkpoints store and load.
"""

from __future__ import annotations

import torch

from miles_core.train.cpu_shim import megatron_on_cpu as cuda_free


class Chunk(torch.nn.Module):
    """A bf16 model chunk as `get_megatron_optimizer` reads one: parameters + a `ddp_config`.
    Matrices get weight decay, the bias and the norm weights (1-D) fall in Megatron's wd_mult=0 group."""

    def __init__(self, seed: int = 0):
        from megatron.core.distributed import DistributedDataParallelConfig

        super().__init__()
        self.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(6, 4).to(torch.bfloat16)
        self.norm = torch.nn.LayerNorm(4).to(torch.bfloat16)


def megatron_optimizer(chunks: list[Chunk], *, lr: float = 1e-2, clip_grad: float = 1.0):
    """The optimizer `miles_core.train.megatron_model.build_training` asks for (bf16, not distributed), on CPU."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from miles_core.train.cpu_shim import install_cpu_shim
    from miles_core.train.process_groups import ensure_process_groups

    install_cpu_shim()
    ensure_process_groups(1)
    cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.1, bf16=True, clip_grad=clip_grad,
                          use_distributed_optimizer=False, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    with cuda_free():
        return get_megatron_optimizer(cfg, chunks)


def step(optimizer, chunks: list[Chunk], seed: int):
    """Seeded gradients on every parameter, then one Megatron optimizer step; returns its result."""
    gen = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    with cuda_free():
        return optimizer.step()
