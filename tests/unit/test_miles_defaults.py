"""miles' defaults, not the toy's (docs/configuration.md).

Pins: every flag miles has takes miles' default (radixark/miles `miles/utils/arguments.py`, and
Megatron's for the optimizer flags miles does not reset); the flags miles requires are required
here, refused in one line that names each one and the presets that set them; the embedded default
is the preset tiny-reverse4 and holds the toy's values; `miles validate` warns when a pretrained
model meets settings only the toy wants (and never for a builtin tiny model or the presets);
the CPU engine takes SGLang's `max_new_tokens: null` (up to the position limit), which an unset
--rollout-max-response-len sends; the builtin datasets read their own columns whatever
--input-key / --label-key say (miles' default --input-key is "input").
"""

from __future__ import annotations

import pytest

from miles_core.cli import main
from miles_core.config import ConfigError, RunConfig, embedded_default, parse_flags
from miles_core.config.presets import PRESETS
from miles_core.prepare.checks import setting_warnings

# flag -> miles' default (None: miles leaves it unset)
MILES = {
    "--lr": 1e-6, "--seed": 1234, "--fully-async": False, "--rollout-shuffle": False,
    "--n-samples-per-prompt": 1, "--rollout-max-response-len": None, "--max-weight-staleness": None,
    "--use-rollout-logprobs": False, "--actor-num-gpus-per-node": 8, "--micro-batch-size": 1,
    "--save-interval": None, "--eval-interval": None, "--eval-temperature": None, "--eval-keep-snapshots": 2,
    "--input-key": "input", "--label-key": "", "--wandb-project": "", "--wandb-mode": None,
    "--weight-decay": 0.01, "--clip-grad": 1.0, "--rollout-temperature": 1.0, "--eval-prompt-data": [],
}
REQUIRED = ["--hf-checkpoint", "--prompt-data", "--rollout-batch-size", "--num-rollout"]
A_RUN = ["--hf-checkpoint", "builtin:tiny-llama", "--prompt-data", "builtin:copy4", "--rollout-batch-size", "4",
         "--num-rollout", "3", "--n-samples-per-prompt", "2"]


def _value(cfg: RunConfig, flag: str):
    name = flag[2:].replace("-", "_")
    for section in ("run", "model", "data", "rollout", "buffer", "engine", "train", "eval", "metrics"):
        if hasattr(getattr(cfg, section), name):
            return getattr(getattr(cfg, section), name)
    raise KeyError(flag)


@pytest.mark.parametrize("flag", sorted(MILES))
def test_every_flag_takes_miles_default(flag):
    assert _value(RunConfig(), flag) == MILES[flag]


def test_an_empty_command_line_is_refused_naming_every_required_flag_and_the_presets():
    with pytest.raises(ConfigError) as info:
        parse_flags([])
    msg = str(info.value)
    assert all(flag in msg for flag in REQUIRED) and "--preset tiny-reverse4" in msg and "required" in msg
    with pytest.raises(ConfigError, match="--rollout-batch-size is required"):
        parse_flags([w for w in A_RUN if w not in ("--rollout-batch-size", "4")])


def test_a_run_with_the_required_flags_parses_on_miles_defaults():
    cfg = parse_flags(A_RUN)
    assert cfg.train.lr == 1e-6 and cfg.rollout.rollout_max_response_len is None and not cfg.run.fully_async
    assert cfg.eval.eval_prompt_data == ["heldout=builtin:copy4-heldout"] or cfg.eval.eval_prompt_data == []


def test_the_embedded_default_is_the_preset_and_holds_the_toys_values():
    for cfg in (embedded_default(), parse_flags(["--preset", "tiny-reverse4"])):
        assert cfg.run.preset == "tiny-reverse4"
        assert (cfg.train.lr, cfg.rollout.rollout_max_response_len, cfg.rollout.rollout_batch_size,
                cfg.rollout.n_samples_per_prompt, cfg.train.micro_batch_size, cfg.run.fully_async,
                cfg.run.seed) == (0.002, 5, 32, 8, 256, True, 1)
        assert cfg.eval.eval_prompt_data == ["heldout=builtin:reverse4-heldout"] and cfg.eval.eval_interval == 40
    assert parse_flags(["--preset", "tiny-reverse4", "--lr", "0.01"]).train.lr == 0.01  # flags win


def test_validate_warns_when_a_pretrained_model_meets_toy_settings(tmp_path):
    from miles_core.config import replace_fields

    pretrained = replace_fields(parse_flags(A_RUN, check=False), hf_checkpoint=str(tmp_path), lr=2e-3, rollout_max_response_len=5,
                                micro_batch_size=256)
    warnings = setting_warnings(pretrained)
    assert len(warnings) == 3, warnings
    assert any(w.startswith("--lr 0.002") for w in warnings)
    assert any(w.startswith("--rollout-max-response-len 5") for w in warnings)
    assert any(w.startswith("--micro-batch-size 256") for w in warnings)
    assert setting_warnings(replace_fields(pretrained, use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                                           lr=1e-6, rollout_max_response_len=1024)) == []
    assert setting_warnings(embedded_default()) == []  # a builtin tiny model is the toy
    assert setting_warnings(parse_flags(["--preset", "smollm2-arith"], check=False)) == []


def test_miles_validate_prints_the_warnings(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2).to_json_file(str(tmp_path / "config.json"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    assert main(["validate", "--hf-checkpoint", str(tmp_path), "--prompt-data", str(data), "--rollout-batch-size", "2",
          "--num-rollout", "1", "--n-samples-per-prompt", "2", "--lr", "0.002", "--custom-rm-path",
          "tests.unit.test_miles_defaults:reward"]) == 0
    err = capsys.readouterr().err
    assert "miles validate: warning: --lr 0.002 on a pretrained model" in err


def reward(sample):  # a reward for the validate test's rows
    return 0.0


def test_presets_set_every_required_flag():
    for name, values in PRESETS.items():
        cfg = parse_flags(["--preset", name], check=False)
        assert all(_value(cfg, f) not in (None, "") for f in REQUIRED), name


def test_the_cpu_engine_takes_sglangs_null_max_new_tokens():
    import torch

    from miles_core.engines.batching import DEFAULT_MAX_NEW_TOKENS, BatchEngine, Request, SamplingParams
    from miles_core.engines.model import CausalLM
    from miles_core.models.builtin import materialize_checkpoint

    assert SamplingParams.from_json({"max_new_tokens": None}).max_new_tokens is None
    assert SamplingParams.from_json({}).max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        engine = BatchEngine(CausalLM.load(materialize_checkpoint("builtin:tiny-gpt", 3, d)))
    torch.manual_seed(0)
    engine.add(Request("n", [1] * 20 + [10], SamplingParams(max_new_tokens=None, ignore_eos=True)))
    finish, tokens = None, 0
    while finish is None:
        for ev in engine.step():
            tokens += ev.token is not None
            finish = ev.finish or finish
    assert finish == {"type": "length", "length": 32 - 21} and tokens == 11  # up to the 32 positions


def test_builtin_datasets_read_their_own_columns_whatever_input_key_says():
    from miles_core.prepare.dataset import BUILTIN_COLUMNS, columns

    assert columns("builtin:reverse4", "input", "") == BUILTIN_COLUMNS
    assert columns("/data/mine.jsonl", "input", "") == ("input", "")
    assert (RunConfig().data.input_key, RunConfig().data.label_key) == ("input", "")  # miles' defaults
    from miles_core.prepare.dataset import prepare_dataset
    from miles_core.storage import Store

    info = prepare_dataset(parse_flags(A_RUN).data, Store("memory://defaults-columns"))
    assert info.num_rows > 0  # builtin:copy4 read with its own columns, --input-key input notwithstanding
