"""The weight version of environment tokens appended before an episode's first model token
(miles_core.rollout.episodes: append_environment + fill_environment_versions, docs/agentic.md).

The rule: an environment token carries the version of the model token before it; one appended
before any model token (a system preamble, a tool's opening observation) has none before it, so
when the episode returns it takes the version of the episode's FIRST model token -- the weights
whose first action answers it -- not the latest version the episode saw. (An episode without any
model token gets version 0.)

Pins that rule across a weight push: environment tokens first, then a model turn at version 1
(one with a push inside the turn, so its own tokens span versions 1 and 2), then a turn at
version 2. The leading environment tokens carry 1; environment tokens between turns carry the
version of the token right before them. Checked on the function wrapper directly and through the
producer (scripted engine, a real `set_version` push between the turns), where the sample is
mixed-version and its staleness is measured from version 1.

Guards: leading environment tokens filled with the latest (last) model version, or with the
version of the first turn's last token, instead of the first model token's.
"""

from __future__ import annotations

import asyncio

from miles_core.rollout.drain import drain_batch
from miles_core.rollout.episodes import GenerateArgs, GenerateFunction, append_environment, append_generated
from miles_core.samples import Sample, SampleStatus
from tests.unit.test_producer import Result, ScriptedEngine, rig, run

PREAMBLE = [8, 9, 8]  # environment tokens before the first model token
FEEDBACK = [7, 7]  # environment tokens between the turns


async def env_first_two_turns(args, sample, sampling_params):
    """Environment preamble, model turn 1, environment feedback, model turn 2."""
    append_environment(sample, PREAMBLE)
    append_generated(sample, await args.engine.generate(list(sample.prompt_ids) + sample.response_ids, sampling_params))
    append_environment(sample, FEEDBACK)
    append_generated(sample, await args.engine.generate(list(sample.prompt_ids) + sample.response_ids, sampling_params))
    sample.reward = 1.0
    return sample


class PushingEngine:
    """Turn 1 is pushed mid-turn (its tokens at versions 1 then 2); turn 2 runs at version 2."""

    def __init__(self):
        self.turns = [Result([1, 2], [-0.5, -0.5], [1, 2], "length", 2),
                      Result([3, 4], [-0.5, -0.5], [2, 2], "stop", 2)]

    async def generate(self, input_ids, sampling_params=None):
        return self.turns.pop(0)


def test_environment_tokens_before_the_first_model_token_take_its_version():
    """Pins: leading environment tokens take the first model token's version (1) even though the
    first turn ends at, and the episode finishes on, version 2; guards against the latest version."""
    fn = GenerateFunction(env_first_two_turns, "tests:env_first_two_turns")
    sample = Sample("g0", 0, 0, [0, 10], [], [], [], [])
    out = asyncio.run(fn(GenerateArgs(engine=PushingEngine()), sample, {"max_new_tokens": 2}))
    (s,) = out
    assert s.response_ids == [*PREAMBLE, 1, 2, *FEEDBACK, 3, 4]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert s.token_versions == [1, 1, 1, 1, 2, 2, 2, 2, 2], s.token_versions
    assert s.status == SampleStatus.COMPLETED and s.mixed_version


def test_an_episode_with_no_model_token_gets_version_zero():
    """Pins the fallback of the same rule: nothing to take a version from gives 0 (never -1)."""

    async def environment_only(args, sample, sampling_params):
        append_environment(sample, PREAMBLE)
        sample.status, sample.reward = SampleStatus.COMPLETED, 0.0
        return sample

    (s,) = asyncio.run(GenerateFunction(environment_only, "tests:environment_only")(
        GenerateArgs(engine=None), Sample("g0", 0, 0, [0, 10], [], [], [], []), {}))
    assert s.token_versions == [0, 0, 0]


def test_env_first_episode_across_a_weight_push_in_the_producer():
    """Pins through the producer: preamble, turn 1 at version 1, a weight push (`set_version(2)`),
    turn 2 at version 2: the preamble carries 1 (the first turn's), the sample is mixed-version and
    its staleness at version 2 is 1. Guards against leading environment tokens taking version 2."""

    async def main():
        eng = ScriptedEngine()
        r = rig(eng, n=2, budget_groups=1)
        r.producer.generate_fn = GenerateFunction(env_first_two_turns, "tests:env_first_two_turns")
        r.producer.generate_args = GenerateArgs(engine=r.producer.engine)
        r.producer.start()
        await eng.wait_calls(2)
        for call in eng.calls[:2]:
            assert call.input_ids[-len(PREAMBLE):] == PREAMBLE  # the preamble precedes the first model call
            eng.finish(call, ids=(1, 2), version=1)
        await eng.wait_calls(4)
        r.producer.set_version(2)  # the weight push lands between the turns
        for call in eng.calls[2:4]:
            eng.finish(call, ids=(5, 6), version=2)
        batch = await drain_batch(r.consumer, 1, current_version=2)
        await r.producer.stop(grace_seconds=0)
        for s in batch.groups[0].samples:
            assert s.response_ids == [*PREAMBLE, 1, 2, *FEEDBACK, 5, 6]
            assert s.token_versions == [1, 1, 1, 1, 1, 1, 1, 2, 2], s.token_versions
            assert s.mixed_version
        assert batch.groups[0].staleness(2) == 1
        assert batch.metrics["rollout/weight_version/mixed_version_ratio"] == 1.0

    run(main())
