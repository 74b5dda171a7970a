"""Builtin tiny causal LMs (random init from a seed) and the digit tokenizer of the builtin tasks.

`materialize_checkpoint(cfg_model, seed, out_dir)` writes an HF-format directory (config.json,
model.safetensors, tokenizer files) that every other component loads as if it were a real
checkpoint: the CPU engine, the HF->Megatron converter, snapshots. A non-builtin
`--hf-checkpoint` is used as it is.

The digit vocabulary is 13 tokens (byte-sized vocabularies are not learnable in minutes):
"0".."9" -> 0..9, <sep> 10, <eos> 11, <pad> 12.

One tiny model per family (docs/models.md), each built by transformers' own config class:
tiny-gpt (the learnable default), tiny-llama, tiny-llama3 (Llama 3.1's `llama3` RoPE scaling over
an original context of MAX_POSITIONS, so that the three frequency bands are all present),
tiny-qwen2, tiny-qwen3 (q/k norms), tiny-qwen3-moe (8 experts, top-2, softmax router renormalised
over the chosen two) and tiny-glm4-moe (the first layer dense, then 8 experts top-2 behind a
sigmoid router with its correction bias, one shared expert, partial rotary, q/k/v biases). A MoE
model's experts are as wide as its hidden size, its dense MLPs 4x, as tiny-llama's.
"""

from __future__ import annotations

import contextlib
import json
import os

DIGIT_VOCAB = {**{str(d): d for d in range(10)}, "<sep>": 10, "<eos>": 11, "<pad>": 12}
SEP_ID, EOS_ID, PAD_ID = 10, 11, 12
MAX_POSITIONS = 32


def digit_tokenizer():
    """A PreTrainedTokenizerFast over the 13-token digit vocabulary (whitespace separated)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=DIGIT_VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<pad>", sep_token="<sep>")


_CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                   "qwen3_moe": "Qwen3MoeConfig", "glm4_moe": "Glm4MoeConfig"}
TINY_EXPERTS, TINY_TOPK = 8, 2


def builtin_config(name: str, num_layers: int, hidden_size: int, num_heads: int) -> dict:
    """The builtin model `name`'s config.json fields that define it ({"model_type": ..., ...}), without
    importing transformers (seconds of CPU): what the checks before a run read."""
    common = dict(vocab_size=len(DIGIT_VOCAB), bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if name == "builtin:tiny-gpt":  # learned absolute positions: the learnable default
        return dict(model_type="gpt2", n_positions=MAX_POSITIONS, n_embd=hidden_size, n_layer=num_layers,
                    n_head=num_heads, n_inner=4 * hidden_size, activation_function="gelu_new", resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, **common)
    llama_like = dict(hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
                      max_position_embeddings=MAX_POSITIONS * 4, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=True, **common)
    if name == "builtin:tiny-llama":
        return dict(model_type="llama", **llama_like)
    if name == "builtin:tiny-qwen2":
        return dict(model_type="qwen2", **llama_like)
    # transformers 5's form: rope_theta inside rope_parameters
    rope = dict(rope_type="default", rope_theta=llama_like.pop("rope_theta"))
    head_dim = hidden_size // num_heads
    moe = dict(num_experts_per_tok=TINY_TOPK, moe_intermediate_size=hidden_size, norm_topk_prob=True)
    if name == "builtin:tiny-llama3":
        return dict(model_type="llama", rope_parameters=dict(rope, rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                             low_freq_factor=1.0, high_freq_factor=4.0,
                                                             original_max_position_embeddings=MAX_POSITIONS),
                    head_dim=head_dim, **llama_like)
    if name == "builtin:tiny-qwen3":
        return dict(model_type="qwen3", rope_parameters=rope, head_dim=head_dim, **llama_like)
    if name == "builtin:tiny-qwen3-moe":  # transformers 5 writes num_experts as num_local_experts
        return dict(model_type="qwen3_moe", rope_parameters=rope, head_dim=head_dim, num_local_experts=TINY_EXPERTS,
                    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, **moe, **llama_like)
    if name == "builtin:tiny-glm4-moe":
        return dict(model_type="glm4_moe", rope_parameters=dict(rope, partial_rotary_factor=0.5),
                    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=TINY_EXPERTS,
                    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                    num_nextn_predict_layers=0, **moe, **llama_like)
    raise ValueError(f"unknown builtin model {name!r}")


def builtin_hf_config(name: str, num_layers: int, hidden_size: int, num_heads: int):
    """`builtin_config` as the transformers config the model is built from."""
    import transformers

    fields = builtin_config(name, num_layers, hidden_size, num_heads)
    if fields["model_type"] == "glm4_moe":  # the constructor's name for num_nextn_predict_layers
        fields["num_mtp_layers"] = fields.pop("num_nextn_predict_layers")
    return getattr(transformers, _CONFIG_CLASSES[fields.pop("model_type")])(**fields)


def materialize_checkpoint(hf_checkpoint: str, seed: int, out_dir: str, *, num_layers: int = 2,
                           hidden_size: int = 128, num_heads: int = 4) -> str:
    """Write the builtin model `hf_checkpoint` (random init from `seed`) as an HF directory; return it."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = builtin_hf_config(hf_checkpoint, num_layers, hidden_size, num_heads)
    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    with _no_progress_bars():  # a one-shard "Writing model shards" bar on every new run's console
        model.save_pretrained(out_dir, safe_serialization=True)
    digit_tokenizer().save_pretrained(out_dir)
    with open(os.path.join(out_dir, "miles_builtin.json"), "w") as f:
        json.dump({"hf_checkpoint": hf_checkpoint, "seed": seed}, f)
    return out_dir


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
