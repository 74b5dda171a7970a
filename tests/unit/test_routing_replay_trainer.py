"""The trainer's side of --use-rollout-routing-replay: it replays the routes samples carry.

Pins: a Trainer on a tiny Qwen3-MoE (transformers' own classes, saved with save_pretrained) given
samples whose routes differ from its own routing reports train/routing_mismatch 0 with the flag and
> 0 without, in right-padded and packed micro-batches and through the KL reference's forward too
(lr 0: the reference is the policy, so its KL is 0 only if it replays the same routes);
train/routing_mismatch_own is the same with and without (the router's own choice is measured, not
changed); replay changes the loss's inputs; samples without routes report no routing metric.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.train.trainer import Trainer

torch.set_num_threads(1)
VOCAB, EXPERTS, TOPK, LAYERS = 40, 8, 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                         max_position_embeddings=64, tie_word_embeddings=False, router_aux_loss_coef=0.0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3) if "norm" not in name else p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("qwen3moe"))
    model.save_pretrained(path)
    return path


def _samples() -> list[Sample]:
    """Three samples with engine routes drawn at random (k distinct experts per position and layer):
    far from what the trainer's router would choose."""
    gen = torch.Generator().manual_seed(3)
    prompts, responses = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], [[13, 14, 15], [16, 17], [18, 19, 20, 21]]
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        positions = len(p) + len(r) - 1  # the engine reports every position but the last
        routes = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(positions * LAYERS)])
        s = Sample("g", 0, i, p, r, [-1.0] * len(r), [1] * len(r), [1] * len(r), reward=float(i),
                   status=SampleStatus.COMPLETED)
        s.routed_experts = routes.flatten().tolist()
        out.append(s)
    return out


@pytest.mark.parametrize("layout", [dict(micro_batch_size=2),
                                    dict(use_dynamic_batch_size=True, max_tokens_per_gpu=64),
                                    dict(micro_batch_size=3, use_kl_loss=True)], ids=["padded", "packed", "kl-ref"])
def test_replay_brings_the_trainers_routing_mismatch_to_zero(moe_dir, layout):
    metrics = {}
    for replay in (True, False):
        cfg = dataclasses.replace(TrainSection(), lr=0.0, use_rollout_routing_replay=replay, **layout)
        with Trainer(cfg, moe_dir) as tr:
            metrics[replay] = tr.train_step(0, [Group("g", 0, _samples())])
    assert metrics[True]["train/routing_mismatch"] == 0.0
    assert metrics[False]["train/routing_mismatch"] > 0.5  # random routes: most pairs differ
    assert metrics[False]["train/routing_mismatch"] == metrics[False]["train/routing_mismatch_own"]
    assert metrics[True]["train/routing_mismatch_own"] == pytest.approx(metrics[False]["train/routing_mismatch_own"])
    assert "routing/compared" not in metrics[True]  # the raw counts are not logged
    if layout.get("use_kl_loss"):  # lr 0: the reference is the policy, so it replays the same routes too
        assert metrics[True]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)


def test_replay_changes_the_loss_and_no_routes_no_metric(moe_dir):
    """Replay changes what the trainer computes (routes steer the experts); samples without routes
    report no routing metric."""
    out = {}
    for replay in (True, False):
        cfg = dataclasses.replace(TrainSection(), lr=0.0, micro_batch_size=3, use_rollout_routing_replay=replay)
        with Trainer(cfg, moe_dir) as tr:
            out[replay] = tr.train_step(0, [Group("g", 0, _samples())])
            plain = [dataclasses.replace(s, routed_experts=[]) for s in _samples()]
            assert "train/routing_mismatch" not in tr.train_step(1, [Group("g", 0, plain)])
    assert out[True]["train/train_rollout_logprob_abs_diff"] != pytest.approx(
        out[False]["train/train_rollout_logprob_abs_diff"], rel=1e-6)
