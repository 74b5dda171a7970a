"""The trainer optimizer's state as tensors + a JSON skeleton (what a checkpoint stores, no pickle), and back.

    tensors, skeleton = optimizer_state(optimizer)          # every rank calls it (a collective)
    load_optimizer_state(optimizer, tensors, skeleton)      # every rank calls it (a collective)

- torch AdamW (the fp32 CPU trainer), and Megatron's `ChainedOptimizer` of non-distributed
  optimizers (megatron-core 0.16.1: with one inner `Float16OptimizerWithFloat16Params`, its
  `state_dict()` is {"optimizer": AdamW state, "fp32_from_fp16_params": fp32 main params per group},
  plus "grad_scaler" under fp16; a list of such dicts with several inner optimizers): the
  `state_dict()` as it is, replicated over DP ranks. Megatron's `load_state_dict` matches param
  groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr), loads the Adam moments (moved
  to the parameters' device) and copies the saved fp32 main params into the live ones.
- Megatron's `DistributedOptimizer` (--use-distributed-optimizer): its `state_dict()` holds the
  param groups and the step only (distrib_optimizer.py, `DistributedOptimizer.state_dict`); the
  parameter state (fp32 main params, exp_avg, exp_avg_sq) is sharded over DP ranks. It is gathered
  onto DP rank 0 by `get_parameter_state_dp_zero()` (over Megatron's gloo DP group) as one unpadded
  fp32 tensor per grad buffer and key, which does not depend on the DP size: the checkpoint resumes
  at any DP size. On load every rank restores the state dict, then DP rank 0's tensors are
  scattered (`load_parameter_state_from_dp_zero`). Stored as {"distributed": {"state_dict": ...,
  "dp_zero": [one per inner optimizer]}}; DP ranks other than 0 return an empty "dp_zero" entry
  (only DP rank 0 writes optimizer files, miles_core.train.checkpoint).
"""

from __future__ import annotations

import torch

from miles_core.train.cpu_shim import megatron_on_cpu
from miles_core.train.state_tree import flatten, unflatten

DISTRIBUTED = "distributed"


class OptimizerStateError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def distributed_parts(optimizer) -> list:
    """The inner `DistributedOptimizer`s of a Megatron `ChainedOptimizer` ([] for any other optimizer)."""
    inner = getattr(optimizer, "chained_optimizers", None)
    if not inner:
        return []
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = [o for o in inner if isinstance(o, DistributedOptimizer)]
    if parts and len(parts) != len(inner):
        raise OptimizerStateError("a ChainedOptimizer mixing distributed and non-distributed optimizers is not "
                                  "supported")
    return parts


def optimizer_state(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON skeleton) of the optimizer's whole state (see the module doc)."""
    parts = distributed_parts(optimizer)
    if not parts:
        return flatten(optimizer.state_dict())
    with megatron_on_cpu():
        dp_zero = [o.get_parameter_state_dp_zero() for o in parts]  # collective over DP
        state = optimizer.state_dict()
    return flatten({DISTRIBUTED: {"state_dict": state, "dp_zero": dp_zero if all(dp_zero) else []}})


def load_optimizer_state(optimizer, tensors: dict[str, torch.Tensor], skeleton: dict) -> None:
    """Inverse of `optimizer_state`; the bf16 model weights come from the model part of a checkpoint."""
    tree = unflatten(tensors, skeleton)
    parts = distributed_parts(optimizer)
    saved_distributed = isinstance(tree, dict) and set(tree) == {DISTRIBUTED}
    if bool(parts) != saved_distributed:
        have, saved = ("with" if parts else "without"), ("with" if saved_distributed else "without")
        raise OptimizerStateError(f"the checkpoint's optimizer state was saved {saved} --use-distributed-optimizer "
                                  f"and this trainer runs {have} it; resume with the same setting")
    if not parts:
        with megatron_on_cpu():
            optimizer.load_state_dict(tree)
        return
    saved = tree[DISTRIBUTED]
    if len(saved["dp_zero"]) != len(parts):
        raise OptimizerStateError(f"the checkpoint holds the state of {len(saved['dp_zero'])} distributed "
                                  f"optimizers; this trainer has {len(parts)}")
    # no_grad: with fp32 weights a shard's main param is a view of the model's (autograd refuses the copy)
    with megatron_on_cpu(), torch.no_grad():
        optimizer.load_state_dict(saved["state_dict"])
        for part, state in zip(parts, saved["dp_zero"]):
            _load_dp_zero(part, state)


def _load_dp_zero(part, state) -> None:
    """`load_parameter_state_from_dp_zero` (a collective: DP rank 0 scatters). In megatron-core 0.16.1
    it copies every key of the live per-parameter state (distrib_optimizer.py,
    `_set_main_param_and_optimizer_states`); with torch's Adam (no TE or Apex FusedAdam, which keep
    the step in the param groups) that includes a "step" the dp-zero state does not hold, and which
    `load_state_dict` has just restored: it is set aside for the copy. That restore also gives every
    parameter the *same* step tensor (`DistributedOptimizer.load_state_dict`, "Extract 'step', for
    non-Apex/TE support"), which torch's Adam then increments in place once per parameter at each
    step, so each parameter gets its own copy back."""
    live = part.optimizer.state
    steps = {p: st.pop("step") for p, st in live.items() if "step" in st}
    try:
        part.load_parameter_state_from_dp_zero(state)
    finally:
        for p, step in steps.items():
            live[p]["step"] = step.clone()
