"""Trainer: Megatron-core model, HF conversion, off-policy losses, checkpoints (docs/fully-async.md).

Importing the package quiets Megatron's Transformer Engine / Apex fallback warnings on a machine
without CUDA (`cpu_shim.quiet_fallback_warnings`), before any Megatron module is imported.
"""

from miles_core.train.cpu_shim import quiet_fallback_warnings

quiet_fallback_warnings()
