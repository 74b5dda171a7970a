"""The trainer's collectives on its own process groups, in one place, under NCCL's device rule.

On GPU the trainer's groups (the default world, Megatron's DP and TP groups) are NCCL, which takes
only tensors on the rank's current CUDA device, of a dtype NCCL knows; on CPU they are gloo, which
takes tensors where they are. Callers hand `all_reduce`, `all_gather` and `barrier` tensors wherever
they hold them: the tensor goes to `group_device(group)` (the current CUDA device for NCCL, left
where it is for gloo) and the result comes back on the caller's device. `all_reduce` works in place,
like `torch.distributed.all_reduce`. Every `torch.distributed` collective in `miles_core/train` goes
through here (tests/unit/test_collectives.py checks the source; tests/integration/test_rank_groups.py
runs it on gloo ranks); Megatron's own collectives run on its CUDA activations and are not ours.

A gloo group may stand for an NCCL group (`stand_for("cuda", groups)`): `group_device` then answers
the declared device and this module moves tensors there as it would for NCCL. Without CUDA the move
is simulated: a copy tagged with the declared device (`placed_device_type`), copied back afterwards,
so a CPU run takes the same copy-in/copy-out path as a GPU run. The check that refuses what NCCL
would refuse (the wrong device, a dtype NCCL lacks) is the test harness's
(`tests/support/strict_device.py`), installed in each rank through the rank setup hook
(`miles_core.train.process_groups`, docs/training.md#the-device-rule-on-cpu).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_PLACED = "_miles_placed_on"  # the device type a simulated move put a CPU tensor "on"

_standing: dict = {}  # process group -> the device type it stands for (`stand_for`)


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


# ---------------------------------------------------------------------------------- standing for NCCL

def stand_for(device_type: str, groups: list) -> None:
    """Make each gloo group of `groups` (None: the default world) stand for an NCCL group on
    `device_type`: this module's collectives place tensors on that device (simulated without it)."""
    for g in groups:
        if dist.get_backend(g) == "gloo":
            _standing[_resolve(g)] = device_type


def standing_device(group=None) -> str | None:
    """The device type `group` stands for (None when it stands for nothing)."""
    return _standing.get(_resolve(group))


def placed_device_type(tensor: torch.Tensor) -> str:
    """The device type `tensor` is on for a collective: a simulated move's declared device, else its own."""
    return getattr(tensor, _PLACED, None) or tensor.device.type
