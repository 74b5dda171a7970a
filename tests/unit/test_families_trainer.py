"""The Megatron trainer builds and trains every family the adapters read: qwen3 (q/k norms, a
head_dim of its own, tied embeddings), llama with llama3 RoPE scaling, qwen3_moe (softmax router,
norm_topk_prob on and off, load-balancing aux loss) and glm4_moe (partial rotary, q/k/v biases,
q/k norms, first layer dense, shared experts, sigmoid router with a non-zero expert-score
correction bias, routed_scaling_factor 2.5, with and without grouped top-k).

Each tiny model is built with transformers' own config and model classes (no download), its
norms, biases and expert bias randomised and its matrices scaled up so every mapping and the
routing matter, and saved with `save_pretrained` (transformers 5.19 writes the routed experts one
by one). Pins, per family: the per-token log-probs of the model the trainer builds and loads
(`build_model` + the trainer's shard reader, `masked_token_logprobs`) equal transformers' (fp32,
relative 1e-5); HF -> Megatron -> HF is bit-exact, also through the built model's tensors and
through TP=2 shards; the trainer's export loads in transformers with bit-identical logits and a
config.json equal to the original's. MoE: the aux loss the trainer reports and the gradient it
adds equal transformers' `load_balancing_loss_func` (one MoE layer: the model's own aux_loss; two:
the per-layer mean); a zeroed expert bias or a wrong pre-softmax choice is far outside the bar.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.train import hf_convert, hf_shards
from miles_core.train.megatron_model import (ModelSpec, UnsupportedModel, build_model, masked_token_logprobs,
                                             moe_aux_loss_value, rope_inv_freq, routers, scale_moe_aux_loss,
                                             transformer_config)
from miles_core.train.trainer import Trainer

torch.set_num_threads(1)
VOCAB = 40
RTOL = 1e-5
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
MOE = dict(intermediate_size=48, moe_intermediate_size=16, num_experts_per_tok=2, head_dim=16)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = ("qwen3", "llama3", "qwen3_moe", "qwen3_moe_unnormalized", "glm4_moe", "glm4_moe_grouped")
MOE_CASES = tuple(c for c in CASES if "moe" in c)


def hf_config(case: str):
    from transformers import Glm4MoeConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if case == "qwen3":  # head_dim 16 x 4 heads over a hidden size of 32; tied like the small Qwen3s
        return Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, intermediate_size=48, head_dim=16)
    if case == "llama3":  # original context 16: the 4 frequencies fall in all three llama3 bands
        return LlamaConfig(**COMMON, intermediate_size=48, rope_parameters=LLAMA3)
    if case == "qwen3_moe":  # layer 0 dense, layer 1 MoE: one MoE layer
        return Qwen3MoeConfig(**COMMON, **MOE, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0],
                              router_aux_loss_coef=0.02)
    if case == "qwen3_moe_unnormalized":  # both layers MoE, the top-k weights not renormalised
        return Qwen3MoeConfig(**COMMON, **MOE, num_experts=8, norm_topk_prob=False, router_aux_loss_coef=0.02)
    grouped = case == "glm4_moe_grouped"
    return Glm4MoeConfig(**COMMON, **{**MOE, "num_experts_per_tok": 2 if grouped else 3}, n_routed_experts=8,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=2 if grouped else 1, topk_group=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5,
                         use_qk_norm=True, attention_bias=True)


def hf_model(case: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(CASES.index(case))
    model = AutoModelForCausalLM.from_config(hf_config(case)).eval()
    with torch.no_grad():  # HF inits norms to 1, biases to 0, matrices at std 0.02: make every one count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for case in CASES:
        path = str(tmp_path_factory.mktemp(case))
        hf_model(case).save_pretrained(path)
        out[case] = path
    return out


def load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def spec_of(path: str) -> ModelSpec:
    return ModelSpec.from_hf_config(hf_convert.read_hf_config(path))


def megatron(path: str, **kw):
    spec = spec_of(path)
    model = build_model(spec, **kw)
    hf_shards.load_hf_checkpoint([model], spec, path)  # the trainer's reader
    return spec, model


def ids(seed: int = 1, shape=(3, 12)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def hf_token_logprobs(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp = hf(input_ids=tokens).logits.float().log_softmax(-1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def our_token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return masked_token_logprobs(model.eval(), tokens, torch.ones(tokens.shape[0], tokens.shape[1] - 1))[0]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs()).max())


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("case", CASES)
def test_logprobs_match_transformers(checkpoints, case):
    """The trainer's model gives transformers' per-token log-probs (fp32, relative 1e-5)."""
    hf, (spec, model) = load(checkpoints[case]), megatron(checkpoints[case])
    tokens = ids()
    ours, ref = our_token_logprobs(model, tokens), hf_token_logprobs(hf, tokens)
    print(f"{case}: trainer vs transformers, max relative log-prob difference {max_rel(ours, ref):.1e}")
    assert max_rel(ours, ref) < RTOL, max_rel(ours, ref)


def test_what_each_family_builds(checkpoints):
    """The built models carry what the spec says: q/k norms over head_dim, partial rotary, the MoE
    layers where the checkpoint has them (a dense first layer), shared experts, the expert bias as
    a fp32 buffer equal to the checkpoint's, llama3 frequencies equal to transformers' own."""
    spec, model = megatron(checkpoints["glm4_moe"])
    attn = model.decoder.layers[0].self_attention
    assert attn.q_layernorm.weight.shape == (16,) and model.rotary_pos_emb.inv_freq.numel() == 4  # 16 * 0.5 / 2
    assert not hasattr(model.decoder.layers[0].mlp, "router") and model.decoder.layers[1].mlp.shared_experts
    (router,) = routers(model)
    hf = load(checkpoints["glm4_moe"])
    assert router.expert_bias.dtype == torch.float32
    assert torch.equal(router.expert_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    llama = load(checkpoints["llama3"])
    inv = rope_inv_freq(spec_of(checkpoints["llama3"]))
    assert torch.equal(inv, llama.model.rotary_emb.inv_freq)
    plain = 1.0 / (5000.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert (inv != plain).sum() == 4  # every frequency rescaled (one smoothed, three divided)


def test_expert_bias_and_pre_softmax_are_what_matches(checkpoints):
    """Guards: a router without GLM's expert bias, or qwen3_moe's pre-softmax choice flipped (the top-k
    weights renormalised or not), is far outside the log-prob bar."""
    tokens = ids(2)
    spec, model = megatron(checkpoints["glm4_moe"])
    ref = hf_token_logprobs(load(checkpoints["glm4_moe"]), tokens)
    with torch.no_grad():
        routers(model)[0].expert_bias.zero_()
    assert max_rel(our_token_logprobs(model, tokens), ref) > 100 * RTOL
    for case in ("qwen3_moe", "qwen3_moe_unnormalized"):
        spec, model = megatron(checkpoints[case])
        ref = hf_token_logprobs(load(checkpoints[case]), tokens)
        for router in routers(model):
            router.config = dataclasses.replace(router.config, moe_router_pre_softmax=not router.config.moe_router_pre_softmax)
        assert max_rel(our_token_logprobs(model, tokens), ref) > 100 * RTOL, case


def test_unsupported_router_options_are_refused_by_name():
    """A sigmoid router whose top-k is not renormalised, top-1 renormalised softmax, and TP without
    sequence parallelism for a MoE model: refused naming the option (Megatron cannot compute them)."""
    glm = ModelSpec.from_hf_config({**hf_config("glm4_moe").to_dict(), "norm_topk_prob": False})
    with pytest.raises(UnsupportedModel, match="norm_topk_prob=false with a sigmoid router is not supported"):
        transformer_config(glm)
    top1 = ModelSpec.from_hf_config({**hf_config("qwen3_moe").to_dict(), "num_experts_per_tok": 1})
    with pytest.raises(UnsupportedModel, match="num_experts_per_tok=1 with norm_topk_prob=true is not supported"):
        transformer_config(top1)
    moe = ModelSpec.from_hf_config(hf_config("qwen3_moe").to_dict())
    with pytest.raises(UnsupportedModel, match="needs --sequence-parallel"):
        transformer_config(moe, tensor_model_parallel_size=2)


# ---------------------------------------------------------------------------- conversion and export


@pytest.mark.parametrize("case", CASES)
def test_round_trip_is_bit_exact_and_tp2_shards_reassemble(checkpoints, case):
    """HF -> Megatron -> HF returns the saved tensors bit for bit under their names, directly and
    from the built model's own tensors; TP=2 shards of every Megatron tensor reassemble exactly."""
    path = checkpoints[case]
    state = hf_convert.load_hf_state(path)
    spec = spec_of(path)
    full = hf_convert.hf_to_megatron(spec, state)
    back = hf_convert.megatron_to_hf(spec, full)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    _, model = megatron(path)
    live = hf_convert.megatron_to_hf(spec, hf_convert.megatron_state(model))
    assert set(live) == set(state) and all(torch.equal(live[k], v) for k, v in state.items())
    hf_convert.check_tp(spec, 2)
    for name, t in full.items():
        parts = [hf_convert.shard_tensor(spec, name, t, r, 2) for r in range(2)]
        assert torch.equal(hf_convert.unshard_tensor(spec, name, parts), t), name


@pytest.mark.parametrize("case", CASES)
def test_trainer_export_loads_in_transformers(checkpoints, case, tmp_path):
    """The trainer's export (what a snapshot holds) loads in transformers with bit-identical logits,
    and its config.json equals the original's."""
    path = checkpoints[case]
    with Trainer(TrainSection(), path) as tr:
        out = tr.export_hf(str(tmp_path / "export"))
    with open(os.path.join(path, "config.json")) as a, open(os.path.join(out, "config.json")) as b:
        assert json.load(a) == json.load(b)
    tokens = ids(3)
    with torch.no_grad():
        assert torch.equal(load(out)(input_ids=tokens).logits, load(path)(input_ids=tokens).logits)


# ---------------------------------------------------------------------------- MoE aux loss


def hf_layer_aux_losses(hf, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' aux_loss of the model, its load_balancing_loss_func per MoE layer) on `tokens`."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    out = hf(input_ids=tokens, output_router_logits=True)
    cfg = hf.config
    per_layer = torch.stack([load_balancing_loss_func((logits,), cfg.num_experts, cfg.num_experts_per_tok)
                             for logits in out.router_logits])
    return out.aux_loss, per_layer


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_unnormalized"])
def test_aux_loss_and_its_gradient_equal_transformers(checkpoints, case):
    """The aux loss of a training forward equals transformers' (one MoE layer: the model's aux_loss;
    two: the mean of load_balancing_loss_func over the layers), and the gradient it adds to each
    router, at the weight `scale_moe_aux_loss` gives it, is router_aux_loss_coef x that weight x
    the gradient of transformers' per-layer mean.
    Guards: Megatron's own value (divided by top-k), a coefficient summed over layers, the per-token
    scaling Megatron applies for its own gradient division (x the micro-batch's tokens)."""
    path = checkpoints[case]
    hf = load(path).train()
    spec, model = megatron(path)
    model.train()
    tokens = ids(4, (2, 10))
    moe_aux_loss_value(model)  # reset whatever an earlier forward left
    logp, _ = masked_token_logprobs(model, tokens, torch.ones(2, 9))
    value = moe_aux_loss_value(model)
    scale_moe_aux_loss(0.25)
    (logp * 0).sum().backward()  # only the aux loss has a gradient
    scale_moe_aux_loss(1.0)
    aux, per_layer = hf_layer_aux_losses(hf, tokens)
    if len(spec.moe_layers) == 1:
        assert value == pytest.approx(float(aux), rel=RTOL)
    assert value == pytest.approx(float(per_layer.mean()), rel=RTOL)
    (0.25 * spec.aux_loss_coef * per_layer.mean()).backward()
    hf_routers = [layer.mlp.gate.weight for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    for ours, ref in zip(routers(model), hf_routers, strict=True):
        torch.testing.assert_close(ours.weight.grad, ref.grad, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("recompute", [{}, dict(recompute_granularity="full", recompute_method="uniform",
                                                recompute_num_layers=1)], ids=["plain", "full-recompute"])
def test_trainer_reports_the_aux_loss(checkpoints, recompute):
    """A train step of qwen3_moe reports train/moe_aux_loss: transformers' aux loss of each
    micro-batch (one sample each), weighted by its loss tokens, also under full recompute (where
    the routers run again in the backward, their first forward without gradients); a dense model
    reports none."""
    path = checkpoints["qwen3_moe"]
    prompts, responses = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], [[13, 14, 15], [16, 17], [18, 19, 20, 21]]
    samples = [Sample("g", 0, i, p, r, [-1.0] * len(r), [1] * len(r), [1] * len(r), reward=float(i),
                      status=SampleStatus.COMPLETED) for i, (p, r) in enumerate(zip(prompts, responses))]
    cfg = dataclasses.replace(TrainSection(), micro_batch_size=1, lr=0.0, **recompute)
    with Trainer(cfg, path) as tr:
        metrics = tr.train_step(0, [Group("g", 0, samples)])
    hf = load(path).train()
    weights = torch.tensor([len(r) for r in responses], dtype=torch.float64)
    values = torch.tensor([float(hf(input_ids=torch.tensor([p + r]), output_router_logits=True).aux_loss)
                           for p, r in zip(prompts, responses)], dtype=torch.float64)
    assert metrics["train/moe_aux_loss"] == pytest.approx(float((values * weights).sum() / weights.sum()), rel=RTOL)
    with Trainer(cfg, checkpoints["qwen3"]) as tr:
        assert "train/moe_aux_loss" not in tr.train_step(0, [Group("g", 0, samples)])


def test_a_deeper_moe_model_after_a_shallower_one_trains(tmp_path):
    """Megatron's aux-loss tracker is process-global and sized by the layers of the first model that
    logged into it: a 4-layer MoE model trained after a 2-layer one indexed past its end (IndexError in
    the full suite's order). Each model built starts it anew."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    samples = [Sample("g", 0, i, [1, 2, 3, 4], [5, 6, 7], [-1.0] * 3, [1] * 3, [1] * 3, reward=float(i),
                      status=SampleStatus.COMPLETED) for i in range(2)]
    cfg = dataclasses.replace(TrainSection(), micro_batch_size=1, lr=0.0)
    for layers in (2, 4):
        path = str(tmp_path / f"l{layers}")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": layers}, **MOE,
                                                        num_experts=8, norm_topk_prob=True)).save_pretrained(path)
        with Trainer(cfg, path) as tr:
            assert tr.train_step(0, [Group("g", 0, samples)])["train/moe_aux_loss"] > 0
