"""The GPU trainer's optimizer checkpoint, on the real megatron-core 0.16.1 classes (on CPU).

`build_training` gets a `ChainedOptimizer` from `get_megatron_optimizer`; the trainer saves
its `state_dict()` through `optimizer_state` (miles_core.train.optimizer_state; safetensors + JSON, no pickle) and restores it with
`load_optimizer_state`. Here the same classes are built on a CPU (tests/support/megatron_cpu.py
maps their few hard-coded CUDA calls) and the checkpoint goes through the same bytes a checkpoint
holds. Pins: the state_dict's shape as 0.16.1 returns it; a restored optimizer makes exactly the
next step of the uninterrupted one; the state matters (a fresh optimizer does not).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from miles_core.train.optimizer_state import load_optimizer_state, optimizer_state
from miles_core.train.state_tree import flatten
from tests.support.megatron_cpu import Chunk, cuda_free, megatron_optimizer, step


def _checkpoint(optimizer) -> tuple[bytes, str]:
    """What a checkpoint stores: optimizer.safetensors bytes and trainer.json's skeleton text."""
    tensors, skeleton = optimizer_state(optimizer)
    return save(tensors), json.dumps(skeleton, sort_keys=True)


def _restore(optimizer, blob: bytes, skeleton: str) -> None:
    with cuda_free():
        load_optimizer_state(optimizer, load(blob), json.loads(skeleton))


def _copy_weights(dst: list[Chunk], src: list[Chunk]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src):
            for pd, ps in zip(d.parameters(), s.parameters()):
                pd.copy_(ps)


def _params(chunks):
    return [p.detach().clone() for c in chunks for p in c.parameters()]


def test_get_megatron_optimizer_returns_a_chained_float16_optimizer():
    """megatron-core 0.16.1 wraps even a single optimizer in a ChainedOptimizer, whose state_dict()
    is then the inner Float16OptimizerWithFloat16Params' dict (no grad_scaler under bf16)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params

    chunks = [Chunk()]
    opt = megatron_optimizer(chunks)
    assert type(opt) is ChainedOptimizer and len(opt.chained_optimizers) == 1
    assert type(opt.chained_optimizers[0]) is Float16OptimizerWithFloat16Params
    ok, grad_norm, _ = step(opt, chunks, seed=1)
    assert ok and grad_norm > 0
    sd = opt.state_dict()
    assert set(sd) == {"optimizer", "fp32_from_fp16_params"}
    groups = sd["optimizer"]["param_groups"]
    assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0]  # 1-D params in their own group
    assert all(t.dtype == torch.float32 for g in sd["fp32_from_fp16_params"] for t in g)
    assert set(sd["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def _resume_matches(n_chunks: int) -> None:
    chunks = [Chunk(seed=i) for i in range(n_chunks)]
    opt = megatron_optimizer(chunks)
    step(opt, chunks, seed=1)
    blob, skeleton = _checkpoint(opt)
    weights = _params(chunks)

    fresh = [Chunk(seed=10 + i) for i in range(n_chunks)]  # other init: everything must come from the checkpoint
    _copy_weights(fresh, chunks)  # the trainer loads the bf16 model part separately
    restored = megatron_optimizer(fresh)
    _restore(restored, blob, skeleton)

    step(opt, chunks, seed=2)
    step(restored, fresh, seed=2)
    for a, b in zip(_params(chunks), _params(fresh)):
        assert torch.equal(a, b)
    main = [t for o in opt.chained_optimizers for g in o.fp32_from_float16_groups for t in g]
    main_back = [t for o in restored.chained_optimizers for g in o.fp32_from_float16_groups for t in g]
    assert all(torch.equal(a, b) for a, b in zip(main, main_back))

    cold_chunks = [Chunk(seed=20 + i) for i in range(n_chunks)]
    with torch.no_grad():
        for p, w in zip((p for c in cold_chunks for p in c.parameters()), weights):
            p.copy_(w)
    cold = megatron_optimizer(cold_chunks)  # same weights, no optimizer state: a different step
    step(cold, cold_chunks, seed=2)
    assert any(not torch.equal(a, b) for a, b in zip(_params(chunks), _params(cold_chunks)))


def test_checkpoint_round_trip_makes_the_same_next_step():
    """One inner optimizer (the trainer's case): state_dict -> safetensors + JSON -> a fresh
    ChainedOptimizer over a freshly built model gives bit-identical parameters after the next step."""
    _resume_matches(1)


def test_several_inner_optimizers_round_trip():
    """A ChainedOptimizer of two inner optimizers saves a list of their dicts; it resumes too."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    chunks = [Chunk(seed=0), Chunk(seed=1)]
    inner = [megatron_optimizer([c]).chained_optimizers[0] for c in chunks]
    opt = ChainedOptimizer(inner)
    step(opt, chunks, seed=1)
    assert isinstance(opt.state_dict(), list) and len(opt.state_dict()) == 2
    blob, skeleton = _checkpoint(opt)
    fresh = [Chunk(seed=5), Chunk(seed=6)]
    _copy_weights(fresh, chunks)
    restored = ChainedOptimizer([megatron_optimizer([c]).chained_optimizers[0] for c in fresh])
    _restore(restored, blob, skeleton)
    step(opt, chunks, seed=2)
    step(restored, fresh, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(_params(chunks), _params(fresh)))


def test_proxy_dict_state_is_refused_not_pickled():
    """`ChainedOptimizer.state` is a ProxyDict (tuple keys over the inner states): not a tree the
    checkpoint can hold, and not what the trainer saves."""
    from miles_core.train.state_tree import StateTreeError

    chunks = [Chunk()]
    opt = megatron_optimizer(chunks)
    step(opt, chunks, seed=1)
    with pytest.raises(StateTreeError, match="ProxyDict"):
        flatten({"state": opt.state})


def test_a_checkpoint_resumes_only_with_the_same_optimizer_kind():
    """A state saved without --use-distributed-optimizer does not load into a DistributedOptimizer
    (and back): the error names the flag instead of a KeyError deep in Megatron. The distributed
    optimizer's own round trip: tests/integration/test_distributed_optimizer.py."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from miles_core.train.optimizer_state import OptimizerStateError

    plain = megatron_optimizer([Chunk(0)])
    tensors, skeleton = optimizer_state(plain)
    chained = ChainedOptimizer([object.__new__(DistributedOptimizer)])
    with pytest.raises(OptimizerStateError, match="saved without --use-distributed-optimizer"):
        load_optimizer_state(chained, tensors, skeleton)
    distributed = {"distributed": {"state_dict": {}, "dp_zero": []}}
    with pytest.raises(OptimizerStateError, match="saved with --use-distributed-optimizer"):
        load_optimizer_state(plain, *flatten(distributed))
