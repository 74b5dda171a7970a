"""GPU weight transport: NCCL broadcast from trainer rank 0 to SGLang engines (not runnable on CPU).

Uses SGLang's native endpoints, as slime does:
- `/init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name,
  backend}: each engine joins a process group where the trainer is rank 0 and engine e's TP ranks
  are `1 + e * tp ... `;
- `/update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache,
  weight_version}: the engine receives each tensor by broadcast from rank 0, in that order.
Tensors go in buckets (one HTTP call per bucket) so engines can load while the next broadcasts.
The engine side is `DistributedEngineControl`; miles_core.engines.client implements it for SGLang.
Under tensor parallelism every trainer rank calls `load` (gathering the full tensors is a TP
collective); only global rank 0 talks to the engines and broadcasts.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

BUCKET_BYTES = 512 << 20
GROUP_NAME = "miles-weights"


class DistributedEngineControl(Protocol):
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None: ...
    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, flush_cache: bool, weight_version: int) -> None: ...


def init_custom_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, backend: str = "nccl", timeout_seconds: float = 600.0):
    """A process group outside the default world (trainer + engines), like SGLang's helper."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world, rendezvous

    store_iter = rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                            timeout=timedelta(seconds=timeout_seconds))
    store, rank, world_size = next(store_iter)
    store.set_timeout(timedelta(seconds=timeout_seconds))
    prefix_store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, prefix_store, group_name=group_name,
                                      timeout=timedelta(seconds=timeout_seconds))
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class NcclWeightTransport:
    """Broadcasts the trainer's HF tensors to every engine over one NCCL group."""

    def __init__(self, trainer, engines: Sequence[DistributedEngineControl], *, master_address: str,
                 master_port: int, engine_tp_size: int, bucket_bytes: int = BUCKET_BYTES):
        self.trainer, self.engines = trainer, engines
        self.master_address, self.master_port = master_address, master_port
        self.engine_tp_size = engine_tp_size
        self.bucket_bytes = bucket_bytes
        self.group = None
        self.local_path = None

    async def connect(self) -> None:
        world = 1 + len(self.engines) * self.engine_tp_size
        joins = [e.init_weights_update_group(self.master_address, self.master_port, 1 + i * self.engine_tp_size,
                                             world, GROUP_NAME, "nccl") for i, e in enumerate(self.engines)]
        mine = asyncio.to_thread(init_custom_process_group, self.master_address, self.master_port, 0, world,
                                 GROUP_NAME)
        *_, self.group = await asyncio.gather(*joins, mine)

    def prepare(self, step: int) -> None:
        return None  # nothing leaves the GPU before the engines are paused

    def _buckets(self, version: int):
        bucket, size = [], 0
        for name, t in self.trainer.hf_state_dict(torch.bfloat16).items():
            bucket.append((name, t.cuda(non_blocking=True)))
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    async def load(self, engines, version: int) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in self._buckets(version):  # take part in the TP gathers only
                pass
            return
        if self.group is None:
            await self.connect()
        for bucket in self._buckets(version):
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            calls = [e.update_weights_from_distributed(names, dtypes, shapes, GROUP_NAME, False, version)
                     for e in self.engines]
            requests = asyncio.gather(*calls)

            def broadcast():
                handles = [dist.broadcast(t, src=0, group=self.group, async_op=True) for _, t in bucket]
                for h in handles:
                    h.wait()

            await asyncio.gather(requests, asyncio.to_thread(broadcast))
