"""One adapter per model family: how an HF config.json becomes the `ModelSpec` every role reads,
and the HF <-> Megatron tensor map (miles_core.models.families.tensors), each written once.

    fam = family(cfg)            # the adapter of config.json's model_type, or UnsupportedModel naming
    spec = fam.spec(cfg)         #   the families handled; the ModelSpec, or UnsupportedModel naming
    entries = fam.tensors(spec)  #   the option; every Megatron tensor and the HF tensors it is made of

Readers: the importer (refuses early what no role handles), the trainer's model builder and
converter (miles_core.train), the CPU engine (miles_core.engines.model) and the memory estimate
(miles_core.prepare.memory). Adding a family is one module here. The families and what each
needs: docs/models.md.
"""

from __future__ import annotations

from typing import Any

from miles_core.models.families.base import Family
from miles_core.models.families.glm4_moe import Glm4Moe
from miles_core.models.families.gpt2 import Gpt2
from miles_core.models.families.llama import Llama
from miles_core.models.families.qwen2 import Qwen2
from miles_core.models.families.qwen3 import Qwen3
from miles_core.models.families.qwen3_moe import Qwen3Moe
from miles_core.models.families.spec import ModelSpec, UnsupportedModel
from miles_core.models.families.tensors import Entry

ADAPTERS: dict[str, Family] = {f.model_type: f for f in (Llama(), Qwen2(), Qwen3(), Qwen3Moe(), Glm4Moe(), Gpt2())}
# What a user may bring (gpt2 is the builtin tiny default's layout)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")

__all__ = ["ADAPTERS", "FAMILIES", "Entry", "Family", "ModelSpec", "UnsupportedModel", "family", "spec_of"]


def family(cfg: dict[str, Any]) -> Family:
    mtype = cfg.get("model_type", "")
    if mtype not in ADAPTERS:
        raise UnsupportedModel(f"model_type={mtype!r} is not supported; supported: {', '.join(FAMILIES)}")
    return ADAPTERS[mtype]


def spec_of(cfg: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of an HF config.json dict (its family's adapter); UnsupportedModel names what is not handled.
    A missing required field raises KeyError naming it."""
    return family(cfg).spec(cfg)


ModelSpec.from_hf_config = staticmethod(spec_of)  # the spec module cannot import the adapters (a cycle)
