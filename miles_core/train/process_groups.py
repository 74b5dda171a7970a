"""torch.distributed and Megatron parallel state, set up once per process.

`ensure_process_groups(tp)` is idempotent: the first call initialises torch.distributed (NCCL on
GPU, gloo on CPU) and Megatron's `parallel_state`; later calls check the sizes agree. Under a
launcher (torchrun, or Ray actors that export MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) the env:// rendezvous
is used; a lone process gets a world of one through a private file:// rendezvous, so nothing
listens on a port. With `MILES_STRICT_DEVICE=cuda` the trainer's groups (the world, DP, TP) enforce
NCCL's device rule on CPU too (miles_core.train.collectives).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from miles_core.train import collectives


def ensure_process_groups(tensor_model_parallel_size: int = 1) -> None:
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
            if torch.cuda.is_available():
                # Ray gives each rank actor its own CUDA_VISIBLE_DEVICES (one device): index 0
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            dist.init_process_group(backend, init_method="env://")
        else:
            fd, path = tempfile.mkstemp(prefix="miles-pg-")
            os.close(fd)
            os.unlink(path)  # the file store creates it; it must not exist yet
            dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tensor_model_parallel_size:
            raise RuntimeError(
                f"Megatron parallel state already set up with tensor parallel size {have}; "
                f"--tensor-model-parallel-size={tensor_model_parallel_size} needs a fresh process."
            )
        return
    if dist.get_world_size() % tensor_model_parallel_size:
        raise RuntimeError(
            f"--tensor-model-parallel-size={tensor_model_parallel_size} does not divide the "
            f"world size {dist.get_world_size()}."
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
    # MILES_STRICT_DEVICE=cuda: on CPU, the trainer's gloo groups stand for the NCCL ones of a GPU run
    collectives.enforce_device_rule_from_env(
        [None, parallel_state.get_data_parallel_group(), parallel_state.get_tensor_model_parallel_group()])
