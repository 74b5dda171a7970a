"""NCCL's device rule on CPU: the test harness that makes gloo groups behave as NCCL groups would.

On GPU the trainer's groups are NCCL, which takes only tensors on the rank's current CUDA device and
of a dtype NCCL knows; on CPU they are gloo, which takes anything. `enforce_device_rule("cuda",
groups)` makes each gloo group of `groups` stand for an NCCL group (`collectives.stand_for`: the
product's collectives then move tensors to `cuda`, simulated without CUDA) and wraps
torch.distributed's tensor collectives so that a call on such a group refuses (`DeviceRuleError`,
naming the collective, the tensor's device and dtype, and the declared device):
- from anywhere but torch and Megatron, a tensor that is neither on the declared device nor placed
  there by `miles_core.train.collectives`;
- from anywhere but torch, a dtype outside `NCCL_DTYPES` (Megatron's own calls, the MoE token
  dispatch's all-to-all and sequence parallelism's gathers, run on its CUDA activations on GPU, so
  only the dtype rule binds them).

And NCCL's watchdog: a collective on such a group that passes the group's timeout (gloo raises; NCCL's
watchdog, with TORCH_NCCL_ASYNC_ERROR_HANDLING's default, tears the process down) ends the rank's
process at once with `WATCHDOG_EXIT` and a line on stderr, whoever called it, instead of raising an
exception the caller could catch and go on from, which it could not on GPU.

Groups outside the trainer's (the distributed transport's weight-update group, NCCL on GPU) get the
watchdog alone through `watch(group, timeout)` (`watch_weight_groups()` watches every group the
transport forms, with the timeout it forms it with): no device rule (the transport places its
tensors by backend itself), but a collective on such a group, waited for or not (an asynchronous
one, `async_op=True`, is watched from a thread of its own), that has not completed `timeout` after it
was issued ends the process with `WATCHDOG_EXIT` -- unless the group was aborted first
(`torch.distributed.distributed_c10d._abort_process_group`: ProcessGroupNCCL::abort stops its
watchdog and ends its kernels at once). Destroying such a group (ProcessGroupNCCL::shutdown) waits
for its pending collectives, so it saves nothing.

In rank processes it is installed through the product's rank setup hook: set `ENV` (the hook
`tests.support.strict_device:nccl_device_rule`) before the ranks start; `ensure_process_groups`
calls it with the trainer's groups (the world, DP, TP and the expert groups). Ray's local workers
import it from the driver's sys.path. What it cannot see: stream order, pinned memory, and
`torch.cuda.set_device`, which object collectives on NCCL need.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from miles_core.train import collectives
from miles_core.train.process_groups import RANK_SETUP_ENV

HOOK = "tests.support.strict_device:nccl_device_rule"
ENV = {RANK_SETUP_ENV: HOOK}  # the environment that installs the rule in every rank started after it
# what NCCL takes for every op (float64 included); no uint16/32/64, complex or float8 reductions
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})
WRAPPED = ("barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
           "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")
UNCHECKED_CALLERS = ("torch.", "megatron.")  # their collectives run on CUDA tensors on GPU
DTYPE_CHECKED_CALLERS = ("megatron.",)  # ... but NCCL's dtype rule binds them too
WATCHDOG_EXIT = 134  # what a process SIGABRTed by NCCL's watchdog reports (128 + SIGABRT)
WATCH_POLL_SECONDS = 0.05  # how often the emulated watchdog looks at the watched groups' pending collectives

_watched: dict = {}  # group outside the trainer's -> its timeout in seconds (`watch`)
_pending: list = []  # [work, group, deadline, name, caller] of the watched groups' asynchronous collectives
_lock = threading.Lock()


class DeviceRuleError(RuntimeError):
    """A torch.distributed collective got a tensor NCCL would refuse."""


def nccl_device_rule(groups: list) -> None:
    """The rank setup hook: the trainer's gloo groups stand for NCCL groups on `cuda`."""
    enforce_device_rule("cuda", groups)


def enforce_device_rule(device_type: str, groups: list) -> None:
    """Make each gloo group of `groups` (None: the default world) stand for an NCCL group on
    `device_type`, and wrap torch.distributed's tensor collectives to check calls on them."""
    collectives.stand_for(device_type, groups)
    _wrap_collectives()


def _wrap_collectives() -> None:
    for name in WRAPPED:
        fn = getattr(dist, name)
        if not getattr(fn, "_miles_checked", False):
            setattr(dist, name, _checked(name, fn))


def watch(group, timeout: timedelta) -> None:
    """NCCL's watchdog on `group`, a gloo group outside the trainer's (module doc): a collective on it not
    completed `timeout` after it was issued ends the process, unless the group was aborted first."""
    _wrap_collectives()
    c10d = dist.distributed_c10d
    for name, wrap in (("_abort_process_group", _aborting), ("destroy_process_group", _destroying)):
        fn = getattr(c10d, name)
        if not getattr(fn, "_miles_checked", False):
            setattr(c10d, name, wrap(fn))
            if getattr(dist, name, None) is fn:
                setattr(dist, name, getattr(c10d, name))
    with _lock:
        _watched[group] = timeout.total_seconds()
        if not any(t.name == "strict-device-watchdog" for t in threading.enumerate()):
            threading.Thread(target=_watchdog_loop, name="strict-device-watchdog", daemon=True).start()


def watch_weight_groups() -> None:
    """Watch (`watch`) every weight-update group the distributed transport forms in this process, with the
    timeout it forms the group with (torch's default when it names none)."""
    from miles_core.weights import distributed

    real = distributed.init_custom_process_group
    if getattr(real, "_miles_checked", False):
        return

    @functools.wraps(real)
    def init(*args, **kwargs):
        pg = real(*args, **kwargs)
        watch(pg, kwargs.get("timeout") or dist.distributed_c10d.default_pg_timeout)
        return pg

    init._miles_checked = True
    distributed.init_custom_process_group = init


def _aborting(fn):
    @functools.wraps(fn)
    def abort(group=None):
        with _lock:  # ProcessGroupNCCL::abort: its watchdog stops, its kernels end
            _watched.pop(group, None)
            _pending[:] = [p for p in _pending if p[1] is not group]
        return fn(group)

    abort._miles_checked = True
    return abort


def _destroying(fn):
    @functools.wraps(fn)
    def destroy(group=None):
        if group in _watched:  # ProcessGroupNCCL::shutdown waits for the group's pending kernels
            while any(p[1] is group and not p[0].is_completed() for p in list(_pending)):
                time.sleep(WATCH_POLL_SECONDS)  # the watchdog thread ends the process at the deadline
            with _lock:
                _watched.pop(group, None)
        return fn(group)

    destroy._miles_checked = True
    return destroy


def _watchdog_loop() -> None:
    while True:
        time.sleep(WATCH_POLL_SECONDS)
        now = time.monotonic()
        with _lock:
            _pending[:] = [p for p in _pending if p[1] in _watched and not p[0].is_completed()]
            late = [p for p in _pending if now >= p[2]]
        if late:
            _, group, _, name, caller = late[0]
            _watchdog(name, caller, TimeoutError(f"not completed {_watched.get(group, 0):.1f} s after it was issued"))


class _WatchedWork:
    """An asynchronous collective on a watched group: its wait ends the process where gloo would raise a timeout."""

    def __init__(self, work, name: str, caller: str):
        self._work, self._name, self._caller = work, name, caller

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            if not _is_timeout(e):
                raise
            _watchdog(self._name, self._caller, e)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _is_timeout(e: BaseException) -> bool:
    return "timed out" in str(e).lower() or "timeout" in str(e).lower()


def _checked(name: str, fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        ours = not caller.startswith(UNCHECKED_CALLERS)
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if ours or caller.startswith(DTYPE_CHECKED_CALLERS):
            _check(name, group, _tensors(bound.arguments.values()), device=ours)
        watched = group is not None and group in _watched
        if collectives.standing_device(group) is None and not watched:
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except RuntimeError as e:
            if not _is_timeout(e):
                raise
            _watchdog(name, caller, e)
        if watched and bound.arguments.get("async_op"):
            with _lock:
                _pending.append([result, group, time.monotonic() + _watched[group], name, caller])
            return _WatchedWork(result, name, caller)
        return result

    call._miles_checked = True
    return call


def _watchdog(name: str, caller: str, error: BaseException) -> None:
    """What NCCL's watchdog does to a rank whose collective passed the group's timeout: the process ends."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sys.stderr.write(f"[strict device] watchdog: torch.distributed.{name} (called from {caller}) passed its "
                     f"process group's timeout; tearing rank {rank} down as NCCL's watchdog does "
                     f"({type(error).__name__}: {str(error)[:300]})\n")
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT)


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


def _check(name: str, group, tensors: list[torch.Tensor], device: bool = True) -> None:
    """Each tensor of a call on a group standing for NCCL: on its device (`device`) and of a dtype NCCL takes."""
    declared = collectives.standing_device(group)
    if declared is None:
        return
    for t in tensors:
        if device and collectives.placed_device_type(t) != declared:
            raise DeviceRuleError(
                f"torch.distributed.{name} got a tensor on {t.device} ({t.dtype}, shape {tuple(t.shape)}) for a "
                f"group whose device is {declared} (NCCL; the strict device harness makes this gloo group stand "
                "for it): NCCL takes only CUDA tensors. Call it through miles_core.train.collectives, which moves "
                "the tensor to the group's device and back.")
        if t.dtype not in NCCL_DTYPES:
            raise DeviceRuleError(f"torch.distributed.{name} got a {t.dtype} tensor; NCCL takes "
                                  f"{sorted(str(d).removeprefix('torch.') for d in NCCL_DTYPES)}")
