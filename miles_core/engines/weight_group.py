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

import asyncio
import contextlib
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
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
POLL_MIN_SECONDS, POLL_MAX_SECONDS = 0.0005, 0.005  # `wait_bounded` polls a broadcast's completion this often
_REGISTER = threading.Lock()
_ENV = threading.Lock()  # the environment while an NCCL group reads it (`_nccl_error_handling`)


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None, nccl_watchdog_handles_errors=True):
    """A process group outside the default world (SGLang's helper, which copies torch's and OpenRLHF's).

    `nccl_watchdog_handles_errors=False` (an NCCL group whose caller bounds its waits and aborts it
    itself): the group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=0, which ProcessGroupNCCL reads
    once, in its constructor, so NCCL's watchdog neither tears the process down nor aborts this group
    when one of its collectives fails or passes the timeout (torch's `_abort_process_group` asks for
    this setting); the trainer's own groups keep the process's setting."""
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
    with _nccl_error_handling(None if nccl_watchdog_handles_errors or backend != "nccl" else "0"):
        pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                          **{options: pg_options}, timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextlib.contextmanager
def _nccl_error_handling(value: str | None):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING set to `value` while a group is built (None: left as it is)."""
    if value is None:
        yield
        return
    with _ENV:
        saved = os.environ.get(ASYNC_ERROR_HANDLING)
        os.environ[ASYNC_ERROR_HANDLING] = value
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(ASYNC_ERROR_HANDLING, None)
            else:
                os.environ[ASYNC_ERROR_HANDLING] = saved


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


def abort_custom_process_group(pg) -> None:
    """Abort a group made by `init_custom_process_group`, pending collectives and all; never raises.

    Unlike destroying it, aborting does not wait for them: NCCL's `ProcessGroupNCCL::shutdown` (what
    `destroy_process_group` calls) waits for every pending kernel, so on a group whose peer died it
    would wait until NCCL's watchdog tears the process down; `ProcessGroupNCCL::abort` stops the
    group's watchdog and ends its kernels at once. On gloo, aborting drops the group (a pending
    operation runs on in gloo's thread until the group's timeout, harmlessly)."""
    if pg is None:
        return
    try:
        dist.distributed_c10d._abort_process_group(pg)
    except Exception as e:  # noqa: BLE001 - a broken group must not stop the next one from forming
        log.warning("aborting the weight-update group failed (%s); destroying it", e)
        destroy_custom_process_group(pg)


def broadcast_bucket(tensors: list[torch.Tensor], group) -> None:
    """Rank 0 of `group` sends (or a peer receives into) each tensor, in order."""
    for h in start_broadcast(tensors, group):
        h.wait()


def start_broadcast(tensors: list[torch.Tensor], group) -> list:
    """Issue the broadcast of each tensor from rank 0 of `group`, in order; their pending works."""
    return [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]


async def wait_bounded(works: list, seconds: float) -> None:
    """Wait for every work to complete, at most `seconds` (the event loop keeps running: this polls each
    work's completion, which never blocks, on NCCL or gloo); raise a failed work's error, or
    `TimeoutError` past the bound. A work still pending then is left to the caller (abort its group)."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + seconds, POLL_MIN_SECONDS
    while not all(w.is_completed() for w in works):
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError(f"the broadcast did not complete within {seconds:g} s")
        await asyncio.sleep(min(delay, left))
        delay = min(2 * delay, POLL_MAX_SECONDS)
    for w in works:
        w.wait()  # completed: returns at once, or raises what failed it
