"""The weight-update process group an engine and the trainer join outside the trainer's own world.

Both sides of the `distributed` weight transport use these: the trainer as rank 0
(`miles_core.weights.distributed`), each engine rank as a peer (the CPU engine server here; SGLang
has its own copy of the same helper).

`init_custom_process_group` is SGLang's helper (python/sglang/srt/utils/common.py), adapted to the
installed torch: the options argument of `_new_process_group_helper` is looked up by name (SGLang
compares version strings, which picks the wrong name on torch 2.10+). It works with or without a
default process group in the calling process; broadcasts name the group and rank 0 of it.

Addresses: a gloo group's device is bound to the address through which this process reaches the
rendezvous host (`local_address_for`: the source address of the route to it, found by a UDP connect
that sends nothing). Torch's default device resolves the hostname instead, which on many machines is
127.0.0.1: each side would then advertise its own loopback to a peer on another node, and the mesh
connect fails (the engine at once, rank 0 at its timeout). A group whose rendezvous host is
127.0.0.1 stays on loopback. `GLOO_SOCKET_IFNAME`, when set, wins (torch's own gloo device, as
before). Torch's group helper ignores options for plain gloo, so the bound device comes through a
registered backend, `GLOO_AT_ADDRESS` (a `ProcessGroupGloo` built with explicit options, as torch's
own gloo tests build it). NCCL picks its interface once per process, from `NCCL_SOCKET_IFNAME` or its
own search (never loopback when another interface exists); this module cannot change it per group.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import urllib.parse

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

GLOO_AT_ADDRESS = "miles_gloo"  # gloo with its device on a chosen address (`_gloo_at`)
_REGISTER = threading.Lock()


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
    if backend == "gloo" and store is None:
        backend, pg_options = _gloo_device(init_method, pg_options)
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


def local_address_for(host: str, port: int = 9) -> str | None:
    """This machine's address that packets to `host` leave from (its route's source address); None when
    `host` does not resolve or has no route. A UDP connect() only picks the route: nothing is sent."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return None


def rendezvous_host(init_method: str) -> str | None:
    """The host of a `tcp://host:port` init method, or MASTER_ADDR for `env://`; None otherwise."""
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR")
    url = urllib.parse.urlparse(init_method)
    return url.hostname if url.scheme == "tcp" else None


def _gloo_device(init_method: str, pg_options):
    """(backend, options) for a gloo group: `GLOO_AT_ADDRESS` with the address that reaches the rendezvous
    host; plain gloo (torch's default device) when GLOO_SOCKET_IFNAME is set or no such address is known."""
    host = None if os.environ.get("GLOO_SOCKET_IFNAME") else rendezvous_host(init_method)
    address = local_address_for(host) if host else None
    if address is None:
        return "gloo", pg_options
    _register_gloo_at()
    log.info("gloo weight-update group: this process listens on %s (reaches %s from there)", address, host)
    return GLOO_AT_ADDRESS, address


def _register_gloo_at() -> None:
    with _REGISTER:
        if not hasattr(dist.Backend, GLOO_AT_ADDRESS.upper()):
            dist.Backend.register_backend(GLOO_AT_ADDRESS, _gloo_at, extended_api=True, devices=["cpu"])


def _gloo_at(opts, address: str):
    """The backend behind `GLOO_AT_ADDRESS`: a `ProcessGroupGloo` with one device listening on `address`."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = opts.timeout
    options._threads = 2  # what torch's default constructor gives one device
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)


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
