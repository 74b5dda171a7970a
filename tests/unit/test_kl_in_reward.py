"""miles' KL in the reward (`--kl-coef`, reinforce_plus_plus estimators; docs/algorithms.md): by hand,
and on the real Trainer (builtin:tiny-gpt, Megatron-core on CPU) against the same arithmetic done here
on log-probs this test computes itself.

Pins: reinforce_plus_plus's token rewards are -kl_coef x kl_t plus the reward on the last loss token,
returned backwards with gamma; reinforce_plus_plus_baseline subtracts kl_coef x kl_t from the
group-centred reward; the whitening comes after the KL; the split of the rollout leaves the whitening
to the trainer; the KL is 0 while the policy is the reference, and `train/kl_in_reward` is logged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.metrics import names as N
from miles_core.models.builtin import EOS_ID, SEP_ID, materialize_checkpoint
from miles_core.rank_batches import (AdvantageSettings, DataLayout, kl_reward_advantages, split_rollout, trainable_samples,
                                    whiten)
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.train.losses import approx_kl
from miles_core.train.megatron_model import masked_token_logprobs
from miles_core.train.trainer import Trainer

torch.set_num_threads(1)


def _sample(reward: float, mask: list[int], index: int = 0) -> Sample:
    n = len(mask)
    return Sample("g", 0, index, [1, 2, 3, 4, SEP_ID], [5, 6, 7, 8, EOS_ID][:n], [-1.0] * n, mask, [1] * n,
                  reward=reward, status=SampleStatus.COMPLETED)


def test_kl_in_the_reward_by_hand():
    """One sample, reward 1, mask [1, 1, 0], token KLs 0.2, 0.1, 0 and kl_coef 0.5:
    reinforce_plus_plus, gamma 1: token rewards -0.1, -0.05 + 1 (the last loss token), 0 -> returns
    [-0.1 + 0.95, 0.95, 0] = [0.85, 0.95, 0]; gamma 0.5: [-0.1 + 0.5 x 0.95, 0.95, 0] = [0.375, 0.95, 0].
    reinforce_plus_plus_baseline with the group-centred reward 0.5: [0.5 - 0.1, 0.5 - 0.05, 0.5 - 0]."""
    s = _sample(1.0, [1, 1, 0])
    kls = [[0.2, 0.1, 0.0]]
    rpp = AdvantageSettings("reinforce_plus_plus", whiten=True, kl_coef=0.5)
    assert kl_reward_advantages([(s, 1.0)], kls, rpp)[0][1] == pytest.approx([0.85, 0.95, 0.0])
    rpp_half = dataclasses.replace(rpp, gamma=0.5)
    assert kl_reward_advantages([(s, 1.0)], kls, rpp_half)[0][1] == pytest.approx([0.375, 0.95, 0.0])
    base = AdvantageSettings("reinforce_plus_plus_baseline", whiten=True, kl_coef=0.5)
    assert kl_reward_advantages([(s, 0.5)], kls, base)[0][1] == pytest.approx([0.4, 0.45, 0.5])


def test_the_split_leaves_the_whitening_to_the_trainer():
    """With --kl-coef the rollout's split gives the raw rewards (whitened only after the KL); without,
    they come whitened: loss-token values 1, 1, 0, 0, mean 0.5, unbiased std sqrt(1/3) -> +-0.866."""
    g = Group("g", 0, [_sample(1.0, [1, 1], 0), _sample(0.0, [1, 1], 1)])
    settings = AdvantageSettings("reinforce_plus_plus", whiten=True, kl_coef=0.1)
    (part,) = split_rollout([g], DataLayout(1, 1), optimizer_steps=1, balance=False, advantages=settings)
    assert [a for _, a in part.steps[0].items] == [1.0, 0.0]
    assert [a for _, a in trainable_samples([g], settings=dataclasses.replace(settings, kl_coef=0.0))] == pytest.approx(
        [0.866025, -0.866025], abs=1e-5)


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("tiny-gpt")))


def _group() -> Group:
    masks = [[1, 1, 1], [1, 0, 1, 1], [1, 1], [1, 1, 0, 1, 1]]
    return Group("g", 0, [_sample(r, m, i) for i, (r, m) in enumerate(zip([1.0, 0.3, 0.0, 0.6], masks))])


def _part(tr: Trainer, group: Group):
    (part,) = split_rollout([group], DataLayout(1, 1), optimizer_steps=1, balance=False, advantages=tr.advantages)
    return part


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_the_trainer_puts_each_tokens_kl_in_the_reward(tiny_gpt, estimator):
    """The policy moved off the reference (one weight scaled): the trainer's advantages equal
    kl_reward_advantages on KLs computed here sample by sample (k3 between the trainer's and the
    reference's log-probs, 0 off the loss), whitened; `train/kl_in_reward` is their token mean."""
    cfg = TrainSection(advantage_estimator=estimator, normalize_advantages=True, kl_coef=0.3, kl_loss_type="k3",
                       use_rollout_logprobs=False, micro_batch_size=3)
    with Trainer(cfg, tiny_gpt) as tr:
        group = _group()
        start, kl_sum = tr._kl_in_reward(_part(tr, group))
        assert kl_sum == 0.0  # the policy is the reference
        with torch.no_grad():
            next(p for n, p in tr.model.named_parameters() if "linear_fc1.weight" in n).mul_(1.7)
        part, kl_sum = tr._kl_in_reward(_part(tr, group))
        expected_kls, total = [], 0.0
        for s, _ in part.steps[0].items:
            batch = {"tokens": torch.tensor([list(s.prompt_ids) + list(s.response_ids)])}
            p = len(s.prompt_ids)
            mask = torch.zeros(1, batch["tokens"].shape[1] - 1)
            mask[0, p - 1:] = torch.tensor(s.loss_mask, dtype=torch.float32)
            with torch.no_grad():
                logp, _ = masked_token_logprobs(tr.model, batch["tokens"], mask)
                ref, _ = masked_token_logprobs(tr.ref_model, batch["tokens"], mask)
            kl = (approx_kl(logp, ref, "k3") * mask)[0, p - 1:]
            expected_kls.append(kl.tolist())
            total += float(kl.sum())
        raw = [(s, a) for s, a in _part(tr, group).steps[0].items]
        expected = whiten(kl_reward_advantages(raw, expected_kls, tr.advantages))
        for (_, got), (_, want) in zip(part.steps[0].items, expected):
            assert got == pytest.approx(want, abs=1e-5)
        assert kl_sum == pytest.approx(total, rel=1e-5) and total > 1e-4
        metrics = tr.train_part(0, _part(tr, group))
        assert metrics[N.REWARD_KL] == pytest.approx(total / 12, rel=1e-4)  # 12 loss tokens
