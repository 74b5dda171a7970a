"""GPT-2 (the builtin tiny default): LayerNorm, gelu (tanh approximation), biases everywhere,
learned absolute positions, tied embeddings. HF's Conv1D weights are stored [in, out]."""

from __future__ import annotations

from miles_core.models.families.base import Family
from miles_core.models.families.spec import ModelSpec, UnsupportedModel
from miles_core.models.families.tensors import Entry


class Gpt2(Family):
    model_type, hf_class, config_class = "gpt2", "GPT2LMHeadModel", "GPT2Config"

    def spec(self, cfg):
        if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UnsupportedModel(f"gpt2 activation {cfg.get('activation_function')!r}: only gelu_new is supported")
        if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
            raise self.refuse("attention variants (scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn)",
                              "plain GPT-2 attention only")
        n = cfg["n_embd"]
        return ModelSpec("gpt2", cfg["vocab_size"], n, cfg["n_layer"], cfg["n_head"], cfg["n_head"],
                         cfg.get("n_inner") or 4 * n, cfg["n_positions"], cfg.get("layer_norm_epsilon", 1e-5),
                         bool(cfg.get("tie_word_embeddings", True)), qkv_bias=True, norm="layer",
                         activation="gelu_tanh", gated=False, linear_bias=True, positions="learned", rope_theta=0.0)

    def tensors(self, spec):
        t = "transformer."
        out = [Entry("embedding.word_embeddings.weight", (t + "wte.weight",)),
               Entry("embedding.position_embeddings.weight", (t + "wpe.weight",)),
               Entry("decoder.final_layernorm.weight", (t + "ln_f.weight",)),
               Entry("decoder.final_layernorm.bias", (t + "ln_f.bias",))]
        if not spec.tied_embeddings:
            out.append(Entry("output_layer.weight", ("lm_head.weight",)))
        for i in range(spec.num_layers):
            h, m = f"{t}h.{i}.", f"decoder.layers.{i}."
            for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out += [Entry(f"{m}{b}.{x}", (f"{h}{a}.{x}",)) for x in ("weight", "bias")]
            out += [Entry(m + "self_attention.linear_qkv.weight", (h + "attn.c_attn.weight",), "c_attn"),
                    Entry(m + "self_attention.linear_qkv.bias", (h + "attn.c_attn.bias",), "c_attn")]
            for a, b in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                         ("mlp.c_proj", "mlp.linear_fc2")):
                out += [Entry(f"{m}{b}.weight", (f"{h}{a}.weight",), "t"), Entry(f"{m}{b}.bias", (f"{h}{a}.bias",))]
        return out
