"""The Megatron trainer learns the embedded default task (docs/quickstart.md), without engines or Ray.

Pins that model building, conversion, the default loss (PPO-clip against rollout log-probs) and
the optimizer together learn: reverse4 on builtin:tiny-gpt, 32 prompts x 8 samples per step,
sampling from the trainer's own model at T=1 with one-step-stale weights (the rollout of step k
uses the weights before step k-1's update, as the fully async pipeline would), reward rises from
the random-policy level (~0.07) well above it. Slow (1-2 minutes on one core).
"""

from __future__ import annotations

import random

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.models.builtin import EOS_ID, materialize_checkpoint
from miles_core.rollout.builtin_tasks import builtin_rows, digits_reward
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.train.megatron_model import forward_logits
from miles_core.train.trainer import Trainer

torch.set_num_threads(1)
# 50 steps reach ~0.48 (last 7) from ~0.09 (first 5); 70 reached ~0.57. The bar below is the one the
# test always had: the seeds fix the curve, so fewer steps cost margin, not flakiness.
STEPS = 50


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new: int, gen: torch.Generator):
    model.eval()
    tokens = torch.tensor(prompts)
    out = torch.zeros(len(prompts), 0, dtype=torch.long)
    logps = torch.zeros(len(prompts), 0)
    for _ in range(max_new):
        logp = torch.log_softmax(forward_logits(model, torch.cat([tokens, out], 1))[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        out = torch.cat([out, nxt], 1)
        logps = torch.cat([logps, logp.gather(-1, nxt)], 1)
    results = []
    for row, lp in zip(out.tolist(), logps.tolist()):
        n = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
        results.append((row[:n], lp[:n]))
    return results


@pytest.mark.slow
def test_reverse4_reward_rises(tmp_path):
    hf = materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path / "m"))
    rows = builtin_rows("builtin:reverse4")
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    rewards = []
    with Trainer(TrainSection(lr=2e-3), hf) as tr:
        stale = None
        for step in range(STEPS):
            batch = rng.sample(rows, 32)
            prompts = [r["prompt"] for r in batch for _ in range(8)]
            # one-step-stale rollouts: generate with a copy of the weights from before the last update
            gen_model = tr.model if stale is None else stale
            outs = sample(gen_model, prompts, 5, gen)
            stale_state = {k: v.clone() for k, v in tr.model.state_dict().items() if not k.endswith("_extra_state")}
            groups = []
            for g, r in enumerate(batch):
                ss = []
                for i in range(8):
                    resp, lp = outs[g * 8 + i]
                    ss.append(Sample(f"g{step}-{g}", g, i, r["prompt"], resp, lp, [1] * len(resp), [step] * len(resp),
                                     reward=digits_reward(resp, r["label"]), status=SampleStatus.COMPLETED))
                groups.append(Group(f"g{step}-{g}", g, ss))
            rewards.append(sum(s.reward for g in groups for s in g.samples) / 256)
            tr.train_step(step, groups)
            if stale is None:
                from miles_core.train.megatron_model import build_model

                stale = build_model(tr.spec)
            stale.load_state_dict(stale_state, strict=False)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-7:]) / 7
    print(f"reward first 5 steps {first:.3f}, last 7 steps {last:.3f}")
    assert last > 0.4 and last > 3 * first
