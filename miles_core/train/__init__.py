"""Trainer: Megatron-core model, HF conversion, off-policy losses, checkpoints (DESIGN §5.6)."""
