"""The validation matrix (docs/configuration.md): every rule in miles_core/config/rules.py and miles_core/prepare/checks.py, both sides.

Each case is (overrides that break the rule, overrides that satisfy it, flags the error must name).
The valid side must pass `validate` with no problem at all, so a case also guards against a rule
that fires too eagerly. Cases start from the embedded default (embedded_default()), which is itself valid.
"""

from __future__ import annotations

import dataclasses

import pytest

from miles_core.config import ConfigError, RunConfig, embedded_default, parse_flags, replace_fields
from miles_core.prepare.checks import validate

EVAL_DS = ["heldout=builtin:reverse4-heldout"]
SYNC = {"fully_async": False}

# id -> (invalid overrides, valid overrides, substrings the error must contain)
RULES: dict[str, tuple[dict, dict, list[str]]] = {
    # ------------------------------------------------------------------ fully async exclusions
    # (the features are not supported by the sync drivers either: the fix is dropping the flag)
    "async-colocate": ({"colocate": True}, {"colocate": False}, ["--fully-async", "--colocate", "not supported"]),
    "async-partial-rollout": ({"partial_rollout": True}, {"partial_rollout": False},
                              ["--fully-async", "--partial-rollout", "not supported"]),
    "async-abort-pause": ({"pause_generation_mode": "abort"}, {"pause_generation_mode": "abort", **SYNC},
                          ["--fully-async", "--pause-generation-mode=abort"]),
    "async-prefill-recompute": ({"prefill_logprob_recompute": True}, {"prefill_logprob_recompute": False},
                                ["--fully-async", "--prefill-logprob-recompute", "not supported"]),
    "async-all-samples-hook": ({"rollout_all_samples_process_path": "builtins:print"},
                               {"rollout_all_samples_process_path": ""},
                               ["--fully-async", "--rollout-all-samples-process-path", "not supported"]),
    "async-rollout-function": ({"rollout_function_path": "builtins:print"}, {"rollout_function_path": ""},
                               ["--fully-async", "--rollout-function-path", "not supported"]),
    "async-multi-lora": ({"multi_lora": True}, {"multi_lora": False},
                         ["--fully-async", "--multi-lora", "not supported"]),
    "async-vs-one-step-off": ({"one_step_off": True}, {"one_step_off": True, **SYNC},
                              ["--fully-async", "--one-step-off"]),
    # ------------------------------------------------------------------ concurrency and placement
    "concurrency-ge-n": ({"async_max_concurrent_samples": 7, "n_samples_per_prompt": 8},
                         {"async_max_concurrent_samples": 8, "n_samples_per_prompt": 8},
                         ["--async-max-concurrent-samples=7", "--n-samples-per-prompt=8"]),
    "tp-divides-ranks": ({"actor_num_gpus_per_node": 3, "tensor_model_parallel_size": 2},
                         {"actor_num_gpus_per_node": 4, "tensor_model_parallel_size": 2},
                         ["--tensor-model-parallel-size=2", "--actor-num-nodes x --actor-num-gpus-per-node"]),
    "pipeline-parallel-refused": ({"pipeline_model_parallel_size": 2}, {"pipeline_model_parallel_size": 1},
                                  ["--pipeline-model-parallel-size=2", "not supported"]),
    "context-parallel-refused": ({"context_parallel_size": 2}, {"context_parallel_size": 1},
                                 ["--context-parallel-size=2", "not supported"]),
    "bucket-size-positive": ({"update_weight_buffer_size": 0}, {"update_weight_buffer_size": 1},
                             ["--update-weight-buffer-size=0"]),
    "eval-gpus-need-dedicated": ({"eval_num_gpus": 1}, {"eval_num_gpus": 1, "eval_mode": "dedicated"},
                                 ["--eval-num-gpus=1", "--eval-mode=dedicated"]),
    "dedicated-needs-gpus": ({"eval_mode": "dedicated"}, {"eval_mode": "dedicated", "eval_num_gpus": 2},
                             ["--eval-mode=dedicated", "--eval-num-gpus"]),
    # ------------------------------------------------------------------ losses
    "rollout-logprobs-excludes-tis": ({"use_tis": True}, {"use_tis": True, "use_rollout_logprobs": False},
                                      ["--use-rollout-logprobs", "--use-tis"]),
    "ppo-not-supported": ({"advantage_estimator": "ppo"}, {"advantage_estimator": "grpo"},
                          ["--advantage-estimator=ppo", "not supported", "--advantage-estimator=grpo"]),
    "ppo-not-supported-sync": ({"advantage_estimator": "ppo", "use_rollout_logprobs": False, **SYNC},
                               {"advantage_estimator": "grpo", "use_rollout_logprobs": False, **SYNC},
                               ["--advantage-estimator=ppo", "not supported"]),
    "grpo-needs-group": ({"n_samples_per_prompt": 1}, {"n_samples_per_prompt": 2},
                         ["--advantage-estimator=grpo", "--n-samples-per-prompt"]),
    "kl-coef-non-negative": ({"use_kl_loss": True, "kl_loss_coef": -0.1}, {"use_kl_loss": True, "kl_loss_coef": 0.0},
                             ["--kl-loss-coef", ">= 0"]),
    "global-batch-divides-rollout": ({"global_batch_size": 48}, {"global_batch_size": 64},
                                     ["--global-batch-size=48", "must divide", "256"]),
    "global-batch-positive": ({"global_batch_size": 0}, {"global_batch_size": 256}, ["--global-batch-size=0", ">= 1"]),
    "unknown-packaged-model": ({"hf_checkpoint": "import:nope"}, {"hf_checkpoint": "import:smollm2-135m-instruct"},
                               ["--hf-checkpoint", "import:nope", "import:smollm2-135m-instruct"]),
    # ------------------------------------------------------------------ save / eval
    "save-interval-needs-save": ({"save": ""}, {"save": "", "save_interval": None}, ["--save-interval", "--save"]),
    "save-hf-needs-save": ({"save": "", "save_interval": None, "save_hf": "/tmp/hf"},
                           {"save": "", "save_interval": None, "save_hf": ""}, ["--save-hf", "--save"]),
    "eval-interval-needs-datasets": ({"eval_interval": 10, "eval_prompt_data": []},
                                     {"eval_interval": 10, "eval_prompt_data": EVAL_DS},
                                     ["--eval-interval", "--eval-prompt-data"]),
    "reuse-mode-divisible": (
        {"save_hf": "/tmp/hf", "save_interval": 20, "eval_interval": 30, "eval_prompt_data": EVAL_DS},
        {"save_hf": "/tmp/hf", "save_interval": 20, "eval_interval": 40, "eval_prompt_data": EVAL_DS},
        ["--eval-interval % --save-interval == 0", "30 % 20 = 10", "--save-hf"]),
    "export-mode-any-interval": (  # the divisibility rule applies to reuse mode only
        {"save_hf": "/tmp/hf", "save_interval": 20, "eval_interval": 30, "eval_prompt_data": EVAL_DS},
        {"save_interval": 20, "eval_interval": 30, "eval_prompt_data": EVAL_DS},
        ["--eval-interval % --save-interval"]),
    "reuse-mode-needs-save-interval": (
        {"save_hf": "/tmp/hf", "save_interval": None, "eval_interval": 10, "eval_prompt_data": EVAL_DS},
        {"save_hf": "/tmp/hf", "save_interval": 10, "eval_interval": 10, "eval_prompt_data": EVAL_DS},
        ["--save-hf", "--eval-interval", "--save-interval"]),
    "reuse-excludes-export": ({"save_hf": "/tmp/hf", "eval_hf_dir": "/tmp/snap"}, {"eval_hf_dir": "/tmp/snap"},
                              ["--save-hf", "--eval-hf-dir"]),
    # ------------------------------------------------------------------ names
    "run-id-dotdot": ({"run_id": "a..b"}, {"run_id": "a.b"}, ["--run-id", "'..'"]),
    "run-id-slash": ({"run_id": "a/b"}, {"run_id": "a-b"}, ["--run-id", "'/'"]),
    "run-id-control": ({"run_id": "a\x07b"}, {"run_id": "a_b"}, ["--run-id", "control"]),
    "run-id-empty": ({"run_id": ""}, {"run_id": "x"}, ["--run-id", "empty"]),
    "eval-data-format": ({"eval_prompt_data": ["heldout"]}, {"eval_prompt_data": EVAL_DS},
                         ["--eval-prompt-data", "name=uri"]),
    "eval-data-name": ({"eval_prompt_data": ["x..y=builtin:reverse4"]}, {"eval_prompt_data": ["x=builtin:reverse4"]},
                       ["--eval-prompt-data", "'..'"]),
    "eval-data-duplicate": ({"eval_prompt_data": EVAL_DS * 2},
                            {"eval_prompt_data": EVAL_DS + ["other=builtin:copy4"]},
                            ["--eval-prompt-data", "given twice"]),
    "eval-data-builtin": ({"eval_prompt_data": ["x=builtin:nope"]}, {"eval_prompt_data": ["x=builtin:copy4"]},
                          ["--eval-prompt-data", "builtin:reverse4-heldout"]),
    "zero-engines-need-producers": ({"rollout_num_engines": 0},
                                    {"rollout_num_engines": 0, "allow_rollout_producers": True},
                                    ["--rollout-num-engines=0", "--allow-rollout-producers"]),
    "staleness-zero-needs-sync": ({"max_weight_staleness": 0},
                                  {"max_weight_staleness": 0, "fully_async": False},
                                  ["--max-weight-staleness=0", "--fully-async"]),
    "prompt-data-builtin": ({"prompt_data": "builtin:nope"}, {"prompt_data": "builtin:copy4"},
                            ["--prompt-data", "builtin:reverse4"]),
    "hf-checkpoint-builtin": ({"hf_checkpoint": "builtin:nope"}, {"hf_checkpoint": "builtin:tiny-llama"},
                              ["--hf-checkpoint", "builtin:tiny-gpt"]),
}

# The miles features this project does not implement: refused by name under the other drivers too.
UNSUPPORTED = {"colocate": True, "partial_rollout": True, "prefill_logprob_recompute": True,
               "rollout_all_samples_process_path": "builtins:print", "rollout_function_path": "builtins:print",
               "multi_lora": True}
for _field, _value in UNSUPPORTED.items():
    _flag = "--" + _field.replace("_", "-")
    RULES[f"sync-{_field}"] = ({_field: _value, **SYNC}, SYNC, [_flag, "not supported", "sync driver"])
    RULES[f"one-step-off-{_field}"] = ({_field: _value, **SYNC, "one_step_off": True}, {**SYNC, "one_step_off": True},
                                      [_flag, "not supported", "one-step-off driver"])

# (field, flag, invalid value, valid value): the range checks.
RANGES = [
    ("num_rollout", "--num-rollout", 0, 1),
    ("segment_steps", "--segment-steps", 0, 1),
    ("rollout_batch_size", "--rollout-batch-size", 0, 1),
    ("n_samples_per_prompt", "--n-samples-per-prompt", 0, 2),
    ("rollout_max_response_len", "--rollout-max-response-len", 0, 1),
    ("rollout_temperature", "--rollout-temperature", -0.1, 0.0),
    ("max_weight_staleness", "--max-weight-staleness", -1, 1),
    ("update_weights_interval", "--update-weights-interval", 0, 1),
    ("rollout_num_engines", "--rollout-num-engines", 0, 1),
    ("rollout_num_engines", "--rollout-num-engines", -1, 1),
    ("micro_batch_size", "--micro-batch-size", 0, 1),
    ("save_interval", "--save-interval", 0, 1),
    ("eval_keep_snapshots", "--eval-keep-snapshots", -1, 0),
    ("eval_max_in_flight", "--eval-max-in-flight", 0, 1),
    ("eval_num_gpus", "--eval-num-gpus", -1, 0),
    ("n_samples_per_eval_prompt", "--n-samples-per-eval-prompt", 0, 1),
    ("deadline_seconds", "--deadline-seconds", 0.0, 0.5),
    ("rollout_top_p", "--rollout-top-p", 0.0, 1.0),
    ("rollout_top_p", "--rollout-top-p", 1.01, 0.01),
    ("lr", "--lr", 0.0, 1e-6),
    ("async_data_buffer_capacity_factor", "--async-data-buffer-capacity-factor", 0.0, 0.04),
    ("async_data_buffer_capacity_factor", "--async-data-buffer-capacity-factor", 0.01, 1.0),  # capacity 0 groups
    ("buffer_coalesce_seconds", "--buffer-coalesce-seconds", -0.01, 0.0),
    ("tis_clip_low", "--tis-clip-low", -0.1, 0.0),
    ("tis_clip_low", "--tis-clip-low", 2.0, 1.99),
]


def _cfg(**overrides) -> RunConfig:
    return replace_fields(embedded_default(), **overrides)


def _problems(cfg: RunConfig) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    return str(info.value)


def test_embedded_default_is_valid():
    """Pins: the empty command line is a valid, runnable config (docs/quickstart.md).
    Guards: a new field or rule that makes `pyflyte run ... fully_async_rl` with no args fail."""
    cfg = embedded_default()
    assert validate(cfg) is cfg
    assert cfg.driver == "fully-async"


@pytest.mark.parametrize("case", sorted(RULES))
def test_rule_invalid_side_names_flags(case):
    """Pins: each validation rule fires and its message names every offending flag.
    Guards: a rule silently dropped or an error that no longer says which flag to change."""
    bad, _, must_name = RULES[case]
    message = _problems(_cfg(**bad))
    for text in must_name:
        assert text in message, f"{case}: {text!r} not in {message!r}"


@pytest.mark.parametrize("case", sorted(RULES))
def test_rule_valid_side_passes(case):
    """Pins: the fix each rule's message suggests really yields a valid config.
    Guards: a rule that fires too eagerly (refusing a legitimate combination)."""
    _, good, _ = RULES[case]
    validate(_cfg(**good))


@pytest.mark.parametrize("field,flag,bad,good", RANGES, ids=[f"{r[0]}={r[2]}" for r in RANGES])
def test_range_checks(field, flag, bad, good):
    """Pins: every numeric range check rejects its out-of-range value naming the flag and accepts
    the boundary value. Guards: off-by-one bounds (>= vs >) and checks lost in a refactor."""
    message = _problems(_cfg(**{field: bad}))
    assert flag in message
    validate(_cfg(**{field: good}))


def test_every_problem_reported_at_once():
    """Pins: validate collects all problems into one ConfigError (STYLE d), one line per problem.
    Guards: a fail-fast validator that makes users fix flags one run at a time."""
    cfg = _cfg(colocate=True, multi_lora=True, use_tis=True, rollout_batch_size=0, run_id="a/b",
               eval_interval=5, eval_prompt_data=[])
    message = _problems(cfg)
    for flag in ("--colocate", "--multi-lora", "--use-tis", "--rollout-batch-size", "--run-id",
                 "--eval-interval"):
        assert flag in message
    assert message.startswith("invalid configuration:")
    assert message.count("\n  - ") >= 6


def test_validate_does_not_rewrite_config():
    """Pins: validate returns the very object it was given and derives values through properties.
    Guards: slime-style validators that overwrite fields the user set (STYLE g2)."""
    cfg = _cfg(fully_async=False, rollout_submission_granularity=None)
    before = dataclasses.asdict(cfg)
    assert validate(cfg) is cfg
    assert dataclasses.asdict(cfg) == before
    assert cfg.submission_granularity == "group" and cfg.rollout.rollout_submission_granularity is None


def test_config_error_is_value_error_with_message_only_constructor():
    """Pins: ConfigError is a ValueError built from a message alone (so Ray can re-raise it typed).
    Guards: extra constructor arguments that break pickling across Ray workers."""
    import pickle

    e = ConfigError("--x is wrong")
    assert isinstance(e, ValueError)
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is ConfigError and str(again) == "--x is wrong"


def test_parse_flags_validates_by_default():
    """Pins: parse_flags runs validate unless check=False, so the CLI and Flyte inputs share the rules.
    Guards: a parse path that returns an unchecked config to a launcher."""
    with pytest.raises(ConfigError, match="--colocate"):
        parse_flags(["--preset", "tiny-reverse4", "--colocate"])
    assert parse_flags(["--preset", "tiny-reverse4", "--colocate"], check=False).run.colocate is True


def test_wrong_value_types_are_config_errors():
    """Pins: a field of the wrong type (e.g. a string from a hand-written JSON or Flyte input) is a
    ConfigError naming the flag, not a TypeError from a comparison. Guards: stack traces on bad input (§14)."""
    message = _problems(_cfg(rollout_batch_size="8", fully_async="yes", lr=None))
    assert "--rollout-batch-size" in message and "int" in message
    assert "--fully-async" in message and "--lr" in message
    validate(_cfg(lr=1))  # an int where a float is expected is fine
