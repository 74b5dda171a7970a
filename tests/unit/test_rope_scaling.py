"""RoPE scaling in the two model readers (the CPU engine's and the trainer's `ModelSpec`).

Pins: both read `rope_type` or the legacy `type` from `rope_parameters` (transformers 5) and from
`rope_scaling` (older configs); default RoPE and Llama 3.1's `llama3` scaling (with its factor, band
factors and original context) are accepted; any other type is refused with the field and value named. Guards: the trainer once read only `rope_type`, so a `{"type": "linear"}` checkpoint
trained as plain RoPE while meant to be scaled (a silently wrong model). The importer's config
normalisation is pinned here too (legacy form rewritten, the rest refused by name).
"""

from __future__ import annotations

import pytest

from miles_core.engines.model import ModelLoadError, spec_from_config
from miles_core.prepare.model_import import ModelImportError, normalize_config
from miles_core.train.megatron_model import ModelSpec as TrainSpec
from miles_core.train.megatron_model import UnsupportedModel

BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 5000.0}

ACCEPTED = [
    {},
    {"rope_scaling": None},
    {"rope_scaling": {"type": "default"}},
    {"rope_scaling": {"rope_type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
]
REFUSED = [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type='linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}, "rope_parameters.rope_type='longrope'"),
    ({"rope_parameters": {"type": "yarn"}}, "rope_parameters.type='yarn'"),
    # a default rope_parameters does not hide a legacy scaling next to it
    ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"type": "linear"}}, "rope_scaling.type='linear'"),
]
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("extra", ACCEPTED)
def test_default_rope_is_read_by_both(extra):
    cfg = {**BASE, **extra}
    assert spec_from_config(cfg, "cfg").rope_theta == 5000.0
    assert TrainSpec.from_hf_config(cfg).rope_theta == 5000.0


@pytest.mark.parametrize("extra,named", REFUSED)
def test_scaled_rope_is_refused_by_name(extra, named):
    cfg = {**BASE, **extra}
    with pytest.raises(ModelLoadError, match=f"{named} is not supported"):
        spec_from_config(cfg, "cfg")
    with pytest.raises(UnsupportedModel, match=f"{named} is not supported"):
        TrainSpec.from_hf_config(cfg)
    with pytest.raises(ModelImportError, match=f"{named} is not supported"):
        normalize_config(cfg, "src")


@pytest.mark.parametrize("extra", [{"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}},
                                   {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}}])
def test_llama3_rope_is_read_by_both(extra):
    """Llama 3.1's scaling, in the transformers 5 form and the legacy one: both readers keep every parameter."""
    cfg = {**BASE, **extra}
    for spec in (spec_from_config(cfg, "cfg"), TrainSpec.from_hf_config(cfg)):
        assert (spec.rope_type, spec.rope_theta, spec.rope_factor, spec.rope_low_freq_factor,
                spec.rope_high_freq_factor, spec.rope_original_max_positions) == ("llama3", 5e5, 8.0, 1.0, 4.0, 8192)


def test_llama3_rope_is_refused_for_a_family_without_it():
    cfg = {**BASE, "model_type": "qwen2", "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    with pytest.raises(ModelLoadError, match="rope_scaling.rope_type='llama3' is not supported"):
        spec_from_config(cfg, "cfg")


def test_theta_from_rope_parameters_wins():
    cfg = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}
    assert spec_from_config(cfg, "cfg").rope_theta == 1e5 == TrainSpec.from_hf_config(cfg).rope_theta


def test_importer_rewrites_legacy_default_and_drops_quantization():
    cfg = {**BASE, "rope_scaling": {"type": "default"}, "quantization_config": {"quant_method": "gguf"}}
    out, changes = normalize_config(cfg, "src")
    assert out["rope_scaling"] == {"rope_type": "default"} and "quantization_config" not in out
    assert changes == ["dropped quantization_config", "rope_scaling.type -> rope_scaling.rope_type"]
    assert cfg["rope_scaling"] == {"type": "default"}  # the input is not modified
