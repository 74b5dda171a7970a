"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; MoE layers with a softmax top-k
router (`norm_topk_prob` renormalises the chosen k), no shared expert, and the load-balancing aux
loss (`router_aux_loss_coef`). Which layers are MoE: every `decoder_sparse_step`-th, except
`mlp_only_layers`."""

from __future__ import annotations

from miles_core.models.families.base import Family, decoder_entries, llama_like_fields, moe_entries
from miles_core.models.families.spec import ModelSpec


class Qwen3Moe(Family):
    model_type, hf_class, config_class = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"

    def spec(self, cfg):
        if cfg.get("attention_bias"):
            raise self.refuse("attention_bias=true", "attention without biases only")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts:
            raise self.refuse("num_experts=0", "a MoE model; a dense Qwen3 is model_type qwen3")
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        layers = cfg["num_hidden_layers"]
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return ModelSpec(**llama_like_fields(
            self, cfg, qk_norm=True, num_experts=int(experts), moe_topk=int(cfg["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]), router_score="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe_layers,
            aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001))))

    def tensors(self, spec):
        return decoder_entries(spec, lambda s, i: moe_entries(s, i))
