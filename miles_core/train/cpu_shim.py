"""The CPU shim: the things Megatron-core assumes a CUDA device for, replaced on CPU only.

Megatron-core 0.16 with `use_cpu_initialization=True` and the local layer spec runs on CPU except
that (1) a few paths call `torch.cuda.current_device()` to place tensors, (2) attention and
initialisation fork the model-parallel RNG through `get_cuda_rng_tracker()`, whose tracker seeds
CUDA generators, and (3) activation recomputation (`--recompute-granularity` full or selective:
`tensor_parallel.random.CheckpointFunction`) saves the CUDA generator's state in forward and sets it
back before recomputing in backward (`_get_cuda_rng_state` / `_set_cuda_rng_state`, beside the CPU
generator's state and the tracker's states, which it saves and restores too), and (4) the MoE
alltoall token dispatcher (transformer/moe/token_dispatcher.py, `MoEAlltoAllTokenDispatcher`) copies
its split sizes to the host on a side CUDA stream (`torch.cuda.Stream`, `current_stream`,
`torch.cuda.stream`, an event it synchronizes). `install_cpu_shim()`
maps the first to the CPU, installs a tracker that keeps CPU generator states instead, makes
the CUDA generator's state an empty tensor that is saved and set back as nothing (without CUDA the
CPU generator and the tracker's states are all the randomness there is), and gives the dispatcher
one stream, the CPU's (`CpuStream`: every stream is the current one, waiting and recording are
nothing, its tensors are on the host already), and its host copies the form a GPU run gives them
(`host_copy`: the split sizes as numpy arrays, which `all_to_all_single` takes; the CPU tensors
Megatron's `maybe_move_tensor_to_cpu` leaves where they are it does not). It does nothing when CUDA
is available, and is idempotent. All of the project's CPU accommodations for Megatron live in this
module and nowhere else. (Sequence parallelism needs none: gloo has the all-gather and
reduce-scatter into/from one tensor that Megatron's sequence-parallel regions call.)

`megatron_on_cpu()` is a block in which Megatron's DDP and optimizer classes (the GPU trainer's:
`get_megatron_optimizer` -> `ChainedOptimizer` of `Float16OptimizerWithFloat16Params`,
`FP32Optimizer` or `DistributedOptimizer`) run on CPU tensors unmodified. They insist on CUDA in
three ways only: `param.type()` must name a `torch.cuda.*Tensor` (optimizer.py,
`Float16OptimizerWithFloat16Params.__init__`; distrib_optimizer.py, `_build_model_and_main_param_groups`;
clip_grads.py), and a few scalars are made with `torch.tensor(..., device='cuda')` /
`torch.zeros(..., device='cuda')` (`MixedPrecisionOptimizer.__init__`, `get_grad_norm_fp32`). Within
the block, on a machine without CUDA, those name the CPU; with CUDA it does nothing. The trainer
wraps only its calls into Megatron's DDP and optimizer (build, zero, finalize, step, state) in it,
so the CPU trainer with `--use-distributed-optimizer` or `--bf16` runs the GPU trainer's code path.

`define_missing_te_names()` (called by `build_model`, on CPU and GPU alike): megatron-core 0.16.1's
moe_utils imports its Transformer Engine kernels in a try block whose `except ImportError` leaves
the names undefined, yet its router's gating (`RouterGatingLinearFunction`) tests
`te_general_gemm is not None`: without TE every MoE forward raises NameError. Defining the
missing names as None takes the torch path that test was written for.

`eager_jit_fuser()` (called by `miles_core.train` on import, before any Megatron module loads): on
a machine without CUDA, Megatron's `jit_fuser` (torch.compile) is the identity, so importing Megatron
skips torch's compiler stack (its fused functions run eagerly).

`quiet_fallback_warnings()` (called by `miles_core.train` on import, before any Megatron module
loads) filters, on a machine without CUDA only, the UserWarnings Megatron emits at import because
Transformer Engine and Apex are absent ("Transformer Engine and Apex are not installed. Falling
back to ...", "Apex is not installed. Falling back to Torch Norm"): on CPU the fallbacks are the
plan, and a run's console showed a dozen of them per trainer rank. Matched by message; every other
warning is left alone.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from unittest import mock

import torch

FALLBACK_WARNINGS = (r"Transformer Engine and Apex are not installed\. Falling back",
                     r"Apex is not installed\. Falling back")


def quiet_fallback_warnings() -> bool:
    """Filter Megatron's TE/Apex fallback warnings when there is no CUDA; True when installed."""
    if torch.cuda.is_available():
        return False
    for message in FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    return True

def eager_jit_fuser() -> bool:
    """Without CUDA, before Megatron is imported: Megatron's `jit_fuser` (megatron/core/jit.py:
    `torch.compile`, applied as a decorator to its fused bias/activation/dropout functions when their
    modules load) becomes the identity, so importing Megatron does not import torch's compiler stack
    (torch._dynamo, torch._inductor: 1.7 of the 4.3 CPU-seconds of `import megatron.core`, in every rank
    process). The functions then run eagerly, op by op, which is what torch.compile's result computes;
    on CPU there is no fused kernel to gain. Megatron's own `disable_jit_fuser()` comes too late: every
    fusion module is imported with the package. True when installed (CUDA absent, Megatron not yet
    imported)."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return False
    jit = types.ModuleType("megatron.core.jit", "Megatron's jit module on CPU: the identity (miles_core.train.cpu_shim)")
    jit.noop_decorator = lambda func: func
    jit.jit_fuser = jit.noop_decorator
    jit.enable_jit_fuser = jit.disable_jit_fuser = lambda: None
    sys.modules["megatron.core.jit"] = jit
    return True


_INSTALLED = False


class CpuRngStatesTracker:
    """`CudaRNGStatesTracker`'s interface over CPU generator states (named, seeded, forkable)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states_ = {}

    def is_initialized(self) -> bool:
        return True

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        gen = torch.Generator().manual_seed(int(seed))
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Run the block on the named CPU stream, then restore the default CPU generator."""
        if name not in self.states_:
            self.add(name, 0)
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _no_cuda_rng_state(*_, **__) -> torch.Tensor:
    """`_get_cuda_rng_state` without CUDA: there is no CUDA generator, so its state is empty."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*_, **__) -> None:
    """`_set_cuda_rng_state` without CUDA: nothing to set (the CPU generator is set beside it)."""


class CpuEvent:
    """`torch.cuda.Event`'s interface on CPU: work is done when it is issued, so there is nothing to wait for."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuStream:
    """`torch.cuda.Stream`'s interface on CPU, where there is one stream: every instance is the current
    one (equal to each other), waiting for another is nothing, an event recorded on it is complete."""

    def __init__(self, *_, **__) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> CpuEvent:
        return event or CpuEvent()

    def synchronize(self) -> None:
        pass


def host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's `moe_utils.maybe_move_tensor_to_cpu` for tensors already on the host: what it gives on
    GPU (a numpy array where asked), not the tensor as it is."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().cpu().numpy()
    return tensor


def install_cpu_shim() -> bool:
    """Install the shim when there is no CUDA; return whether it is active."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.Stream = CpuStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: CpuStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    token_dispatcher.maybe_move_tensor_to_cpu = host_copy
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRngStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
    _INSTALLED = True
    return True


TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
            "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
            "fused_topk_with_score_function", "fused_unpermute")


def define_missing_te_names() -> None:
    """moe_utils' Transformer Engine names as None where TE failed to import (module doc)."""
    from megatron.core.transformer.moe import moe_utils

    for name in TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the model-parallel stream like `model_parallel_cuda_manual_seed` does on GPU."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718)


_TENSOR, _ZEROS, _TYPE = torch.tensor, torch.zeros, torch.Tensor.type


def _on_cpu(fn):
    def wrapped(*args, device=None, **kwargs):
        return fn(*args, device="cpu" if device in ("cuda", torch.device("cuda")) else device, **kwargs)

    return wrapped


def _cuda_type(self, *args, **kwargs):
    if args or kwargs:  # a cast, not a query
        return _TYPE(self, *args, **kwargs)
    return _TYPE(self).replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def megatron_on_cpu():
    """Within the block, Megatron's DDP and optimizer code sees CPU tensors as CUDA ones (module doc)."""
    if torch.cuda.is_available():
        yield
        return
    with mock.patch("torch.tensor", _on_cpu(_TENSOR)), mock.patch("torch.zeros", _on_cpu(_ZEROS)), \
            mock.patch.object(torch.Tensor, "type", _cuda_type):
        yield
