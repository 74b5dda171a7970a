"""Builtin tiny causal LMs (random init from a seed) and the digit tokenizer of the builtin tasks.

`materialize_checkpoint(cfg_model, seed, out_dir)` writes an HF-format directory (config.json,
model.safetensors, tokenizer files) that every other component loads as if it were a real
checkpoint: the CPU engine, the HF->Megatron converter, snapshots. A non-builtin
`--hf-checkpoint` is used as it is.

The digit vocabulary is 13 tokens (DESIGN §10: byte-sized vocabularies are not learnable in
minutes): "0".."9" -> 0..9, <sep> 10, <eos> 11, <pad> 12.
"""

from __future__ import annotations

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


_CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def builtin_config(name: str, num_layers: int, hidden_size: int, num_heads: int) -> dict:
    """The builtin model `name`'s config.json fields that define it ({"model_type": ..., ...}), without
    importing transformers (seconds of CPU): what the checks before a run read."""
    common = dict(vocab_size=len(DIGIT_VOCAB), bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if name == "builtin:tiny-gpt":  # learned absolute positions: the learnable default (DESIGN §10)
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
    raise ValueError(f"unknown builtin model {name!r}")


def builtin_hf_config(name: str, num_layers: int, hidden_size: int, num_heads: int):
    """`builtin_config` as the transformers config the model is built from."""
    import transformers

    fields = builtin_config(name, num_layers, hidden_size, num_heads)
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
    model.save_pretrained(out_dir, safe_serialization=True)
    digit_tokenizer().save_pretrained(out_dir)
    with open(os.path.join(out_dir, "miles_builtin.json"), "w") as f:
        json.dump({"hf_checkpoint": hf_checkpoint, "seed": seed}, f)
    return out_dir
