"""The CPU engine serves every model family as transformers computes it, and reports each token's routed
experts as transformers' routers chose them.

Per family a tiny random model is built with transformers' own config and model classes (no download),
saved with `save_pretrained` and loaded by the engine from disk: qwen3 (q/k norms, a head_dim apart from
hidden / heads), llama with Llama 3.1's `llama3` RoPE scaling (all three frequency bands hit),
qwen3_moe (softmax top-k, norm_topk_prob, a dense layer among MoE ones), glm4_moe (the first layer
dense, shared experts, a non-zero expert-score correction bias, routed_scaling_factor != 1, grouped
top-k, partial rotary, q/k/v biases, q/k norms). Checked in float32, against transformers' forward
over the same tokens: the engine's prefill logits and each decode step's logits (max relative
difference 1e-5), the log-probs of the tokens it generated, and, for the MoE families, the routed
experts the batching engine returns (SGLang's range: every position but the last) against the top-k
of transformers' router modules (hooked). A snapshot whose tensor has another shape than config.json
implies is refused naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.engines.batching import BatchEngine, Request, SamplingParams
from miles_core.engines.model import CausalLM, ModelLoadError, read_spec

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)
RTOL = 1e-5
COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.2, tie_word_embeddings=False)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=48, num_hidden_layers=2, head_dim=16)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        intermediate_size=48, num_hidden_layers=2,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 500000.0})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, head_dim=16, n_routed_experts=8,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True)),
}
PROMPTS = [[3, 17, 42, 5, 88, 9, 61], [11, 70, 2]]  # two lengths: right padding and two slots
NEW_TOKENS = 6


def _hf_model(name: str):
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**COMMON, **extra)
    model = getattr(transformers, model_class)(cfg).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):  # zero at init: a bias that changes the choice
                module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the transformers model, the directory it saved)."""
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path))
    return request.param, model, str(path)


def _routers(model) -> list:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def _hf_forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' logits [T, vocab] over `ids` and its routers' top-k [T, MoE layers, k] (sorted ids)."""
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for r in _routers(model)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    routes = torch.stack(chosen, dim=1).sort(dim=-1).values if chosen else None
    return logits, routes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_spec_reads_the_family(family):
    name, model, path = family
    spec = read_spec(path)
    assert spec.family == model.config.model_type
    if name == "glm4_moe":
        assert (spec.moe_layers, spec.rotary_dim, spec.router_groups, spec.routed_scaling_factor) == ((1, 2), 8, 4, 2.5)
    if name == "qwen3_moe":
        assert spec.moe_layers == (0, 2) and spec.head_dim == 16
    if name == "llama3":
        assert spec.rope_type == "llama3"


def test_prefill_and_decode_logits_equal_transformers(family):
    """Greedy generation from two prompts batched together: the prefill logits, every decode step's
    logits and the generated tokens' log-probs equal transformers' teacher-forced forward pass."""
    name, model, path = family
    lm = CausalLM.load(path)
    cache = lm.new_cache(2, 32)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    tokens = torch.tensor([p + [0] * (int(lengths.max()) - len(p)) for p in PROMPTS])
    logits = lm.prefill(cache, 0, tokens, lengths)
    seqs = [list(p) for p in PROMPTS]
    steps = [logits]
    for _ in range(NEW_TOKENS):
        nxt = steps[-1].argmax(-1)
        positions = torch.tensor([len(s) for s in seqs])
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
        steps.append(lm.decode(cache, nxt, positions))
    worst = 0.0
    for row, seq in enumerate(seqs):
        ref, _ = _hf_forward(model, seq)
        got = torch.stack([s[row] for s in steps])  # logits after the prompt and after each new token
        want = ref[len(PROMPTS[row]) - 1:]
        worst = max(worst, _rel(got, want))
        new = torch.tensor(seq[len(PROMPTS[row]):])
        lp_got = torch.log_softmax(got[:-1], -1).gather(1, new[:, None])
        lp_want = torch.log_softmax(want[:-1], -1).gather(1, new[:, None])
        torch.testing.assert_close(lp_got, lp_want, rtol=RTOL, atol=RTOL)
    print(f"{name}: CPU engine vs transformers, max relative logit difference {worst:.1e}")
    assert worst < RTOL, f"{name}: max relative logit difference {worst:.2e}"


def test_routed_experts_equal_transformers_router_top_k(family):
    """The batching engine's routed experts of a finished request: every position it ran (prompt and
    output but the last token), each MoE layer's top-k, equal to transformers' routers' choice; a
    routed_experts_start_len drops the first positions."""
    name, model, path = family
    lm = CausalLM.load(path)
    if not lm.spec.moe:
        with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
            BatchEngine(lm, capture_routes=True)
        return
    engine = BatchEngine(lm, capture_routes=True)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add(Request("a", PROMPTS[0], params, return_routed_experts=True))
    engine.add(Request("b", PROMPTS[1], params, return_routed_experts=True, routed_experts_start_len=2))
    engine.add(Request("quiet", PROMPTS[1], params))
    out: dict[str, list[int]] = {r: [] for r in ("a", "b", "quiet")}
    finished = {}
    while engine.num_requests:
        for ev in engine.step():
            if ev.token is not None:
                out[ev.rid].append(ev.token)
            if ev.finish is not None:
                finished[ev.rid] = ev
    assert finished["quiet"].routed_experts is None
    spec = lm.spec
    for rid, prompt, start in (("a", PROMPTS[0], 0), ("b", PROMPTS[1], 2)):
        seq = prompt + out[rid]
        _, want = _hf_forward(model, seq)
        got = finished[rid].routed_experts
        assert got.dtype == torch.int32 and got.shape == (len(seq) - 1 - start, len(spec.moe_layers), spec.moe_topk)
        assert torch.equal(got.sort(dim=-1).values.long(), want[start:len(seq) - 1])


def test_a_routed_experts_start_beyond_the_prompt_aborts_as_sglang_does(family):
    name, _, path = family
    engine = BatchEngine(CausalLM.load(path))
    (ev,) = engine.add(Request("x", [1, 2], SamplingParams(), return_routed_experts=True, routed_experts_start_len=3))
    assert ev.finish["type"] == "abort" and "is higher than the number of input tokens" in ev.finish["message"]


def test_a_tensor_of_the_wrong_shape_is_named(family, tmp_path):
    """One tensor per family that only the new layouts have, resized: the load names it."""
    from safetensors.torch import load_file, save_file

    name, model, path = family
    bad = {"qwen3": "model.layers.1.self_attn.q_norm.weight", "llama3": "model.layers.0.mlp.down_proj.weight",
           "qwen3_moe": "model.layers.2.mlp.experts.5.up_proj.weight",
           "glm4_moe": "model.layers.1.mlp.gate.e_score_correction_bias"}[name]
    tensors = load_file(f"{path}/model.safetensors")
    tensors[bad] = torch.zeros(tensors[bad].shape[0] + 1, *tensors[bad].shape[1:])
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").write_text(open(f"{path}/config.json").read())
    save_file(tensors, str(snap / "model.safetensors"))
    stripped = bad.removeprefix("model.")
    with pytest.raises(ModelLoadError, match=f"tensor '{stripped}' has shape"):
        CausalLM.load(str(snap))


def test_weights_received_into_the_fused_layout_are_served_without_copies(family):
    """A weight update receives into `fused_layout` buffers: q/k/v and every MLP's gate/up (dense, each
    routed expert, the shared experts) lie there as the forward concatenates them, so the model built
    from them views the buffers (no copy) and computes the same logits."""
    from miles_core.engines.model import fused_layout, read_safetensors

    name, _, path = family
    tensors = read_safetensors(path)
    received = {k: t.copy_(tensors[k]) for k, t in fused_layout(tensors).items()}
    lm, ref = CausalLM(read_spec(path), received, path), CausalLM.load(path)
    for w in lm.layers:
        shared = [w["shared"]] if "shared" in w else []
        mlps = [(w["gate_up_w"], None)] if "gate_up_w" in w else [*w["experts"], *shared]
        fused = [w["qkv_w"], *(gate_up for gate_up, _ in mlps)]
        assert all(any(t.untyped_storage().data_ptr() == r.untyped_storage().data_ptr() for r in received.values())
                   for t in fused)
    tokens = torch.tensor([PROMPTS[0]])
    length = torch.tensor([len(PROMPTS[0])])
    torch.testing.assert_close(lm.prefill(lm.new_cache(1, 16), 0, tokens, length),  # kernels see other strides
                               ref.prefill(ref.new_cache(1, 16), 0, tokens, length), rtol=1e-6, atol=1e-6)
