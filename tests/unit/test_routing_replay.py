"""Rollout routing replay: the trainer routes each token as the engine did.

The engine is the project's CPU engine on a tiny random Qwen3-MoE and GLM-4.5-style model
(transformers' own classes, no download) whose router weights are rounded to bf16 and perturbed by 1%, as a GPU engine's bf16
kernels would: its routing then differs from the fp32 trainer's on some tokens. Pins: without replay the trainer's top-k differs
from the engine's on a measurable share of (token, layer) pairs; with replay it is 0 and the
trainer/engine log-prob gap is smaller; the routes go through the sample's flattened field;
malformed routes are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.engines.model import CausalLM
from miles_core.train import hf_convert, hf_shards
from miles_core.train.megatron_model import ModelSpec, build_model, masked_token_logprobs
from miles_core.train.routing_replay import RoutingReplayError, batch_routes, replaying, sample_routes

torch.set_num_threads(1)
VOCAB = 40


class _S:  # what batch_routes reads of a Sample
    def __init__(self, routed, n):
        self.routed_experts, self.group_id, self.sample_index, self.n = routed, "g", 0, n


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def moe_dir(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, Glm4MoeConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts_per_tok=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if request.param == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=True)
    else:  # both layers MoE, one shared expert, a sigmoid router with a correction bias
        cfg = Glm4MoeConfig(**common, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=0,
                            routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3) if "norm" not in name else p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return path


def _engine_routes_and_logprobs(path: str, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU engine with its router weights perturbed (rounded to bf16, then 1% noise: a GPU engine's
    bf16 kernels differ from the fp32 trainer by about that): its routes [b, s, layers, k] and log-probs."""
    lm = CausalLM.load(path)
    noise = torch.Generator().manual_seed(7)
    for w in lm.layers:
        if "router_w" in w:
            r = w["router_w"].to(torch.bfloat16).float()
            w["router_w"] = r * (1 + 0.01 * torch.randn(r.shape, generator=noise))
    b, s = tokens.shape
    # teacher-forced: one prefill of the whole sequence gives every position's routes and logits
    cache = lm.new_cache(b, s)
    lm.prefill(cache, 0, tokens, torch.full((b,), s))
    routes = lm.last_routes.long()
    full = _engine_all_logits(lm, tokens)
    logp = full.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return routes, logp


def _engine_all_logits(lm: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at every position: prefill of each prefix (the engine returns the last position's)."""
    b, s = tokens.shape
    out = []
    for t in range(1, s + 1):
        cache = lm.new_cache(b, t)
        out.append(lm.prefill(cache, 0, tokens[:, :t], torch.full((b,), t)))
    return torch.stack(out, dim=1)


def test_replay_brings_the_mismatch_to_zero_and_narrows_the_logprob_gap(moe_dir):
    spec = ModelSpec.from_hf_config(hf_convert.read_hf_config(moe_dir))
    model = build_model(spec)
    hf_shards.load_hf_checkpoint([model], spec, moe_dir)
    model.eval()
    tokens = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(3))
    routes, engine_logp = _engine_routes_and_logprobs(moe_dir, tokens)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    gaps, mismatch = {}, {}
    for replay in (False, True):
        with torch.no_grad(), replaying(model, routes, replay=replay) as seen:
            logp, _ = masked_token_logprobs(model, tokens, mask)
        differ, total = seen.mismatch()
        own, _ = seen.mismatch("own")
        mismatch[replay] = differ / total
        gaps[replay] = float((logp - engine_logp).abs().mean())
        assert total == tokens.numel() * len(spec.moe_layers)
        if not replay:  # without replay the routing used is the router's own choice
            assert own == differ
    assert mismatch[False] > 0.0, f"the bf16 router should route some tokens differently: {mismatch}, {gaps}"
    assert mismatch[True] == 0.0
    assert gaps[True] < gaps[False]
    print(f"{spec.family}: top-k mismatch {mismatch[False]:.3f} -> {mismatch[True]:.3f}; mean |logp gap| "
          f"{gaps[False]:.2e} -> {gaps[True]:.2e}")


def test_routes_travel_flattened_and_bad_ones_are_named(moe_dir):
    spec = ModelSpec.from_hf_config(hf_convert.read_hf_config(moe_dir))
    layers, k = len(spec.moe_layers), spec.moe_topk
    flat = list(range(k)) * layers * 5  # 5 positions reported for a 6-token sample: the last keeps its own
    got = sample_routes(flat, 6, spec, "s")
    assert got.shape == (6, layers, k) and (got[5] == -1).all() and got[:5].tolist() == [[[0, 1]] * layers] * 5
    both = batch_routes([_S(flat, 6), _S([], 4)], spec, [(0, 0, 6), (1, 0, 4)], (2, 6))
    assert both.shape == (2, 6, layers, k) and (both[1] == -1).all()
    assert batch_routes([_S([], 4)], spec, [(0, 0, 4)], (1, 4)) is None
    with pytest.raises(RoutingReplayError, match="not a whole number"):
        sample_routes(flat[:-1], 6, spec, "s")
    with pytest.raises(RoutingReplayError, match="outside 0..7"):
        sample_routes([9] * (layers * k), 6, spec, "s")
    with pytest.raises(RoutingReplayError, match="6 tokens"):
        sample_routes(flat + flat, 6, spec, "s")
