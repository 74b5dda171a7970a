"""What a user brings is accepted or refused early, by the family adapters (miles_core.models.families):
`miles validate --hf-checkpoint DIR` and the importer's config normalisation
(miles_core.prepare.model_import).

Pins: a Qwen3, Qwen3-MoE, GLM-4.5-style MoE and Llama 3.1 (llama3 RoPE scaling, also in the legacy
`rope_scaling.type` spelling, which the importer rewrites) directory, each config written by
transformers' own config class, validates (exit 0) and normalises; a family or option no adapter
handles is refused by `miles validate` at once (exit 2), the message naming the field and what is
handled, and by the importer the same way; --expert-model-parallel-size must divide the experts of
the model (and be 1 for a dense one); the GGUF architectures are the ones transformers' GGUF loader
reads among the families, and a RoPE-scaled GGUF (whose scaling that loader drops) is refused.
Guards: `miles validate` exited 0 on a Qwen3 or MoE directory (and on any family) and only the
import or the run refused it; importing a Llama 3.1 GGUF as a plain-RoPE model.
"""

from __future__ import annotations

import json
import re

import pytest
import transformers

from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.models.families import FAMILIES, spec_of
from miles_core.prepare.checks import model_problems
from miles_core.prepare.model_import import (GGUF_ARCHITECTURES, HF_CLASSES, ModelImportError, gguf_info,
                                             normalize_config)

TINY = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
LLAMA31_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)

ACCEPTED = {
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, head_dim=16, norm_topk_prob=True, **MOE)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                       routed_scaling_factor=2.5, attention_bias=True, partial_rotary_factor=0.5,
                                       **MOE)),
    "llama3.1": ("LlamaConfig", dict(rope_parameters=LLAMA31_ROPE)),
}
REFUSED = {  # config class, fields, what the message names
    "mistral": ("MistralConfig", {}, "model_type='mistral' is not supported; supported: llama, qwen2, qwen3, "
                                     "qwen3_moe, glm4_moe"),
    "qwen3 yarn": ("Qwen3Config", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6,
                                                            original_max_position_embeddings=32)),
                   "rope_parameters.rope_type='yarn' is not supported: qwen3 handles default RoPE"),
    "qwen3 sliding window": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=16),
                             "use_sliding_window=true .* is not supported \\(full attention only\\)"),
    "qwen3_moe gelu": ("Qwen3MoeConfig", dict(num_experts=4, hidden_act="gelu", **MOE),
                       "hidden_act='gelu' is not supported \\(only silu\\)"),
    "glm4_moe grouped top-k": ("Glm4MoeConfig", dict(n_routed_experts=8, n_group=4, topk_group=1,
                                                     num_experts_per_tok=4, moe_intermediate_size=16),
                               "n_group=4 with num_experts_per_tok=4, topk_group=1 is not supported"),
    "llama linear rope": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)),
                          "rope_parameters.rope_type='linear' is not supported: llama handles default and llama3"),
    "llama attention bias": ("LlamaConfig", dict(attention_bias=True), "attention_bias=true"),
}


def written(tmp_path, cls: str, fields: dict) -> str:
    """A model directory whose config.json transformers' config class `cls` wrote."""
    cfg = getattr(transformers, cls)(**{**TINY, **fields})
    cfg.save_pretrained(str(tmp_path))
    return str(tmp_path)


def config(path: str) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_supported_families_validate_and_normalise(case, tmp_path, capsys):
    path = written(tmp_path, *ACCEPTED[case])
    assert main(["validate", "--preset", "tiny-reverse4", "--hf-checkpoint", path]) == 0, capsys.readouterr().err
    out, changes = normalize_config(config(path), path)
    assert spec_of(out) == spec_of(config(path)) and changes == []


def test_llama31_legacy_rope_scaling_is_rewritten_and_kept(tmp_path):
    """Llama 3.1's own config.json spells it rope_scaling={"rope_type": "llama3", ...} with a top-level
    rope_theta; older copies {"type": "llama3"}: both read as the same scaled RoPE."""
    legacy = {"model_type": "llama", **TINY, "rope_theta": 500000.0,
              "rope_scaling": {k: v for k, v in LLAMA31_ROPE.items() if k not in ("rope_type", "rope_theta")}}
    legacy["rope_scaling"]["type"] = "llama3"
    out, changes = normalize_config(legacy, "src")
    assert out["rope_scaling"]["rope_type"] == "llama3" and "type" not in out["rope_scaling"]
    assert changes == ["rope_scaling.type -> rope_scaling.rope_type"]
    spec = spec_of(out)
    assert (spec.rope_type, spec.rope_theta, spec.rope_factor, spec.rope_original_max_positions) == \
        ("llama3", 500000.0, 8.0, 16)
    assert spec == spec_of(config(written(tmp_path, *ACCEPTED["llama3.1"])))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_family_or_option_is_refused_by_validate_at_once(case, tmp_path, capsys):
    cls, fields, named = REFUSED[case]
    path = written(tmp_path, cls, fields)
    assert main(["validate", "--preset", "tiny-reverse4", "--hf-checkpoint", path]) == 2
    err = capsys.readouterr().err
    assert f"--hf-checkpoint={path!r}" in err and "docs/models.md" in err
    assert re.search(named, err), err
    with pytest.raises(ModelImportError, match=named):
        normalize_config(config(path), path)


def test_the_checks_read_the_experts_of_the_model():
    """--expert-model-parallel-size against the model's experts, before the run (the trainer's rules)."""
    moe = {"model_type": "qwen3_moe", **TINY, "num_experts": 8, **MOE}
    dense = {"model_type": "qwen3", **TINY}
    flags = lambda ep: parse_flags(["--preset", "tiny-reverse4", "--actor-num-gpus-per-node", "16", "--expert-model-parallel-size", str(ep)],
                                   check=False)
    assert model_problems(moe, flags(4)) == [] and model_problems(dense, flags(1)) == []
    assert "--expert-model-parallel-size=16 must divide the checkpoint's 8 routed experts" in \
        model_problems(moe, flags(16))[0]
    assert "the checkpoint (qwen3) has no experts" in model_problems(dense, flags(2))[0]


def test_importer_names_come_from_the_adapters():
    assert set(HF_CLASSES) == set(FAMILIES)
    assert HF_CLASSES["qwen3_moe"] == "Qwen3MoeForCausalLM" and HF_CLASSES["glm4_moe"] == "Glm4MoeForCausalLM"


def test_gguf_architectures_are_those_transformers_loads_among_ours():
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    assert set(GGUF_ARCHITECTURES.values()) == set(GGUF_CONFIG_MAPPING) & set(FAMILIES)
    assert all(gguf == mtype.replace("_", "") for gguf, mtype in GGUF_ARCHITECTURES.items())


def _gguf(path, arch: str, tensors=("token_embd.weight",), **fields) -> str:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in fields.items():
        w.add_float32(key, value)
    for name in tensors:
        w.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("tensors,fields,named", [
    (("token_embd.weight", "rope_freqs.weight"), {}, "rope_freqs.weight"),
    (("token_embd.weight",), {"llama.rope.scaling.factor": 8.0}, "llama.rope.scaling.factor"),
])
def test_rope_scaled_gguf_is_refused(tmp_path, tensors, fields, named):
    path = _gguf(tmp_path / "m.gguf", "llama", tensors, **fields)
    with pytest.raises(ModelImportError, match=f"scales RoPE \\({named}\\).*import the model's HF safetensors"):
        gguf_info(path)
    assert gguf_info(_gguf(tmp_path / "plain.gguf", "qwen3moe"))[0] == "qwen3moe"


def test_gguf_weights_are_written_in_the_families_on_disk_names(tmp_path):
    """A dequantized GGUF model is written as transformers writes a checkpoint: a Qwen3-MoE's experts one
    tensor each, the names of its adapter's map (its state_dict holds them fused: 3-D gate_up_proj)."""
    import torch
    from safetensors import safe_open

    from miles_core.models.families import family
    from miles_core.prepare.model_import import save_weights

    cfg = transformers.Qwen3MoeConfig(**TINY, num_experts=4, head_dim=8, tie_word_embeddings=True, **MOE)
    with torch.random.fork_rng():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    save_weights(model, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    hf = cfg.to_dict()
    assert names == {h for e in family(hf).tensors(spec_of(hf)) for h in e.hf}
