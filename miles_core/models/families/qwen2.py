"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases."""

from __future__ import annotations

from miles_core.models.families.base import Family, decoder_entries, llama_like_fields
from miles_core.models.families.spec import ModelSpec


class Qwen2(Family):
    model_type, hf_class, config_class = "qwen2", "Qwen2ForCausalLM", "Qwen2Config"

    def spec(self, cfg):
        return ModelSpec(**llama_like_fields(self, cfg, qkv_bias=True))

    def tensors(self, spec):
        return decoder_entries(spec)
