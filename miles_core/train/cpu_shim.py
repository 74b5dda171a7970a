"""The CPU shim: the two things Megatron-core assumes a CUDA device for, replaced on CPU only.

Megatron-core 0.16 with `use_cpu_initialization=True` and the local layer spec runs on CPU except
that (1) a few paths call `torch.cuda.current_device()` to place tensors, and (2) attention and
initialisation fork the model-parallel RNG through `get_cuda_rng_tracker()`, whose tracker seeds
CUDA generators. `install_cpu_shim()` maps the first to the CPU and installs a tracker that keeps
CPU generator states instead. It does nothing when CUDA is available, and is idempotent. All of
the project's CPU accommodations for Megatron live in this module and nowhere else.

`quiet_fallback_warnings()` (called by `miles_core.train` on import, before any Megatron module
loads) filters, on a machine without CUDA only, the UserWarnings Megatron emits at import because
Transformer Engine and Apex are absent ("Transformer Engine and Apex are not installed. Falling
back to ...", "Apex is not installed. Falling back to Torch Norm"): on CPU the fallbacks are the
plan, and a run's console showed a dozen of them per trainer rank. Matched by message; every other
warning is left alone.
"""

from __future__ import annotations

import contextlib
import warnings

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


def install_cpu_shim() -> bool:
    """Install the shim when there is no CUDA; return whether it is active."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRngStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _INSTALLED = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the model-parallel stream like `model_parallel_cuda_manual_seed` does on GPU."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718)
