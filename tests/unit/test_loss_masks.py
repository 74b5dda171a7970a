"""Environment tokens of agentic episodes (loss_mask 0) reach nothing in the trainer (docs/agentic.md).

Multi-turn samples as `--custom-generate-function-path` builds them: model turn, environment
feedback (masked, rollout log-prob 0), model turn, trailing environment observation (masked). On
the real Trainer (builtin:tiny-gpt, Megatron-core on CPU), under the PPO loss with the KL and
entropy terms switched on and each ratio denominator:

- changing the environment tokens' rollout log-probs changes neither the loss, its metric sums
  (entropy, KL, ppo_kl...) nor any gradient;
- changing the ids of trailing environment tokens (so the logits that would predict them, and their
  log-probs, differ) changes nothing either; dropping them altogether gives the same loss, which
  also pins the token-mean normaliser: it counts model tokens only (counting the two masked tokens
  would scale the loss by 6/8);
- the same change with the mask deliberately left at 1 (the bug the builtin environment's bar
  catches) does change the loss: the test can see a masking bug.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.models.builtin import EOS_ID, SEP_ID, materialize_checkpoint
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.rank_batches import trainable_samples
from miles_core.train.trainer import Trainer

torch.set_num_threads(1)

PROMPTS = [[1, 2, 3, 4, SEP_ID], [5, 0, 7, 9, SEP_ID], [3, 3, 8, 1, SEP_ID], [6, 2, 0, 4, SEP_ID]]
TURNS = [([4, 3, SEP_ID], [2, 1, EOS_ID]), ([9, 7], [0, 5, EOS_ID]), ([1, 8, 0], [3, 3]), ([4, 0, SEP_ID], [2, 6, EOS_ID])]
REWARDS = [1.0, 0.45, 0.2, 0.7]
LOSSES = {
    "rollout-logprobs": dict(use_rollout_logprobs=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
    "tis": dict(use_rollout_logprobs=False, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
    "decoupled": dict(use_rollout_logprobs=True, use_decoupled_loss=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
    # miles' MIS at sequence level with rejection and its veto (a masked token's ratio must not reach either)
    "mis": dict(use_rollout_logprobs=False, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
                custom_tis_function_path="miles_core.train.corrections.compute_mis_weights_with_cp",
                tis_level="sequence", use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True),
}


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("tiny-gpt")))


def episode_group(env_logprob=0.0, tail=(5, 6), env_mask=0) -> Group:
    """One group of two-turn episodes: turn 1, feedback `c <sep>` (environment), turn 2, `tail`
    (environment). Model tokens carry fixed rollout log-probs; environment tokens `env_logprob`."""
    samples = []
    for i, (prompt, (t1, t2), reward) in enumerate(zip(PROMPTS, TURNS, REWARDS)):
        env = [i % 3, SEP_ID]
        parts = [(t1, 1), (env, env_mask), (t2, 1), (list(tail), env_mask)]
        ids, mask, lps = [], [], []
        for j, (tokens, m) in enumerate(parts):
            is_env = j % 2 == 1
            ids += tokens
            mask += [m] * len(tokens)
            lps += [env_logprob if is_env else -1.0 - 0.1 * k for k in range(len(tokens))]
        samples.append(Sample("g", 0, i, prompt, ids, lps, mask, [1] * len(ids), reward=reward,
                              status=SampleStatus.COMPLETED))
    return Group("g", 0, samples)


def loss_and_grads(tr: Trainer, group: Group):
    """The loss, its metric sums and every gradient of one micro-batch over `group` (no step)."""
    items = trainable_samples([group], True)
    total_tokens = float(sum(sum(s.loss_mask) for s, _ in items))
    tr.model.train()
    tr._zero_grad()
    loss, sums = tr._micro_batch(items, total_tokens)
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return float(loss.detach()), sums, grads


def assert_same(a, b):
    (loss_a, sums_a, grads_a), (loss_b, sums_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-8)
    assert sums_a.keys() == sums_b.keys()
    for k in sums_a:
        assert sums_a[k] == pytest.approx(sums_b[k], rel=1e-5, abs=1e-6), k
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_environment_tokens_change_nothing_in_the_loss_or_gradients(tiny_gpt, loss):
    """Pins: masked environment tokens contribute nothing to the policy loss, KL or entropy, nor to
    the token-mean normaliser, whatever their rollout log-probs or (trailing) ids.
    Guards: a trainer that lets loss_mask-0 tokens into any term (the builtin environment's e2e bar
    fails with them in the loss)."""
    cfg = dataclasses.replace(TrainSection(), **LOSSES[loss])
    with Trainer(cfg, tiny_gpt) as tr:
        base = loss_and_grads(tr, episode_group())
        assert base[1]["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start
        assert_same(base, loss_and_grads(tr, episode_group(env_logprob=-9.0)))
        assert_same(base, loss_and_grads(tr, episode_group(tail=(9, 0))))
        assert_same(base, loss_and_grads(tr, episode_group(tail=())))  # normaliser: model tokens only
        if loss not in ("tis", "mis"):  # the bug, for contrast: log-probs of tokens in the loss do matter
            unmasked = loss_and_grads(tr, episode_group(env_mask=1))
            changed = loss_and_grads(tr, episode_group(env_mask=1, env_logprob=-9.0))
            assert unmasked[0] != pytest.approx(changed[0], rel=1e-4)


def test_train_step_counts_only_model_tokens(tiny_gpt):
    """Pins: train/tokens (the normaliser) is the number of model tokens: 6, 5, 5, 6 of the four
    episodes, not their 4 + 2 environment tokens each."""
    with Trainer(TrainSection(), tiny_gpt) as tr:
        m = tr.train_step(0, [episode_group()])
    assert m["train/tokens"] == 22.0 and m["train/samples"] == 4.0
