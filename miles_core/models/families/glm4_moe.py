"""GLM-4.5 / GLM-4.6 (`glm4_moe`): partial rotary (half of each head's dims by default), q/k/v
biases, optional q/k norms (`use_qk_norm`); the first `first_k_dense_replace` layers dense, the rest
MoE with shared experts and a sigmoid router whose expert-score correction bias
(`e_score_correction_bias`) enters the choice of experts only, grouped top-k (`n_group`,
`topk_group`), the chosen weights renormalised (`norm_topk_prob`) and scaled
(`routed_scaling_factor`). No aux loss: the bias balances the experts. The multi-token-prediction layers a checkpoint may
carry after the decoder (`num_nextn_predict_layers`, used for speculative decoding only) are not
trained: the trainer reads the decoder's tensors by name, and an export holds those only."""

from __future__ import annotations

from miles_core.models.families.base import Family, decoder_entries, llama_like_fields, moe_entries
from miles_core.models.families.spec import ModelSpec


class Glm4Moe(Family):
    model_type, hf_class, config_class = "glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig"

    def spec(self, cfg):
        experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 0)))
        if not experts:
            raise self.refuse("n_routed_experts=0", "a MoE model")
        groups, group_topk, topk = int(cfg.get("n_group", 1) or 1), int(cfg.get("topk_group", 1) or 1), \
            int(cfg["num_experts_per_tok"])
        if groups > 1 and topk // group_topk != 2:
            raise self.refuse(f"n_group={groups} with num_experts_per_tok={topk}, topk_group={group_topk}",
                              "grouped top-k where num_experts_per_tok / topk_group = 2: a group's score is "
                              "the sum of its best 2, as in both transformers and Megatron")
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        shared = int(cfg.get("n_shared_experts", 0) or 0)
        moe_ffn = int(cfg["moe_intermediate_size"])
        return ModelSpec(**llama_like_fields(
            self, cfg, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
            num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=moe_ffn,
            shared_expert_ffn_hidden_size=shared * moe_ffn, router_score="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), expert_bias=True,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            router_groups=groups if groups > 1 else 0, router_group_topk=group_topk if groups > 1 else 0,
            moe_layers=tuple(range(first_dense, cfg["num_hidden_layers"]))))

    def tensors(self, spec):
        return decoder_entries(spec, lambda s, i: moe_entries(
            s, i, shared=s.shared_expert_ffn_hidden_size > 0, bias_name="gate.e_score_correction_bias"))
