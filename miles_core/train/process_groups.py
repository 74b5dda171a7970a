"""torch.distributed and Megatron parallel state, set up once per process.

`ensure_process_groups(tp, expert_model_parallel_size=ep)` is idempotent: the first call initialises
torch.distributed (NCCL on GPU, gloo on CPU) and Megatron's `parallel_state`; later calls check the
sizes agree. Expert parallelism (mixture-of-experts models) is Megatron's: EP x expert-TP ranks (the
expert TP size is the dense TP size, Megatron's default) hold every routed expert once and the rest
of the world is expert data parallelism, while the dense layers keep TP x DP over the same ranks
(rank order tp-cp-ep-dp-pp: an EP group is ranks TP apart, inside the dense DP group). Under a
launcher (torchrun, or Ray actors that export MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) the env:// rendezvous
is used; a lone process gets a world of one through a private file:// rendezvous, so nothing
listens on a port.

The rank setup hook: `MILES_RANK_SETUP_HOOK=module:function` names a function the first call hands the
trainer's groups (the world, DP, TP, and the expert groups: EP, which carries the token dispatch's
all-to-all, expert TP, EP x expert TP and expert DP) once they exist, in every rank process. The test
harness installs NCCL's device rule on CPU through it (docs/training.md#collectives-and-the-device-rule).
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist


RANK_SETUP_ENV = "MILES_RANK_SETUP_HOOK"
DEFAULT_TIMEOUT_MINUTES = 10.0  # NCCL's and Megatron's default (--distributed-timeout-minutes)
CHECKPOINT_TIMEOUT = timedelta(hours=4)  # a checkpoint's slowest upload (hundreds of GB) fits in it
_checkpoint_group = None


def ensure_process_groups(tensor_model_parallel_size: int = 1, *, expert_model_parallel_size: int = 1,
                          timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> None:
    """`timeout_minutes` (--distributed-timeout-minutes): how long a collective of the trainer's groups
    (the world and Megatron's) may wait; on NCCL its watchdog tears the rank down past it."""
    from megatron.core import parallel_state

    timeout = timedelta(minutes=timeout_minutes)

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            if torch.cuda.is_available():
                # Ray gives each rank actor its own CUDA_VISIBLE_DEVICES (one device): index 0
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            fd, path = tempfile.mkstemp(prefix="miles-pg-")
            os.close(fd)
            os.unlink(path)  # the file store creates it; it must not exist yet
            dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1, timeout=timeout)
    tp, ep = tensor_model_parallel_size, expert_model_parallel_size
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, ep):
            raise RuntimeError(
                f"Megatron parallel state already set up with tensor parallel size {have[0]} and expert parallel "
                f"size {have[1]}; --tensor-model-parallel-size={tp} --expert-model-parallel-size={ep} needs a "
                "fresh process."
            )
        return
    world = dist.get_world_size()
    if world % tp:
        raise RuntimeError(f"--tensor-model-parallel-size={tp} does not divide the world size {world}.")
    if world % (tp * ep):
        raise RuntimeError(f"--expert-model-parallel-size={ep} x the expert tensor parallel size {tp} does not "
                           f"divide the world size {world}.")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             distributed_timeout_minutes=max(1, math.ceil(timeout_minutes)))
    run_rank_setup_hook(trainer_groups())


def checkpoint_group():
    """The group in which ranks wait for each other's checkpoint writes: gloo (a CPU group, also on GPU
    runs), with CHECKPOINT_TIMEOUT, so a rank waiting for an upload of hundreds of GB never sits in an
    NCCL collective whose watchdog would tear it down. Made on first use, by every rank in the same
    order (each save calls it at the same point); None for a world of one."""
    global _checkpoint_group
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend="gloo", timeout=CHECKPOINT_TIMEOUT)
    return _checkpoint_group


def run_rank_setup_hook(groups: list) -> None:
    """Call the function `MILES_RANK_SETUP_HOOK` names (module:function) with `groups`; nothing when unset."""
    spec = os.environ.get(RANK_SETUP_ENV, "")
    if not spec:
        return
    module, sep, name = spec.partition(":")
    if not (sep and module and name):
        raise ValueError(f"{RANK_SETUP_ENV}={spec!r}: expected module:function")
    hook = getattr(importlib.import_module(module), name, None)
    if not callable(hook):
        raise ValueError(f"{RANK_SETUP_ENV}={spec!r}: {module} has no function {name}")
    hook(groups)


def trainer_groups() -> list:
    """Every process group the trainer's collectives run on (None: the world): the dense DP and TP
    groups and the expert ones (EP: the token dispatch's all-to-all; expert TP, EP x expert TP and
    expert DP: the experts' gradients, norms and exports)."""
    from megatron.core import parallel_state as ps

    return [None, ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group(),
            ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
            ps.get_expert_tensor_and_model_parallel_group(), ps.get_expert_data_parallel_group()]
