"""reverse4 in two turns: the builtin multi-turn environment, a custom generate function (docs/agentic.md).

It exists to show that masking environment tokens is right and that a bug in it shows. On the
builtin digit model and the `builtin:reverse4` prompts (`d1 d2 d3 d4 <sep>`, label `d4d3d2d1`):

    turn 1 (model, up to 3 tokens, stops at <sep>):   d4 d3 <sep>
    environment (masked):                             c <sep>    c = how many of the 2 digits were right
    turn 2 (model, up to 3 tokens, stops at <eos>):   d2 d1 <eos>

reward = 0.8 x digits right / 4 + 0.1 x (<sep> ends turn 1 as its 3rd token) + 0.1 x (<eos> in place),
set by the function itself. Every turn terminator is rewarded: without the <sep> term the model
never learns to end turn 1 (the plain-torch probe, /work/shared/probes/multiturn-toy.md, levels off
at 0.84-0.91); with it, masked runs reach ~1.0 and runs with the environment tokens left in the
loss stay <= 0.84 after 200 steps.

    --custom-generate-function-path miles_core.rollout.multiturn:reverse4_two_turns

`reverse4_two_turns_unmasked` is the deliberately wrong control: the environment tokens stay in the
loss (loss_mask 1). The engine gives no log-prob for a token it did not generate, so they carry
rollout log-prob 0, and the control needs `--no-use-rollout-logprobs`: the trainer's own log-probs
(of the same weights, one optimizer step per batch) are then the PPO ratio denominator of every
token, as in the probe's control, and the only difference to the masked run is the two tokens.
"""

from __future__ import annotations

from miles_core.models.builtin import EOS_ID, SEP_ID
from miles_core.rollout.episodes import append_environment, append_generated
from miles_core.samples import Sample, SampleStatus

TURN_TOKENS = 3  # two digits and the turn's terminator


def turn_params(sampling_params: dict, stop_id: int) -> dict:
    """One turn: at most 3 tokens, stopping at `stop_id` only (turn 1 must not stop at <eos>)."""
    limit = min(TURN_TOKENS, int(sampling_params.get("max_new_tokens") or TURN_TOKENS))
    return {**sampling_params, "max_new_tokens": limit, "stop_token_ids": [stop_id], "ignore_eos": stop_id != EOS_ID}


def two_turn_reward(turn1: list[int], turn2: list[int], answer: list[int]) -> float:
    """0.8 x digits right / 4 + 0.1 x <sep> as turn 1's 3rd token + 0.1 x <eos> as turn 2's 3rd token."""
    said = turn1[:2] + [None] * (2 - len(turn1[:2])) + turn2[:2]
    right = sum(1 for got, want in zip(said, answer) if got == want)
    sep_ok = len(turn1) == TURN_TOKENS and turn1[-1] == SEP_ID
    eos_ok = len(turn2) == TURN_TOKENS and turn2[-1] == EOS_ID
    return 0.8 * right / 4 + 0.1 * sep_ok + 0.1 * eos_ok


def _answer(sample: Sample) -> list[int]:
    label = sample.label.strip()
    if len(label) != 4 or not label.isdigit():
        raise ValueError(f"reverse4_two_turns needs builtin:reverse4 prompts (a 4-digit label), got label {label!r}; "
                         "use --prompt-data builtin:reverse4")
    return [int(c) for c in label]


async def _episode(args, sample: Sample, sampling_params: dict, environment_in_loss: bool) -> Sample:
    answer = _answer(sample)
    first = await args.engine.generate(list(sample.prompt_ids), turn_params(sampling_params, SEP_ID))
    append_generated(sample, first)
    if sample.status == SampleStatus.ABORTED:
        return sample  # the group is rejected at put; nothing to score
    turn1 = list(first.output_ids)
    feedback = [sum(1 for got, want in zip(turn1[:2], answer[:2]) if got == want), SEP_ID]
    append_environment(sample, feedback)
    if environment_in_loss:  # the control: environment tokens left in the loss
        sample.loss_mask[-len(feedback):] = [1] * len(feedback)
    second = await args.engine.generate(list(sample.prompt_ids) + sample.response_ids,
                                        turn_params(sampling_params, EOS_ID))
    append_generated(sample, second)
    if sample.status != SampleStatus.ABORTED:
        sample.reward = two_turn_reward(turn1, list(second.output_ids), answer)
    return sample


async def reverse4_two_turns(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The builtin multi-turn environment (module docstring); environment tokens masked out of the loss."""
    return await _episode(args, sample, sampling_params, environment_in_loss=False)


async def reverse4_two_turns_unmasked(args, sample: Sample, sampling_params: dict,
                                      evaluation: bool = False) -> Sample:
    """The control with the masking bug: environment tokens in the loss (run it with --no-use-rollout-logprobs)."""
    return await _episode(args, sample, sampling_params, environment_in_loss=True)
