"""The builtin tiny model of each family (miles_core.models.builtin): built by transformers' own config
and model classes over the 13-token digit vocabulary, as `builtin:tiny-gpt` is.

Pins: each materializes to an HF directory whose config.json reads (through its family's adapter) to
the same ModelSpec as `builtin_config`, the light config the checks read without transformers; its
safetensors hold exactly the HF tensors of the adapter's map and as many parameters as
`ModelSpec.parameters()` counts; each has the family's features (llama3 RoPE, q/k norms, experts,
GLM's dense first layer and shared expert); and `--hf-checkpoint builtin:NAME` validates.
Guards: a builtin name the config rules do not know; a light config drifting from the model built.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from safetensors import safe_open

from miles_core.config import parse_flags
from miles_core.config.rules import BUILTIN_MODELS
from miles_core.models.builtin import builtin_config, builtin_hf_config, materialize_checkpoint
from miles_core.models.families import family, spec_of
from miles_core.prepare.checks import validate

NEW = ["builtin:tiny-llama3", "builtin:tiny-qwen3", "builtin:tiny-qwen3-moe", "builtin:tiny-glm4-moe"]


@pytest.mark.parametrize("name", NEW)
def test_materialized_tiny_model_is_its_family_spec(name, tmp_path):
    out = materialize_checkpoint(name, 3, str(tmp_path / "m"), num_layers=2, hidden_size=64, num_heads=4)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    spec = spec_of(cfg)
    assert spec == spec_of(builtin_config(name, 2, 64, 4))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert set(shapes) == {h for e in family(cfg).tensors(spec) for h in e.hf}
    assert sum(math.prod(s) for s in shapes.values()) == spec.parameters()
    assert cfg["vocab_size"] == 13 and cfg["architectures"] == [family(cfg).hf_class]


def test_each_tiny_model_has_its_familys_features():
    spec = {n: spec_of(builtin_config(n, 2, 128, 4)) for n in NEW}
    llama3 = spec["builtin:tiny-llama3"]
    assert (llama3.family, llama3.rope_type, llama3.rope_factor, llama3.rope_original_max_positions) == \
        ("llama", "llama3", 8.0, 32)
    assert spec["builtin:tiny-qwen3"].qk_norm and not spec["builtin:tiny-qwen3"].moe
    moe = spec["builtin:tiny-qwen3-moe"]
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_layers, moe.router_score,
            moe.norm_topk_prob, moe.qk_norm) == (8, 2, 128, (0, 1), "softmax", True, True)
    glm = spec["builtin:tiny-glm4-moe"]
    assert (glm.num_experts, glm.moe_topk, glm.moe_layers, glm.shared_expert_ffn_hidden_size, glm.router_score,
            glm.expert_bias, glm.rotary_fraction, glm.qkv_bias, glm.routed_scaling_factor, glm.router_groups) == \
        (8, 2, (1,), 128, "sigmoid", True, 0.5, True, 2.5, 0)


@pytest.mark.parametrize("name", NEW)
def test_builtin_light_config_is_the_built_one(name):
    built = builtin_hf_config(name, 3, 64, 4).to_dict()
    light = builtin_config(name, 3, 64, 4)
    assert {k: built.get(k, "<missing>") for k in light} == light
    assert spec_of(light) == spec_of(built)


@pytest.mark.parametrize("name", NEW)
def test_builtin_family_models_validate(name):
    assert name in BUILTIN_MODELS
    validate(parse_flags(["--preset", "tiny-reverse4", "--hf-checkpoint", name]))
