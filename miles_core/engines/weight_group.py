"""The weight-update process group an engine and the trainer join outside the trainer's own world.

Both sides of the `distributed` weight transport use these: the trainer as rank 0
(`miles_core.weights.distributed`), each engine rank as a peer (the CPU engine server here; SGLang
has its own copy of the same helper).

`init_custom_process_group` is SGLang's helper (python/sglang/srt/utils/common.py), adapted to the
installed torch: the options argument of `_new_process_group_helper` is looked up by name (SGLang
compares version strings, which picks the wrong name on torch 2.10+). It works with or without a
default process group in the calling process; broadcasts name the group and rank 0 of it.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None):
    """A process group outside the default world (SGLang's helper, which copies torch's and OpenRLHF's)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        # A PrefixStore avoids clashes with other users of a multi-tenant store.
        store = PrefixStore(group_name, store)
    # torch 2.6 renamed pg_options to backend_options; ask the installed torch which one it takes.
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      **{options: pg_options}, timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg) -> None:
    """Destroy a group made by `init_custom_process_group`; never raises (its peers may be gone)."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception as e:  # noqa: BLE001 - a broken group must not stop the next one from forming
        log.warning("destroying the weight-update group failed: %s", e)


def broadcast_bucket(tensors: list[torch.Tensor], group) -> None:
    """Rank 0 of `group` sends (or a peer receives into) each tensor, in order."""
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for h in handles:
        h.wait()
