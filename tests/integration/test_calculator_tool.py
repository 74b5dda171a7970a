"""The example calculator tool environment (miles_core.rollout.calculator_tool) on the real model of
the real-model preset: SmolLM2-135M-Instruct imported from its GGUF, served by the CPU engine.

Pins that the episode runs end to end on a real tokenizer and engine: chat-templated arith prompts,
turns that stop at `</tool_call>` or the end of the assistant turn, the tool's answer masked, every
token with a log-prob and a version, the reward set from the final turn. The model need not call
the tool (a 135M model rarely does unprompted), so a forced call is checked too: a prompt whose
assistant turn is prefilled with the start of a call.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_core.engines.client import EngineClient
from miles_core.models.tokenizer import load_tokenizer
from miles_core.rollout.calculator_tool import calculator_episode
from miles_core.rollout.episodes import GenerateArgs, GenerateFunction
from miles_core.samples import Sample, SampleStatus
from tests.integration.eval_support import start_engine

pytestmark = [pytest.mark.slow]

SYSTEM = ('You can call a calculator: reply <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "..."}}</tool_call> and wait for the result.')


def test_calculator_episodes_run_on_smollm2_and_the_cpu_engine(smollm2_hf):
    """Three greedy episodes (the last with a prefilled call) finish with consistent masks,
    log-probs, versions and a reward; a tool answer, when there is one, is masked."""
    _, path = smollm2_hf
    tok = load_tokenizer(path)
    server = start_engine(path, version=1)
    try:
        samples = asyncio.run(_episodes(server.url, tok))
    finally:
        server.stop()
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), s.finish_reason
        n = len(s.response_ids)
        assert len(s.loss_mask) == len(s.response_logprobs) == len(s.token_versions) == n > 0
        assert set(s.token_versions) == {1} and s.reward in (0.0, 1.0)
    forced = samples[-1]
    text = tok.decode(forced.response_ids, skip_special_tokens=False)
    print("forced call episode:", repr(text))
    # greedy, the model closes the prefilled call: the tool answered (98), masked, and a turn followed
    masked = [t for t, m in zip(forced.response_ids, forced.loss_mask) if m == 0]
    assert tok.decode(masked, skip_special_tokens=False).startswith('<|im_end|>\n<|im_start|>tool\n{"result": 98}')
    assert all(lp == 0.0 for lp, m in zip(forced.response_logprobs, forced.loss_mask) if m == 0)
    assert forced.loss_mask[-1] == 1  # the final assistant turn is the model's


async def _episodes(url: str, tok) -> list[Sample]:
    fn = GenerateFunction(calculator_episode, "miles_core.rollout.calculator_tool:calculator_episode")
    params = {"max_new_tokens": 48, "temperature": 0.0}
    prompts = [(a, b) for a, b in ((63, 11), (27, 45), (90, 8))]
    async with EngineClient([url]) as client:
        args = GenerateArgs(engine=client, text_tokenizer=tok)
        out = []
        for i, (a, b) in enumerate(prompts):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}]
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
            if i == len(prompts) - 1:  # force the call: prefill the start of the tool call
                ids = list(ids) + tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "',
                                             add_special_tokens=False)
            s = Sample(f"g{i}", i, 0, list(ids), label=str(a + b), metadata=json.dumps({"task": "arith"}))
            out += await fn(args, s, params)
        return out
