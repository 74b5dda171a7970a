"""Custom generate functions (`--custom-generate-function-path`, docs/agentic.md) in the producer.

Pins the episode contract with scripted engines (tests/unit/test_producer.py's fakes): one credit
is held for a whole multi-turn episode; environment tokens are appended with loss_mask 0 and
log-prob 0; a reward the function sets is kept; an exception in the function fails only its group
(rejected at put, the unused-samples handler applies, the error names the function) and an abort
or a cancellation mid-turn gives every credit back; an episode spanning a weight push carries both
versions and is counted as mixed. Also the signature check at validation and the builtin two-turn
environment (miles_core.rollout.multiturn) against a scripted engine.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_core.config import ConfigError, embedded_default, replace_fields
from miles_core.config.plugins import PluginError
from miles_core.models.builtin import EOS_ID, SEP_ID
from miles_core.prepare.checks import validate
from miles_core.rollout.drain import drain_batch
from miles_core.rollout.episodes import (
    GenerateArgs,
    GenerateFunction,
    append_environment,
    append_generated,
    load_generate_function,
)
from miles_core.rollout.multiturn import reverse4_two_turns, reverse4_two_turns_unmasked, two_turn_reward
from miles_core.samples import Sample, SampleStatus
from tests.unit.test_producer import Result, ScriptedEngine, TokenEngine, rig, run, settle

PATH = "tests.unit.test_episodes:two_turns"
ENV = [7, SEP_ID]


async def two_turns(args, sample, sampling_params):
    """Turn 1, two environment tokens, turn 2; reward = first token of turn 2."""
    append_generated(sample, await args.engine.generate(list(sample.prompt_ids), sampling_params))
    if sample.status == SampleStatus.ABORTED:
        return sample
    append_environment(sample, ENV)
    second = await args.engine.generate(list(sample.prompt_ids) + sample.response_ids, sampling_params)
    append_generated(sample, second)
    if second.output_ids:
        sample.reward = float(second.output_ids[0])
    return sample


def with_episodes(r, fn=two_turns, path=PATH):
    r.producer.generate_fn = GenerateFunction(fn, path)
    r.producer.generate_args = GenerateArgs(engine=r.producer.engine)
    return r


def test_an_episode_holds_one_credit_across_its_turns_and_masks_environment_tokens():
    """Pins: the credit of a sample comes back only when its whole episode ends (not after turn 1);
    environment tokens carry loss_mask 0, log-prob 0 and the version of the turn before; the
    function's reward is kept (the configured reward does not overwrite it)."""

    async def main():
        eng = ScriptedEngine()
        r = with_episodes(rig(eng, n=2, budget_groups=1))
        r.producer.start()
        await eng.wait_calls(2)
        for call in eng.calls[:2]:
            eng.finish(call, ids=(1, 2), version=3)
        await eng.wait_calls(4)  # both turn-2 calls: the group's credits are still held
        assert r.budget.used == 2 and r.producer.in_flight_groups == 1
        assert eng.calls[2].input_ids == [0, 10, 1, 2, *ENV]
        for call in eng.calls[2:4]:
            eng.finish(call, ids=(5, 6), version=3)
        batch = await drain_batch(r.consumer, 1, current_version=3)
        await r.producer.stop(grace_seconds=0)
        s = batch.groups[0].samples[0]
        assert s.response_ids == [1, 2, *ENV, 5, 6]
        assert s.loss_mask == [1, 1, 0, 0, 1, 1]
        assert s.response_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
        assert s.token_versions == [3] * 6 and not s.mixed_version
        assert s.reward == 5.0 and s.status == SampleStatus.COMPLETED
        assert r.budget.used == 0

    run(main())


FAILED_GROUPS: set[str] = set()


async def raises_on_prompt_1(args, sample, sampling_params):
    if sample.prompt_ids[0] == 1:
        FAILED_GROUPS.add(sample.group_id)
        raise KeyError("tool sandbox gone")
    return await two_turns(args, sample, sampling_params)


@pytest.mark.parametrize("handler", ["drop", "retry"])
def test_an_exception_in_the_function_fails_only_its_group(handler):
    """Pins: an episode that raises aborts its group with the error (naming the function) in the
    sample's metadata; the group is rejected at put and the unused-samples handler applies (retry
    serves the prompt again); the worker keeps running and no credit is lost.
    Guards: an agent's exception failing the whole rollout worker (the engine-error path)."""

    async def main():
        FAILED_GROUPS.clear()
        eng = TokenEngine(tokens=2)
        r = with_episodes(rig(eng, n=2, budget_groups=2, handler=handler, k_rows=4), raises_on_prompt_1,
                          "tests.unit.test_episodes:raises_on_prompt_1")
        r.producer.start()
        batch = await drain_batch(r.consumer, 2, current_version=1)
        assert r.producer.error is None
        rejected = [gid for gid, why in r.buffer.rejected if why == "aborted"]
        assert rejected, r.buffer.rejected
        assert all(g.prompt_index != 1 for g in batch.groups)
        assert r.producer.metrics()["rollout/generate_failed"] >= 1
        if handler == "retry":  # the prompt is served again (under a new group id) and fails again
            for _ in range(500):
                if len(FAILED_GROUPS) >= 2:
                    break
                await asyncio.sleep(0.002)
            assert len(FAILED_GROUPS) >= 2
        await r.producer.stop(grace_seconds=1)
        assert r.budget.used == 0 and r.producer.error is None

    run(main())


def test_failed_episode_sample_names_the_function():
    """Pins: the failed sample is aborted with finish_reason 'error' and the function's path and the
    exception in metadata["generate_error"]."""
    from miles_core.rollout.producer import mark_episode_failed

    fn = GenerateFunction(raises_on_prompt_1, "pkg.agent:episode")
    s = Sample("g", 1, 0, [1, 10])
    with pytest.raises(Exception) as info:
        asyncio.run(fn(GenerateArgs(engine=None), s, {}))
    mark_episode_failed(s, info.value)
    meta = json.loads(s.metadata)
    assert s.status == SampleStatus.ABORTED and s.finish_reason == "error"
    assert "--custom-generate-function-path pkg.agent:episode raised KeyError" in meta["generate_error"]
    assert isinstance(info.value.__cause__, KeyError)


def test_an_abort_mid_episode_rejects_the_group_and_returns_every_credit():
    """Pins: a turn the engine aborts (e.g. the engine died) ends the episode as aborted; its
    siblings are cancelled mid-turn, the group is rejected, every credit comes back."""

    async def main():
        eng = ScriptedEngine()
        r = with_episodes(rig(eng, n=2, budget_groups=1))
        r.producer.start()
        await eng.wait_calls(2)
        for call in eng.calls[:2]:
            eng.finish(call)
        await eng.wait_calls(4)
        eng.finish(eng.calls[2], reason="abort", ids=(1,))
        await settle()
        assert eng.calls[3].cancelled
        assert r.buffer.rejected and r.buffer.rejected[0][1] == "aborted"
        await r.producer.stop(grace_seconds=0.01)
        assert r.budget.used == 0 and r.producer.error is None

    run(main())


def test_stop_cancels_an_episode_mid_turn_without_leaking_credits():
    """Pins: stop() past its grace cancels an episode inside its second turn; the credits come back
    and the prompt stays outstanding for a resume."""

    async def main():
        eng = ScriptedEngine()
        r = with_episodes(rig(eng, n=2, budget_groups=1))
        r.producer.start()
        await eng.wait_calls(2)
        for call in eng.calls[:2]:
            eng.finish(call)
        await eng.wait_calls(4)
        await r.producer.stop(grace_seconds=0.01)
        assert eng.calls[2].cancelled and eng.calls[3].cancelled
        assert r.budget.used == 0 and r.producer.in_flight_groups == 0
        assert r.producer.source.outstanding == 1

    run(main())


def test_a_paused_producer_lets_an_episode_in_flight_finish_its_turns():
    """Pins: pause() (Mode-1 eval on shared engines) starts no new group but aborts nothing: an
    episode in flight goes on to its next turn and commits; resume() starts the next group."""

    async def main():
        eng = ScriptedEngine()
        r = with_episodes(rig(eng, n=2, budget_groups=1))
        r.producer.start()
        await eng.wait_calls(2)
        r.producer.pause()
        for call in eng.calls[:2]:
            eng.finish(call)
        await eng.wait_calls(4)
        for call in eng.calls[2:4]:
            eng.finish(call)
        batch = await drain_batch(r.consumer, 1, current_version=1)
        assert batch.groups[0].samples[0].status == SampleStatus.COMPLETED
        await settle()
        assert len(eng.calls) == 4  # paused: no new group
        r.producer.resume()
        await eng.wait_calls(6)
        await r.producer.stop(grace_seconds=0)
        assert r.budget.used == 0

    run(main())


def test_an_episode_spanning_a_weight_push_has_mixed_versions():
    """Pins §17: turn 1 at version 1, a weight push between the turns, turn 2 at version 2: the
    sample carries both versions (environment tokens take turn 1's), the mixed-version metric
    counts it and its staleness is measured from the oldest token."""

    async def main():
        eng = TokenEngine(tokens=2, version=1)
        gate = asyncio.Event()

        async def wait_for_push(args, sample, sampling_params):
            append_generated(sample, await args.engine.generate(list(sample.prompt_ids), sampling_params))
            append_environment(sample, ENV)
            await gate.wait()
            append_generated(sample, await args.engine.generate(list(sample.prompt_ids) + sample.response_ids,
                                                                sampling_params))
            return sample

        r = with_episodes(rig(eng, n=2, budget_groups=1), wait_for_push, "tests:wait_for_push")
        r.producer.start()
        while eng.emitted < 4:
            await asyncio.sleep(0.001)
        eng.version = 2
        r.producer.set_version(2)
        gate.set()
        batch = await drain_batch(r.consumer, 1, current_version=2)
        await r.producer.stop(grace_seconds=0)
        s = batch.groups[0].samples[0]
        assert s.token_versions == [1, 1, 1, 1, 2, 2] and s.mixed_version
        assert batch.groups[0].staleness(2) == 1
        assert batch.metrics["rollout/weight_version/mixed_version_ratio"] == 1.0

    run(main())


def test_a_list_result_replaces_the_sample_and_is_renumbered():
    """Pins: `-> list[Sample]`: the returned samples take the input sample's place in its group
    (group id and prompt index forced), and sample indices are renumbered 0..k-1."""

    async def two_agents(args, sample, sampling_params):
        out = []
        for _ in range(2):
            s = Sample("other", 99, 0, list(sample.prompt_ids))
            append_generated(s, await args.engine.generate(list(sample.prompt_ids), sampling_params))
            out.append(s)
        return out

    async def main():
        r = with_episodes(rig(TokenEngine(tokens=2), n=2, budget_groups=1), two_agents, "tests:two_agents")
        r.producer.start()
        batch = await drain_batch(r.consumer, 1, current_version=1)
        await r.producer.stop(grace_seconds=0)
        g = batch.groups[0]
        assert [s.sample_index for s in g.samples] == [0, 1, 2, 3]
        assert {s.group_id for s in g.samples} == {g.group_id} and {s.prompt_index for s in g.samples} == {0}

    run(main())


def test_a_result_breaking_the_contract_is_an_error_naming_the_function():
    """Pins: a response whose loss_mask does not cover every token, or a pending status, fails with
    GenerateFunctionError naming the flag and path (not a TrainError steps later)."""

    async def no_mask(args, sample, sampling_params):
        sample.response_ids, sample.response_logprobs, sample.token_versions = [1, 2], [0.0, 0.0], [1, 1]
        sample.status = SampleStatus.COMPLETED
        return sample

    async def pending(args, sample, sampling_params):
        return sample

    for fn, words in ((no_mask, "loss_mask"), (pending, "pending")):
        with pytest.raises(Exception, match=rf"--custom-generate-function-path pkg:{fn.__name__}.*{words}"):
            asyncio.run(GenerateFunction(fn, f"pkg:{fn.__name__}")(GenerateArgs(None), Sample("g", 0, 0, [1]), {}))


# ----------------------------------------------------------------------------- validation


async def good(args, sample, sampling_params):
    return sample


async def good_eval(args, sample, sampling_params, evaluation=False):
    return sample


def not_async(args, sample, sampling_params):
    return sample


async def two_params(args, sample):
    return sample


def _validate_error(path: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(replace_fields(embedded_default(), custom_generate_function_path=path))
    return str(info.value)


def test_validation_resolves_and_signature_checks_the_function():
    """Pins: the path is resolved and checked in validate: async, callable as (args, sample,
    sampling_params); `evaluation` is detected. Errors name the flag and the expected signature.
    Guards: a typo or a sync function found only when the first episode runs in the worker."""
    validate(replace_fields(embedded_default(), custom_generate_function_path="tests.unit.test_episodes:good"))
    assert not load_generate_function("tests.unit.test_episodes:good").accepts_evaluation
    assert load_generate_function("tests.unit.test_episodes:good_eval").accepts_evaluation
    assert load_generate_function("") is None
    message = _validate_error("tests.unit.test_episodes:not_async")
    assert "--custom-generate-function-path" in message and "not an async function" in message
    message = _validate_error("tests.unit.test_episodes:two_params")
    assert "--custom-generate-function-path" in message and "sampling_params" in message
    assert "not importable" in _validate_error("no_such_agent_mod:fn")
    with pytest.raises(PluginError, match="no attribute"):
        load_generate_function("tests.unit.test_episodes:nope")


def test_generate_args_reads_flags_through_to_the_config():
    """Pins: code written against miles' `args` reads flags by field name (args.rollout_max_response_len)."""
    args = GenerateArgs(engine="E", config=embedded_default())
    assert args.engine == "E" and args.rollout_max_response_len == embedded_default().rollout.rollout_max_response_len
    with pytest.raises(AttributeError, match="no_such_flag"):
        args.no_such_flag


def test_evaluation_keyword_reaches_functions_that_take_it():
    seen = []

    async def fn(args, sample, sampling_params, evaluation=False):
        seen.append(evaluation)
        sample.status = SampleStatus.COMPLETED
        return sample

    f = GenerateFunction(fn, "x:fn")
    asyncio.run(f(GenerateArgs(None), Sample("g", 0, 0, [1]), {}, evaluation=True))
    asyncio.run(GenerateFunction(good, "x:good")(GenerateArgs(None), Sample("g", 0, 0, [1], status=SampleStatus.COMPLETED),
                                                 {}, evaluation=True))
    assert seen == [True]


# ----------------------------------------------------------------------------- the builtin environment


class AnswerEngine:
    """Answers each turn with scripted tokens; records the params of every call."""

    def __init__(self, turns):
        self.turns, self.params = list(turns), []

    async def generate(self, input_ids, sampling_params=None):
        self.params.append((list(input_ids), dict(sampling_params)))
        ids = self.turns.pop(0)
        return Result(list(ids), [-0.1] * len(ids), [1] * len(ids), "stop", 1)


def _episode(fn, turns, label="4321"):
    eng = AnswerEngine(turns)
    s = Sample("g", 0, 0, [1, 2, 3, 4, SEP_ID], label=label)
    out = asyncio.run(GenerateFunction(fn, "m:f")(GenerateArgs(engine=eng), s, {"max_new_tokens": 5}))[0]
    return out, eng


def test_builtin_two_turn_environment_masks_its_feedback_and_rewards_every_terminator():
    """Pins the builtin environment: turn 1 stops at <sep> only (EOS ignored), the feedback token is
    the count of right turn-1 digits, environment tokens are masked, turn 2 sees the whole history
    and stops at <eos>; a perfect episode scores 1.0."""
    s, eng = _episode(reverse4_two_turns, [[4, 3, SEP_ID], [2, 1, EOS_ID]])
    assert s.response_ids == [4, 3, SEP_ID, 2, SEP_ID, 2, 1, EOS_ID]
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert s.response_logprobs[3:5] == [0.0, 0.0]
    assert s.reward == pytest.approx(1.0) and s.status == SampleStatus.COMPLETED
    (in1, p1), (in2, p2) = eng.params
    assert p1["stop_token_ids"] == [SEP_ID] and p1["ignore_eos"] and p1["max_new_tokens"] == 3
    assert p2["stop_token_ids"] == [EOS_ID] and not p2["ignore_eos"]
    assert in2 == [1, 2, 3, 4, SEP_ID, 4, 3, SEP_ID, 2, SEP_ID]


def test_builtin_two_turn_reward_and_the_unmasked_control():
    """Pins the reward terms (0.8 x digits/4 + 0.1 <sep> in place + 0.1 <eos> in place) and that the
    control differs only in the environment tokens' loss mask."""
    assert two_turn_reward([4, 3, SEP_ID], [2, 1, EOS_ID], [4, 3, 2, 1]) == pytest.approx(1.0)
    assert two_turn_reward([4, 0, EOS_ID], [2, 1, EOS_ID], [4, 3, 2, 1]) == pytest.approx(0.7)
    assert two_turn_reward([4], [2, 1], [4, 3, 2, 1]) == pytest.approx(0.6)
    s, _ = _episode(reverse4_two_turns, [[4, 0, EOS_ID], [2, 1, EOS_ID]])
    assert s.response_ids[3] == 1  # one of the two digits was right
    u, _ = _episode(reverse4_two_turns_unmasked, [[4, 0, EOS_ID], [2, 1, EOS_ID]])
    assert u.response_ids == s.response_ids and u.reward == s.reward
    assert u.loss_mask == [1] * 8 and u.response_logprobs[3:5] == [0.0, 0.0]


# ----------------------------------------------------------------------------- evaluation


def test_eval_runs_the_function_with_evaluation_true_and_keeps_its_reward():
    """Pins: with --custom-generate-function-path, eval datasets run each sample as an episode of the
    function with evaluation=True on the eval engine; the reward it sets is the eval reward (not the
    dataset's single-turn reward); the versions of its tokens are reported for the pin check."""
    from miles_core.eval.datasets import EvalSampling, load_eval_datasets
    from miles_core.eval.evaluate import evaluate
    from miles_core.metrics.names import eval_reward_metric

    cfg = replace_fields(embedded_default(), custom_generate_function_path="miles_core.rollout.multiturn:reverse4_two_turns",
                         eval_prompt_data=["held=builtin:reverse4-heldout"], eval_max_prompts=2)
    (ds,) = load_eval_datasets(cfg)
    assert ds.episode is not None
    answers = []
    for row in ds.rows:  # both turns right for every prompt
        d = [int(c) for c in row.label]
        answers += [[d[0], d[1], SEP_ID], [d[2], d[3], EOS_ID]]
    eng = AnswerEngine(answers)
    out = asyncio.run(evaluate(eng, ds, EvalSampling(max_response_len=3), concurrency=1))
    assert out.metrics[eval_reward_metric("held")] == pytest.approx(1.0)
    assert out.metrics["eval/held/pass@1"] == pytest.approx(1.0)
    assert out.weight_versions == [1] and len(eng.params) == 4


# ----------------------------------------------------------------------------- the calculator tool example


class CharTokenizer:
    """One token per character (ids = code points): enough to check the tool turn's text."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_calculator_tool_answers_a_call_in_the_chat_template_format():
    """Pins the example tool environment: a `<tool_call>` turn is answered by a masked `tool`
    message in the ChatML format, the next assistant turn follows, and the reward is scored on the
    final turn only (the tool's output never counts)."""
    from miles_core.rollout.calculator_tool import calculate, calculator_episode

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "63 + 11"}}</tool_call>'
    tok = CharTokenizer()
    eng = AnswerEngine([tok.encode(call), tok.encode("63 + 11 = 74<|im_end|>")])
    s = Sample("g", 0, 0, tok.encode("What is 63 + 11?"), label="74", metadata=json.dumps({"task": "arith"}))
    out = asyncio.run(GenerateFunction(calculator_episode, "m:f")(GenerateArgs(engine=eng, text_tokenizer=tok), s, {}))[0]
    text = tok.decode(out.response_ids)
    env = '<|im_end|>\n<|im_start|>tool\n{"result": 74}<|im_end|>\n<|im_start|>assistant\n'
    assert text == call + env + "63 + 11 = 74<|im_end|>"
    assert out.loss_mask == [1] * len(call) + [0] * len(env) + [1] * len("63 + 11 = 74<|im_end|>")
    assert out.reward == 1.0 and eng.params[0][1]["stop"] == ["</tool_call>"]
    assert calculate("(2 + 3) * 4 / 8") == 2.5
    with pytest.raises(ValueError):
        calculate("__import__('os')")


def test_the_unmasked_calculator_control_leaves_only_the_tool_messages_in_the_loss():
    """The masking-bug control of the calculator preset's bench: the same episode as the real one, the
    tool's message (and the headers around it) in the loss instead of out of it; rollout log-probs 0."""
    from miles_core.rollout.calculator_tool import calculator_episode, calculator_episode_unmasked

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "63 + 11"}}</tool_call>'
    tok = CharTokenizer()
    outs = []
    for fn in (calculator_episode, calculator_episode_unmasked):
        eng = AnswerEngine([tok.encode(call), tok.encode("74<|im_end|>")])
        s = Sample("g", 0, 0, tok.encode("What is 63 + 11?"), label="74", metadata=json.dumps({"task": "arith"}))
        outs.append(asyncio.run(GenerateFunction(fn, "m:f")(GenerateArgs(engine=eng, text_tokenizer=tok), s, {}))[0])
    masked, unmasked = outs
    assert masked.response_ids == unmasked.response_ids and masked.reward == unmasked.reward == 1.0
    env = [i for i, m in enumerate(masked.loss_mask) if m == 0]
    assert env and unmasked.loss_mask == [1] * len(unmasked.response_ids)
    assert all(unmasked.response_logprobs[i] == 0.0 for i in env)


@pytest.mark.parametrize("fault", ["raises", "hangs", "bad call"])
def test_a_calculator_that_fails_or_hangs_is_an_outcome_counted_in_the_sample(monkeypatch, fault):
    """Pins: a tool that raises, does not answer within its timeout, or gets a call it cannot run answers
    the model with an `{"error": ...}` tool message, the episode goes on to its final turn and its reward,
    and the sample's metadata counts calls, errors and timeouts (the dataset's own metadata kept).
    Guards: a failing tool crashing the episode (a failed group), or a hung one holding it for ever."""
    import threading

    from miles_core.rollout import calculator_tool

    release = threading.Event()

    def broken(call_text):
        if fault == "raises":
            raise RuntimeError("calculator backend down")
        release.wait(30)  # hangs until the episode's next turn (ReleasingEngine)
        return {"result": 74}

    if fault != "bad call":
        monkeypatch.setattr(calculator_tool, "tool_result", broken)
    monkeypatch.setattr(calculator_tool, "TOOL_TIMEOUT_SECONDS", 0.2)
    expression = "63 + 11" if fault != "bad call" else "__import__('os')"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression
    tok = CharTokenizer()

    class ReleasingEngine(AnswerEngine):  # the turn after the tool's answer frees a hung tool's thread
        async def generate(self, input_ids, sampling_params=None):
            if self.params:
                release.set()
            return await super().generate(input_ids, sampling_params)

    eng = ReleasingEngine([tok.encode(call), tok.encode("63 + 11 = 74<|im_end|>")])
    s = Sample("g", 0, 0, tok.encode("What is 63 + 11?"), label="74", metadata=json.dumps({"task": "arith", "a": 63}))
    try:
        out = asyncio.run(GenerateFunction(calculator_tool.calculator_episode, "m:f")(
            GenerateArgs(engine=eng, text_tokenizer=tok), s, {}))[0]
    finally:
        release.set()
    text = tok.decode(out.response_ids)
    tool_turn = text.split("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0]
    assert "error" in json.loads(tool_turn) and text.endswith("63 + 11 = 74<|im_end|>")
    assert out.status == SampleStatus.COMPLETED and out.reward == 1.0
    meta = json.loads(out.metadata)
    assert meta["task"] == "arith" and meta["a"] == 63
    assert meta["tool"] == {"calls": 1, "errors": int(fault != "hangs"), "timeouts": int(fault == "hangs")}


@pytest.mark.parametrize("turn, call", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>',
     '{"name": "calculator", "arguments": {"expression": "1 + 2"}}'),
    ('<tool_call> {"name": "calculator", "arguments": {"expression": "964 + 494"}}\n\nThe answer is 196.<|im_end|>',
     '{"name": "calculator", "arguments": {"expression": "964 + 494"}}'),  # never closed: still a call
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1 +', None),  # cut off mid-object
    ("The answer is 3.", None),
    ("<tool_call>[1, 2]</tool_call>", None),
])
def test_a_call_is_the_first_complete_json_object_after_the_tag(turn, call):
    """Pins the calculator's call parser: the first complete JSON object after `<tool_call>`, closed by the
    tag or not (SmolLM2-135M, the call's opening prefilled, wrote 16 of 16 right expressions and closed the
    tag for none); guards against a regex that needs the closing tag, or one that takes a partial object."""
    from miles_core.rollout.calculator_tool import find_call

    assert find_call(turn) == call
