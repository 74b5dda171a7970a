"""HF <-> Megatron conversion: bit-exact round trips and logits equal to `transformers`.

Pins: the qkv packing per query group, the [gate; up] order of fc1, GPT-2's Conv1D transposes,
learned positions, RoPE theta and tied/untied embeddings. The swapped gate/up test shows the
logits comparison is sharp enough to catch a wrong mapping.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.train import hf_convert
from miles_core.train.megatron_model import ModelSpec, UnsupportedModel, build_model, forward_logits

torch.set_num_threads(1)
LOGIT_ATOL = 1e-4  # fp32 on CPU; observed differences are ~1e-6


def _hf_model(kind: str, tied: bool):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=37, n_positions=24, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         tie_word_embeddings=tied)
    else:
        cls = LlamaConfig if kind == "llama" else Qwen2Config
        cfg = cls(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; randomise so their mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _spec_and_state(model):
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("attn.bias")
             or "c_attn" in k}
    if spec.tied_embeddings:
        state.pop("lm_head.weight", None)
    return spec, state


CASES = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)]


@pytest.mark.parametrize("kind,tied", CASES)
def test_round_trip_is_bit_exact(kind, tied):
    """HF -> Megatron -> HF returns exactly the same tensors under the same names."""
    spec, state = _spec_and_state(_hf_model(kind, tied))
    back = hf_convert.megatron_to_hf(spec, hf_convert.hf_to_megatron(spec, state))
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("kind,tied", CASES)
def test_megatron_logits_match_transformers(kind, tied):
    """A Megatron GPTModel loaded through the converter gives the logits `transformers` gives."""
    hf = _hf_model(kind, tied)
    spec, state = _spec_and_state(hf)
    assert spec.tied_embeddings == tied
    if kind != "gpt2":
        assert spec.rope_theta == 5000.0
    model = build_model(spec).eval()
    hf_convert.load_into_megatron(model, spec, state)
    ids = torch.randint(0, 37, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = forward_logits(model, ids)
        ref = hf(input_ids=ids).logits
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    # export back from the live model is the original checkpoint
    back = hf_convert.megatron_to_hf(spec, hf_convert.megatron_state(model))
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_swapped_gate_up_is_caught():
    """A converter that swapped gate and up would give logits far outside the tolerance."""
    hf = _hf_model("qwen2", False)
    with torch.no_grad():  # at init scale (std 0.02) the MLP barely moves the logits; make it count
        for name, p in hf.named_parameters():
            if ".mlp." in name:
                p.mul_(10.0)
    spec, state = _spec_and_state(hf)
    model = build_model(spec).eval()
    hf_convert.load_into_megatron(model, spec, state)
    with torch.no_grad():
        for layer in model.decoder.layers:
            w = layer.mlp.linear_fc1.weight
            gate, up = torch.chunk(w.clone(), 2, dim=0)
            w.copy_(torch.cat([up, gate], 0))
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        right = hf(input_ids=ids).logits
        diff = (forward_logits(model, ids) - right).abs().max().item()
        hf_convert.load_into_megatron(model, spec, state)
        assert (forward_logits(model, ids) - right).abs().max().item() < LOGIT_ATOL
    assert diff > 100 * LOGIT_ATOL


def test_missing_tensor_and_unknown_family_are_named():
    """A missing tensor names the key; an unsupported model_type lists the supported ones."""
    spec, state = _spec_and_state(_hf_model("llama", True))
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(hf_convert.ConversionError, match="up_proj"):
        hf_convert.hf_to_megatron(spec, state)
    with pytest.raises(UnsupportedModel, match="llama, qwen2, qwen3, qwen3_moe, glm4_moe"):
        ModelSpec.from_hf_config({"model_type": "phi3"})


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_tensor_parallel_shards_reassemble(kind):
    """TP=2 shards of every tensor reassemble exactly; fc1 shards hold matching gate/up halves."""
    spec, state = _spec_and_state(_hf_model(kind, False))
    full = hf_convert.hf_to_megatron(spec, state)
    for name, t in full.items():
        parts = [hf_convert.shard_tensor(spec, name, t, r, 2) for r in range(2)]
        assert torch.equal(hf_convert.unshard_tensor(spec, name, parts), t), name
    if kind != "gpt2":
        fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
        gate = state["model.layers.0.mlp.gate_proj.weight"]
        rank1 = hf_convert.shard_tensor(spec, "decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
        assert torch.equal(rank1[: gate.shape[0] // 2], gate[gate.shape[0] // 2:])
    with pytest.raises(hf_convert.ConversionError, match="must divide.*vocab_size=37"):
        hf_convert.check_tp(spec, 2)  # no vocab padding: the vocabulary must split evenly
