"""The Trainer on the embedded default model (builtin:tiny-gpt, Megatron-core on CPU).

Pins: one optimizer step per train_step with the §5.6 metrics; the loss covers response tokens
with loss_mask 1 only; failed samples neither train nor shift their group's advantages; rollout
log-probs equal to the trainer's give ratio 1 (no clipping, zero abs diff); repeated steps raise
the log-prob of rewarded responses; export_hf is an HF checkpoint `transformers` loads with the
trainer's logits.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.metrics.names import LOSS_METRIC_NAMES as METRIC_NAMES
from miles_core.models.builtin import SEP_ID, materialize_checkpoint
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.rank_batches import trainable_samples
from miles_core.train.trainer import Trainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("tiny-gpt")))


def make_groups(n_groups=4, n=4, seed=0, logprob=-2.5):
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(10) for _ in range(4)] + [SEP_ID]
        samples = []
        for i in range(n):
            resp = [rng.randrange(13) for _ in range(rng.randint(1, 5))]
            samples.append(Sample(f"g{g}", g, i, prompt, resp, [logprob] * len(resp), [1] * len(resp),
                                  [1] * len(resp), reward=rng.random(), status=SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_train_step_updates_weights_and_reports_metrics(tiny_gpt):
    """One step changes the weights and returns every train/* metric with finite values."""
    with Trainer(TrainSection(), tiny_gpt) as tr:
        before = params(tr)
        m = tr.train_step(0, make_groups())
        assert set(METRIC_NAMES) <= set(m)
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
        assert m["train/grad_norm"] > 0
        assert any(not torch.equal(before[k], v) for k, v in params(tr).items())


def test_loss_mask_and_failed_samples_are_respected(tiny_gpt):
    """Masked tokens are not counted; failed samples are excluded and do not move the group mean."""
    groups = make_groups(2, 4)
    s0 = groups[0].samples[0]
    s0.loss_mask = [0] * len(s0.response_ids)
    failed = groups[1].samples[3]
    failed.status = SampleStatus.FAILED
    items = trainable_samples(groups, True)
    assert failed not in [s for s, _ in items]
    rewards = torch.tensor([s.reward for s in groups[1].samples[:3]], dtype=torch.float64)
    expect = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    assert [a for s, a in items if s.group_id == "g1"] == pytest.approx(expect)
    with Trainer(TrainSection(), tiny_gpt) as tr:
        m = tr.train_step(0, groups)
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples) - len(s0.response_ids) \
        - len(failed.response_ids)
    assert m["train/tokens"] == tokens
    assert m["train/samples"] == 7


def test_all_masked_batch_is_a_no_op(tiny_gpt):
    """A batch whose every token is masked out (e.g. by a sample filter) leaves the weights unchanged."""
    groups = make_groups(1, 4)
    for s in groups[0].samples:
        s.loss_mask = [0] * len(s.response_ids)
    with Trainer(TrainSection(), tiny_gpt) as tr:
        before = params(tr)
        tr.train_step(0, groups)
        assert all(torch.equal(before[k], v) for k, v in params(tr).items())


def test_rollout_logprobs_equal_to_trainer_give_ratio_one(tiny_gpt):
    """With the trainer's own log-probs as rollout log-probs, ratio is 1: no clipping, no diff."""
    groups = make_groups(2, 4)
    with Trainer(TrainSection(), tiny_gpt) as tr:
        samples = [s for g in groups for s in g.samples]
        for s, lp in zip(samples, tr.logprobs(samples)):
            s.response_logprobs = lp
        m = tr.train_step(0, groups)
    assert m["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert abs(m["train/ppo_kl"]) < 1e-5
    assert m["train/pg_clipfrac"] == 0.0


@pytest.mark.parametrize("flags", [dict(), dict(use_rollout_logprobs=False, use_tis=True),
                                   dict(use_decoupled_loss=True), dict(use_kl_loss=True, kl_loss_coef=0.1,
                                                                       entropy_coef=0.01)])
def test_rewarded_response_becomes_more_likely(tiny_gpt, flags):
    """Every loss variant raises the log-prob of the rewarded response over a few steps."""
    prompt = [1, 2, 3, 4, SEP_ID]
    good, bad = [4, 3, 2, 1, 11], [7, 7, 7, 7, 7]
    cfg = dataclasses.replace(TrainSection(lr=2e-3), **flags)
    with Trainer(cfg, tiny_gpt) as tr:
        probe = Sample("p", 0, 0, prompt, good)
        start = sum(tr.logprobs([probe])[0])
        for step in range(4):
            samples = [Sample("g", 0, i, prompt, r, tr.logprobs([Sample("x", 0, 0, prompt, r)])[0], [1] * 5, [1] * 5,
                              reward=rw, status=SampleStatus.COMPLETED)
                       for i, (r, rw) in enumerate([(good, 1.0), (bad, 0.0), (good, 1.0), (bad, 0.0)])]
            tr.train_step(step, [Group("g", 0, samples)])
        assert sum(tr.logprobs([probe])[0]) > start + 0.5


def test_export_hf_loads_in_transformers_with_the_trainer_logits(tiny_gpt, tmp_path):
    """export_hf writes weights, config and tokenizer; transformers reproduces the trainer's log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with Trainer(TrainSection(), tiny_gpt) as tr:
        tr.train_step(0, make_groups())
        out = tr.export_hf(str(tmp_path / "hf"))
        sample = Sample("p", 0, 0, [1, 2, 3, 4, SEP_ID], [4, 3, 2, 1, 11])
        ours = torch.tensor(tr.logprobs([sample])[0])
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits[0, :-1], -1)
    theirs = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[4:]
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_unsupported_estimator_is_refused(tiny_gpt):
    """--advantage-estimator ppo (a critic) is refused with the flag named, not silently run as GRPO."""
    with pytest.raises(Exception, match="advantage-estimator"):
        Trainer(TrainSection(advantage_estimator="ppo"), tiny_gpt)
