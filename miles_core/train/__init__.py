"""Trainer: Megatron-core model, HF conversion, off-policy losses, checkpoints (docs/fully-async.md).

Importing the package, on a machine without CUDA and before any Megatron module is imported, quiets
Megatron's Transformer Engine / Apex fallback warnings (`cpu_shim.quiet_fallback_warnings`) and makes
its jit fuser the identity (`cpu_shim.eager_jit_fuser`: no torch compiler stack in every rank).
"""

from miles_core.train.cpu_shim import eager_jit_fuser, quiet_fallback_warnings

quiet_fallback_warnings()
eager_jit_fuser()
