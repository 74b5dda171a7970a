"""Routing replay under --sequence-parallel: each TP rank's routers replay their slice of the padded
sequence. The real Trainer at TP=2 with --sequence-parallel on two processes (gloo, under
the strict device harness) against TP=1, on a tiny Qwen3-MoE, samples carrying random engine routes,
micro-batches of odd and even length (so the padding to a multiple of TP runs); lr 0.

Pins: with --use-rollout-routing-replay, train/routing_mismatch is 0 on both ranks and the loss and
train/routing_mismatch_own equal TP=1's (the counts summed over the TP ranks' slices); without it,
the mismatch equals TP=1's. Guards: a slice taken from the unpadded sequence or the wrong rank's
(routes shifted against their tokens: the loss differs from TP=1's), counts not summed over TP.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import exit_launcher, fork_ranks, run_launcher
from tests.support import strict_device as strict

TP_RANKS_SECONDS = 240  # the tensor-parallel ranks, forked, to their end

TP, EXPERTS, TOPK, LAYERS = 2, 8, 2, 2


def _samples():
    from miles_core.samples import Group, Sample, SampleStatus

    gen = torch.Generator().manual_seed(3)
    out = []
    for i, (p, r) in enumerate([(4, 3), (3, 2), (5, 4), (4, 4)]):  # lengths 7, 5, 9, 8
        prompt, resp = [(3 * i + j) % 30 + 1 for j in range(p)], [(5 * i + j) % 30 + 1 for j in range(r)]
        s = Sample("g", 0, i, prompt, resp, [-2.0] * r, [1] * r, [1] * r, reward=float(i % 3),
                   status=SampleStatus.COMPLETED)
        routes = [torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range((p + r - 1) * LAYERS)]
        s.routed_experts = torch.stack(routes).flatten().tolist()
        out.append(s)
    return [Group("g", 0, out)]


def _write_model(tmp: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=40, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                         num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
                         max_position_embeddings=64, tie_word_embeddings=False, router_aux_loss_coef=0.0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3) if "norm" not in name else p.add_(0.1 * torch.randn_like(p))
    path = os.path.join(tmp, "moe")
    model.save_pretrained(path)
    return path


def _run(hf_dir: str, tp: int, replay: bool) -> dict:
    from miles_core.config.sections import TrainSection
    from miles_core.train.trainer import Trainer

    cfg = dataclasses.replace(TrainSection(), lr=0.0, clip_grad=1e9, micro_batch_size=2, tensor_model_parallel_size=tp,
                              sequence_parallel=tp > 1, use_rollout_routing_replay=replay)
    with Trainer(cfg, hf_dir) as tr:
        return tr.train_step(0, _samples())


def _worker(rank: int, hf_dir: str, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=TP)
    out = {replay: _run(hf_dir, TP, replay) for replay in (True, False)}
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp: str) -> None:
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    import miles_core.train.trainer  # noqa: F401

    hf_dir = _write_model(tmp)
    os.environ.update(strict.ENV)
    fork_ranks(_worker, [(r, hf_dir, tmp) for r in range(TP)], timeout=TP_RANKS_SECONDS)
    torch.save({replay: _run(hf_dir, 1, replay) for replay in (True, False)}, os.path.join(tmp, "tp1.pt"))
    exit_launcher(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("r3sp")
    run_launcher(_launch, str(tmp), 300, "the TP=2 trainer processes")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(TP)], torch.load(tmp / "tp1.pt")


def test_sequence_parallel_replays_each_ranks_slice(results):
    ranks, tp1 = results
    assert tp1[True]["train/routing_mismatch"] == 0.0 and tp1[False]["train/routing_mismatch"] > 0.5
    for got in ranks:
        for replay in (True, False):
            for key in ("train/routing_mismatch", "train/routing_mismatch_own", "train/loss",
                        "train/train_rollout_logprob_abs_diff"):
                assert got[replay][key] == pytest.approx(tp1[replay][key], rel=1e-5, abs=1e-7), (replay, key)
    assert tp1[True]["train/train_rollout_logprob_abs_diff"] != pytest.approx(
        tp1[False]["train/train_rollout_logprob_abs_diff"], rel=1e-5)
