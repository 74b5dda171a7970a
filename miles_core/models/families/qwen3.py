"""Qwen3 (dense): Llama's layout with an RMSNorm over each head's q and k (q_norm, k_norm) and a
head_dim of its own (Qwen3-0.6B: 16 heads x 128 over a hidden size of 1024)."""

from __future__ import annotations

from miles_core.models.families.base import Family, decoder_entries, llama_like_fields
from miles_core.models.families.spec import ModelSpec


class Qwen3(Family):
    model_type, hf_class, config_class = "qwen3", "Qwen3ForCausalLM", "Qwen3Config"

    def spec(self, cfg):
        if cfg.get("attention_bias"):
            raise self.refuse("attention_bias=true", "attention without biases only")
        return ModelSpec(**llama_like_fields(self, cfg, qk_norm=True))

    def tensors(self, spec):
        return decoder_entries(spec)
