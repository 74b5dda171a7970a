"""The trainer's collectives on its own process groups, in one place, under NCCL's device rule.

On GPU the trainer's groups (the default world, Megatron's DP and TP groups) are NCCL, which takes
only tensors on the rank's current CUDA device, of a dtype NCCL knows; on CPU they are gloo, which
takes tensors where they are. Callers hand `all_reduce`, `all_gather` and `barrier` tensors wherever
they hold them: the tensor goes to `group_device(group)` (the current CUDA device for NCCL, left
where it is for gloo) and the result comes back on the caller's device. `all_reduce` works in place,
like `torch.distributed.all_reduce`. Every `torch.distributed` collective in `miles_core/train` goes
through here (tests/unit/test_collectives.py checks the source; tests/integration/test_rank_groups.py runs it on gloo ranks); Megatron's own collectives run on
its CUDA activations and are not ours.

Strict mode (`MILES_STRICT_DEVICE=cuda`, read by `ensure_process_groups`; or
`enforce_device_rule("cuda", groups)`) enforces the rule on CPU, where no NCCL group exists: the
named gloo groups stand for NCCL and declare the device `cuda`. `torch.distributed`'s tensor
collectives are wrapped so that a call made outside torch and Megatron on such a group refuses
(`DeviceRuleError`, naming the collective, the tensor's device and dtype, and the declared device)
any tensor that is neither on the declared device nor placed there by this module, and any dtype
outside `NCCL_DTYPES`. Megatron's own calls on those groups (the MoE token dispatch's all-to-all and
all-gathers over the expert-parallel group, sequence parallelism's all-gather and reduce-scatter)
are held to the dtype rule only: their tensors are its activations, on the CUDA device on GPU. Without CUDA this module's own move is simulated: a copy tagged with the
declared device, copied back afterwards, so CPU runs take the same copy-in/copy-out path as a GPU
run. Code that hands a plain CPU tensor to `dist.all_reduce` fails under strict mode as it would on
NCCL. What strict mode cannot see: object collectives' need for `torch.cuda.set_device` (none are
used; `ensure_process_groups` sets the device before `init_process_group`) and stream ordering.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
import torch.distributed as dist

STRICT_ENV = "MILES_STRICT_DEVICE"
# what NCCL takes for every op (float64 included); no uint16/32/64, complex or float8 reductions
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})
WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
           "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")
UNCHECKED_CALLERS = ("torch.", "megatron.")  # their collectives run on CUDA tensors on GPU
DTYPE_CHECKED_CALLERS = ("megatron.",)  # ... but NCCL's dtype rule binds them too
_PLACED = "_miles_placed_on"  # the device type a simulated move put a CPU tensor "on"

_standing: dict = {}  # process group -> the device type it stands for (strict mode)


class DeviceRuleError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


# ---------------------------------------------------------------------------------- the collectives

def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` over `group` in place (on the group's device); returns `tensor`."""
    placed = _place(tensor, group)
    dist.all_reduce(placed, op=op, group=group)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape everywhere), in rank order, on `tensor`'s device."""
    placed = _place(tensor.contiguous(), group)
    parts = [_empty_like(placed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, placed, group=group)
    return [_returned(p, tensor.device) for p in parts]


def barrier(group=None) -> None:
    """All ranks of `group` wait for each other (NCCL: on this rank's CUDA device, not a guessed one)."""
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


# ---------------------------------------------------------------------------------- placement

def group_device(group=None) -> torch.device | None:
    """The device `group`'s collectives take: this rank's CUDA device for NCCL, the declared device
    of a group standing for NCCL in strict mode, None (the tensor's own device) for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    declared = _standing.get(_resolve(group))
    return torch.device(declared) if declared else None


def _place(tensor: torch.Tensor, group) -> torch.Tensor:
    device = group_device(group)
    if device is None or _is_on(tensor, device):
        return tensor
    if device.type == "cuda" and not torch.cuda.is_available():  # strict mode on CPU: simulated
        return _tagged(tensor.detach().clone(), device.type)
    return tensor.detach().to(device)


def _returned(placed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`placed` back on the caller's device (a simulated move: a fresh, untagged tensor object)."""
    return placed.detach() if hasattr(placed, _PLACED) else placed.to(device)


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _empty_like(placed: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(placed)
    tag = getattr(placed, _PLACED, None)
    return _tagged(out, tag) if tag else out


def _tagged(tensor: torch.Tensor, device_type: str) -> torch.Tensor:
    setattr(tensor, _PLACED, device_type)
    return tensor


def _resolve(group):
    return dist.group.WORLD if group is None else group


# ---------------------------------------------------------------------------------- strict mode

def enforce_device_rule_from_env(groups: list) -> None:
    """Strict mode over `groups` when MILES_STRICT_DEVICE is set (only `cuda` is meaningful)."""
    declared = os.environ.get(STRICT_ENV, "")
    if not declared:
        return
    if declared != "cuda":
        raise ValueError(f"{STRICT_ENV}={declared!r}: the only device rule enforced is NCCL's; use {STRICT_ENV}=cuda")
    enforce_device_rule(declared, groups)


def enforce_device_rule(device_type: str, groups: list) -> None:
    """Make each gloo group of `groups` (None: the default world) stand for an NCCL group on
    `device_type`, and wrap torch.distributed's tensor collectives to check calls on them."""
    for g in groups:
        if dist.get_backend(g) == "gloo":
            _standing[_resolve(g)] = device_type
    for name in WRAPPED:
        fn = getattr(dist, name)
        if not getattr(fn, "_miles_checked", False):
            setattr(dist, name, _checked(name, fn))


def strict_device(group=None) -> str | None:
    """The device type `group` stands for under strict mode (None when not enforced)."""
    return _standing.get(_resolve(group))


def _checked(name: str, fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        ours = not caller.startswith(UNCHECKED_CALLERS)
        if ours or caller.startswith(DTYPE_CHECKED_CALLERS):
            bound = signature.bind(*args, **kwargs)
            _check(name, bound.arguments.get("group"), _tensors(bound.arguments.values()), device=ours)
        return fn(*args, **kwargs)

    call._miles_checked = True
    return call


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
    declared = _standing.get(_resolve(group))
    if declared is None:
        return
    for t in tensors:
        where = getattr(t, _PLACED, None) or t.device.type
        if device and where != declared:
            raise DeviceRuleError(
                f"torch.distributed.{name} got a tensor on {t.device} ({t.dtype}, shape {tuple(t.shape)}) for a "
                f"group whose device is {declared} (NCCL; {STRICT_ENV}={declared} makes this gloo group stand for "
                "it): NCCL takes only CUDA tensors. Call it through miles_core.train.collectives, which moves "
                "the tensor to the group's device and back.")
        if t.dtype not in NCCL_DTYPES:
            raise DeviceRuleError(f"torch.distributed.{name} got a {t.dtype} tensor; NCCL takes "
                                  f"{sorted(str(d).removeprefix('torch.') for d in NCCL_DTYPES)}")
