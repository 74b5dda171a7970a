"""A calculator tool for a real chat model: the example tool environment of docs/agentic.md.

    --custom-generate-function-path miles_core.rollout.calculator_tool:calculator_episode

For an instruct model with a ChatML chat template (SmolLM2-135M-Instruct of `--preset
smollm2-arith`), on text prompts already rendered with the template (`--apply-chat-template`).
The model calls the tool Hermes-style, the convention of ChatML tool use:

    <tool_call>{"name": "calculator", "arguments": {"expression": "63 + 11"}}</tool_call>

Each turn stops at `</tool_call>` or the end of the assistant turn. When the turn holds a call, the
environment closes the assistant turn if it is open and answers as a `tool` message in the
template's format, then opens the next assistant turn (all masked out of the loss):

    <|im_end|>\n<|im_start|>tool\n{"result": 74}<|im_end|>\n<|im_start|>assistant\n

At most `MAX_TOOL_CALLS` calls per episode. The tool runs off the event loop under
`TOOL_TIMEOUT_SECONDS`: a tool that raises or does not answer in time answers the model with an
`{"error": ...}` message like any bad call, the episode goes on, and the sample's metadata counts it
(`"tool": {"calls", "errors", "timeouts"}`): a failing tool is an outcome of the episode, never a
failed group. The reward is set from the final assistant turn only
(`arith_reward` for `task = arith` rows), so the tool's own output can never be what gets scored;
other tasks leave it to the configured reward. `--preset smollm2-calculator` trains SmolLM2-135M to use
it (docs/agentic.md); `calculator_episode_unmasked` is the masking-bug control of its bench.
"""

from __future__ import annotations

import ast
import json
import operator

from miles_core.rollout.arith import arith_reward
from miles_core.rollout.episodes import append_environment, append_generated
from miles_core.samples import Sample, SampleStatus

MAX_TOOL_CALLS = 2
TOOL_TIMEOUT_SECONDS = 5.0
CALL_OPEN = "<tool_call>"
END_OF_TURN = "<|im_end|>"
ASSISTANT = "<|im_start|>assistant\n"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float | int:
    """Arithmetic on numbers with + - * / and parentheses; anything else raises ValueError."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e}") from e
    return int(value) if float(value).is_integer() else round(value, 6)


def tool_result(call_text: str) -> dict:
    """The tool's answer to one call (a JSON object): {"result": ...} or {"error": ...}."""
    try:
        call = json.loads(call_text)
        if call.get("name") != "calculator":
            return {"error": f"unknown tool {call.get('name')!r}; the only tool is calculator"}
        return {"result": calculate(str(call.get("arguments", {}).get("expression", "")))}
    except (ValueError, AttributeError, TypeError) as e:
        return {"error": str(e)}


def tool_message(result: dict, turn_closed: bool) -> str:
    """The environment's text after a call: the template's `tool` message and the next assistant header."""
    close = "" if turn_closed else END_OF_TURN + "\n"
    return f"{close}<|im_start|>tool\n{json.dumps(result)}{END_OF_TURN}\n{ASSISTANT}"


def find_call(turn: str) -> str | None:
    """The JSON object of the turn's `<tool_call>`: the first complete object after the tag, whether
    or not `</tool_call>` follows (a small model often writes the call right and goes on without closing
    the tag: SmolLM2-135M-Instruct, its call's opening prefilled, wrote the right expression for 16 of 16
    unseen sums and closed the tag for none); None without a tag or a complete object."""
    at = turn.find(CALL_OPEN)
    if at < 0:
        return None
    rest = turn[at + len(CALL_OPEN):].lstrip()
    try:
        obj, end = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    return rest[:end] if isinstance(obj, dict) else None


async def run_tool(call_text: str) -> tuple[dict, str]:
    """The tool's answer to one call and how it went ("ok", "error": a bad call or a tool that raised,
    "timeout"), the tool run in a thread so a slow one never holds the event loop."""
    import asyncio

    limit = TOOL_TIMEOUT_SECONDS
    try:
        result = await asyncio.wait_for(asyncio.to_thread(tool_result, call_text), limit)
    except asyncio.TimeoutError:
        return {"error": f"the calculator did not answer within {limit:g} s"}, "timeout"
    except Exception as e:  # noqa: BLE001 - a tool's own failure is the episode's outcome, not a crash
        return {"error": f"the calculator failed: {type(e).__name__}: {e}"}, "error"
    return result, "error" if "error" in result else "ok"


async def calculator_episode(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """Model turns with calculator calls answered in between (module docstring)."""
    return await _episode(args, sample, sampling_params, environment_in_loss=False)


async def calculator_episode_unmasked(args, sample: Sample, sampling_params: dict,
                                      evaluation: bool = False) -> Sample:
    """The control with the masking bug: the tool's messages left in the loss, as if the model had
    written them (run it with --no-use-rollout-logprobs: they have no rollout log-probs)."""
    return await _episode(args, sample, sampling_params, environment_in_loss=True)


async def _episode(args, sample: Sample, sampling_params: dict, environment_in_loss: bool) -> Sample:
    tok = args.tokenizer()
    params = {**sampling_params, "stop": ["</tool_call>"]}
    turn = ""
    counts = {"calls": 0, "errors": 0, "timeouts": 0}
    for call_index in range(MAX_TOOL_CALLS + 1):
        result = await args.engine.generate(list(sample.prompt_ids) + sample.response_ids, params)
        append_generated(sample, result)
        turn = _assistant_turn(tok, sample)
        call = find_call(turn)
        if sample.status != SampleStatus.COMPLETED or call is None or call_index == MAX_TOOL_CALLS:
            break
        answer, outcome = await run_tool(call)
        counts["calls"] += 1
        if outcome != "ok":
            counts["errors" if outcome == "error" else "timeouts"] += 1
        env = tool_message(answer, turn_closed=turn.rstrip().endswith(END_OF_TURN))
        env_ids = tok.encode(env, add_special_tokens=False)
        append_environment(sample, env_ids)
        if environment_in_loss:
            sample.loss_mask[-len(env_ids):] = [1] * len(env_ids)
    sample.metadata = _with_tool_counts(sample.metadata, counts)
    if sample.status != SampleStatus.ABORTED and _task(sample) == "arith":
        sample.reward = arith_reward(sample, turn.replace(END_OF_TURN, ""))
    return sample


def _with_tool_counts(metadata: str | None, counts: dict) -> str:
    """The sample's metadata (a JSON object, kept as it is otherwise) with the episode's tool counts."""
    try:
        meta = json.loads(metadata or "{}")
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        meta = {"metadata": metadata}
    return json.dumps({**meta, "tool": counts})


def _assistant_turn(tok, sample: Sample) -> str:
    """The text of the current assistant turn (prompt and response so far, after the last assistant
    header): a call the prompt prefilled counts as the model's."""
    text = tok.decode(list(sample.prompt_ids) + sample.response_ids, skip_special_tokens=False)
    return text.rsplit(ASSISTANT, 1)[-1]


def _task(sample: Sample) -> str:
    try:
        meta = json.loads(sample.metadata or "{}")
    except ValueError:
        return ""
    return meta.get("task", "") if isinstance(meta, dict) else ""
