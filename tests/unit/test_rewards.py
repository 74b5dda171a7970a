"""Reward functions: built-ins, the --custom-rm-path shapes, and failure handling."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

from miles_core.config import embedded_default
from miles_core.config.plugins import PluginError
from miles_core.models.builtin import EOS_ID
from miles_core.rollout.rewards import (
    Rewarder,
    RewardError,
    exact_match,
    extract_math_answer,
    load_reward,
    math_answer,
    task_reward,
)
from miles_core.samples import Group, Sample, SampleStatus


def sample(response, label="4321", task="reverse4", status=SampleStatus.COMPLETED, i=0):
    return Sample(group_id="g", prompt_index=0, sample_index=i, prompt_ids=[1, 2, 3, 4, 10],
                  response_ids=list(response), loss_mask=[1] * len(response), label=label,
                  metadata=json.dumps({"epoch": 0, "position": 0, "task": task}), status=status)


def score(rewarder, samples):
    g = Group("g", 0, samples)
    asyncio.run(rewarder.score_group(g))
    return g


def test_default_reward_dispatches_on_the_task():
    """Pins the embedded default: the reverse4 task is scored by builtin_tasks.digits_reward."""
    r = Rewarder(load_reward(""))
    g = score(r, [sample([4, 3, 2, 1, EOS_ID]), sample([4, 3, 0, 0, 5], i=1)])
    assert [s.reward for s in g.samples] == pytest.approx([1.0, 0.4])


@pytest.mark.parametrize("text,label,want", [
    ("so the answer is 42.", "42", 1.0),
    ("first 3 then 41", "42", 0.0),
    ("x = \\boxed{\\frac{1}{2}} and 7", "0.5", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("-3.50", "-3.5", 1.0),
    ("no number here", "1", 0.0),
    ("\\boxed{x+1", "1", 0.0),
    ("3/4", "0.75", 1.0),
])
def test_math_answer_takes_the_boxed_or_last_number(text, label, want):
    assert math_answer(sample([], label=label), text) == want


def test_extract_math_answer_handles_nested_braces():
    assert extract_math_answer("a \\boxed{x} b \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"


def test_exact_match_strips_whitespace():
    assert exact_match(sample([], label="Paris"), "  Paris\n") == 1.0
    assert exact_match(sample([], label="Paris"), "paris") == 0.0


def test_text_rewards_get_the_decoded_response():
    """A needs_text function receives decode(response_ids), here via the task dispatcher."""
    r = Rewarder(task_reward, decode=lambda ids: "answer: " + "".join(map(str, ids)))
    g = score(r, [sample([4, 2], label="42", task="math"), sample([9], label="42", task="exact_match", i=1)])
    assert [s.reward for s in g.samples] == [1.0, 0.0]


def test_raising_reward_marks_the_sample_failed_and_counts_it():
    """Pins docs/architecture.md: a raising reward function fails that sample (status failed, reason in
    metadata, loss mask zeroed, reward None) and is counted; the other samples are still scored."""

    def flaky(s):
        if s.sample_index == 1:
            raise KeyError("boom")
        return 0.5

    r = Rewarder(flaky)
    g = score(r, [sample([1]), sample([2], i=1), sample([3], i=2)])
    assert [s.status for s in g.samples] == [SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.COMPLETED]
    bad = g.samples[1]
    assert bad.reward is None and bad.loss_mask == [0]
    assert "KeyError" in json.loads(bad.metadata)["reward_error"]
    assert json.loads(bad.metadata)["position"] == 0  # the resume key survives
    assert r.take_failed() == 1 and r.take_failed() == 0


def test_non_numeric_and_nan_rewards_fail_the_sample():
    r = Rewarder(lambda s: "high" if s.sample_index == 0 else float("nan"))
    g = score(r, [sample([1]), sample([1], i=1)])
    assert all(s.status == SampleStatus.FAILED for s in g.samples) and r.take_failed() == 2


def test_async_and_batched_reward_functions():
    """Async per-sample and (async) batched group functions are both supported."""

    async def per_sample(s):
        await asyncio.sleep(0)
        return len(s.response_ids)

    async def per_group(samples):
        return [float(i) for i, _ in enumerate(samples)]

    per_group.batched = True
    assert [s.reward for s in score(Rewarder(per_sample), [sample([1, 2]), sample([1], i=1)]).samples] == [2.0, 1.0]
    assert [s.reward for s in score(Rewarder(per_group), [sample([1]), sample([1], i=1)]).samples] == [0.0, 1.0]


def test_batched_reward_returning_the_wrong_count_fails_the_group():
    def short(samples):
        return [1.0]

    short.batched = True
    r = Rewarder(short)
    g = score(r, [sample([1]), sample([1], i=1)])
    assert all(s.status == SampleStatus.FAILED for s in g.samples)


def test_aborted_samples_are_not_scored():
    calls = []
    r = Rewarder(lambda s: calls.append(s) or 1.0)
    g = score(r, [sample([1], status=SampleStatus.ABORTED), sample([1], i=1)])
    assert len(calls) == 1 and g.samples[0].reward is None


def test_unknown_task_fails_with_a_pointer_to_the_flag():
    r = Rewarder(task_reward)
    g = score(r, [sample([1], task="poetry")])
    assert "--custom-rm-path" in json.loads(g.samples[0].metadata)["reward_error"]


def test_custom_reward_loaded_by_dotted_path_and_signature_checked(monkeypatch):
    """--custom-rm-path resolves through the plugin loader; a wrong arity is refused up front."""
    mod = types.ModuleType("my_rm_mod")
    mod.good = lambda s: 1.0
    mod.bad = lambda a, b, c: 1.0
    monkeypatch.setitem(sys.modules, "my_rm_mod", mod)
    assert load_reward("my_rm_mod:good") is mod.good
    with pytest.raises(RewardError, match="must take"):
        Rewarder(load_reward("my_rm_mod:bad"))
    with pytest.raises(PluginError, match="--custom-rm-path"):
        load_reward("my_rm_mod:missing")


def test_random_policy_level_of_reverse4():
    """Pins: the random-policy level the report states for reverse4 (uniform tokens over the 13-token
    vocabulary, stopping at <eos>) is the small number learning must beat (~0.066), deterministic.
    Guards: a level computed without the <eos> stop, or on the wrong split."""
    from miles_core.rollout.builtin_tasks import random_policy_reward

    level = random_policy_reward("builtin:reverse4", 5)
    assert 0.05 < level < 0.08
    assert level == random_policy_reward("builtin:reverse4", 5)


# ----------------------------------------------------------------------------- the decoder


@pytest.mark.parametrize("which", ["rollout", "eval"])
def test_decoder_loads_the_run_tokenizer_lazily(monkeypatch, which):
    """Pins: the rollout's and eval's decoders load `load_tokenizer(tokenizer_source(cfg))` on first
    use (object storage, imported GGUF, HF dir), not AutoTokenizer on the raw flag; builtin models
    decode digits. Guards: a tokenizer loaded at build time or from `--hf-checkpoint` as it is."""
    from miles_core.config import RunConfig, replace_fields
    from miles_core.eval import datasets
    from miles_core.rollout import assembly
    from miles_core.rollout.assembly import digit_decode

    owner = assembly  # eval's decoder is the rollout's
    build = assembly.tokenizer_decode if which == "rollout" else datasets._decoder
    loaded = []

    class FakeTokenizer:
        def decode(self, ids, skip_special_tokens=False):
            assert skip_special_tokens
            return "|".join(map(str, ids))

    monkeypatch.setattr(owner, "load_tokenizer", lambda model: loaded.append(model) or FakeTokenizer())
    monkeypatch.setattr(owner, "tokenizer_source", lambda cfg: f"resolved:{cfg.model.hf_checkpoint}")
    assert build(replace_fields(embedded_default(), hf_checkpoint="builtin:tiny-gpt")) is digit_decode
    decode = build(replace_fields(embedded_default(), hf_checkpoint="s3://bucket/model.gguf"))
    assert loaded == []
    assert decode([1, 2]) == "1|2" and decode([3]) == "3"
    assert loaded == ["resolved:s3://bucket/model.gguf"]
