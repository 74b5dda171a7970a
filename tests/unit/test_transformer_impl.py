"""--transformer-impl: Transformer Engine's layer spec where it can run, Megatron's local spec
otherwise, and one set of tensor names for both (miles_core.train.megatron_model, hf_convert).

On CPU only the choice, the names and the packed-row boundaries can run (Transformer Engine needs
CUDA); tests/gpu/test_transformer_engine.py builds the TE model on a GPU where the package exists.

Pins: auto is local without a GPU; asking for transformer_engine where it cannot run is refused
naming the flag; TE's fused norm parameters (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`, and their biases) are read and written under the local spec's names,
so HF conversion, TP sharding and checkpoints treat both specs alike; a packed row's samples become
TE's cu_seqlens.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.config import ConfigError, parse_flags
from miles_core.train import hf_convert
from miles_core.train.megatron_model import UnsupportedModel, thd_params, transformer_impl


def test_auto_is_local_without_a_gpu_and_transformer_engine_is_refused_by_name():
    assert not torch.cuda.is_available()
    assert transformer_impl("auto") == "local"
    assert transformer_impl("local") == "local"
    with pytest.raises(UnsupportedModel, match="--transformer-impl=transformer_engine needs a GPU"):
        transformer_impl("transformer_engine")


def test_the_flag_takes_megatrons_values_only():
    assert parse_flags(["--preset", "tiny-reverse4", "--transformer-impl", "local"]).train.transformer_impl == "local"
    with pytest.raises(ConfigError, match="--transformer-impl"):
        parse_flags(["--preset", "tiny-reverse4", "--transformer-impl", "te"])


class _FusedNormLinear(torch.nn.Module):
    """The parameters of TE's LayerNormLinear as Megatron's TE spec names them."""

    def __init__(self, n: int):
        super().__init__()
        self.layer_norm_weight = torch.nn.Parameter(torch.full((n,), 2.0))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(n))
        self.weight = torch.nn.Parameter(torch.ones(3 * n, n))


class _TELayer(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = _FusedNormLinear(n)
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = _FusedNormLinear(n)


def test_fused_norms_go_by_the_local_specs_names_and_share_storage():
    layer = _TELayer(4)
    tensors = hf_convert.model_tensors(layer)
    assert set(tensors) == {"input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                            "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight"}
    hf_convert.copy_checked("input_layernorm.weight", tensors["input_layernorm.weight"], torch.full((4,), 7.0))
    assert torch.equal(layer.self_attention.linear_qkv.layer_norm_weight.detach(), torch.full((4,), 7.0))
    assert set(hf_convert.megatron_state(layer)) == set(tensors)
    assert hf_convert.canonical_name("decoder.layers.3.mlp.linear_fc1.layer_norm_bias") == \
        "decoder.layers.3.pre_mlp_layernorm.bias"
    unfused = "decoder.layers.3.mlp.linear_fc1.weight"
    assert hf_convert.canonical_name(unfused) == unfused


def test_a_packed_rows_samples_become_cu_seqlens():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    p = thd_params(positions)
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 3, 5, 9]
    assert p.cu_seqlens_q.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 4
