"""Llama (1, 2, 3.x): plain RoPE or Llama 3.1's `llama3` scaling, GQA, SwiGLU, no biases."""

from __future__ import annotations

from miles_core.models.families.base import Family, decoder_entries, llama_like_fields


class Llama(Family):
    model_type, hf_class, config_class = "llama", "LlamaForCausalLM", "LlamaConfig"
    rope_types = ("default", "llama3")

    def spec(self, cfg):
        from miles_core.models.families.spec import ModelSpec

        if cfg.get("attention_bias"):
            raise self.refuse("attention_bias=true (q/k/v and o_proj biases)", "attention without biases only")
        return ModelSpec(**llama_like_fields(self, cfg))

    def tensors(self, spec):
        return decoder_entries(spec)

