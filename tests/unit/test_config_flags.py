"""Flag parsing, unknown-flag suggestions, JSON round trips and immutability of RunConfig (docs/configuration.md).

The property tests generate values for every field in flag_table(), so a new field with a type the
parser or the JSON codec cannot carry fails here without anyone writing a test for it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_from_json,
    config_to_dict,
    config_to_json,
    embedded_default,
    flag_table,
    parse_flags,
    replace_fields,
)
from miles_core.prepare.checks import validate

SPECS = flag_table()
# Values for free-text fields: argparse reads a leading '-' as an option, so keep to `--flag=value`
# (which carries any text) and keep list items free of a leading '-'.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20).filter(
    lambda t: t != "--")  # argparse drops a bare "--" value (its end-of-options marker)
LIST_ITEM = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:=/-]{0,15}", fullmatch=True)


def _value_strategy(spec):
    if spec.name == "custom_config_path":  # names a file that is read (tests/unit/test_corrections.py)
        return st.just("")
    if spec.choices:
        base = st.sampled_from(spec.choices)
    elif spec.kind == "bool":
        base = st.booleans()
    elif spec.kind == "int":
        base = st.integers(-(2**40), 2**40)
    elif spec.kind == "float":
        base = st.floats(allow_nan=False, allow_infinity=False, width=64)
    elif spec.kind == "list":
        base = st.lists(LIST_ITEM, max_size=3)
    else:
        base = TEXT
    return st.one_of(st.none(), base) if spec.optional else base


ALL_VALUES = st.fixed_dictionaries({s.name: _value_strategy(s) for s in SPECS})


def _to_flags(values: dict) -> list[str]:
    argv = []
    by_name = {s.name: s for s in SPECS}
    for name, v in values.items():
        s = by_name[name]
        if s.kind == "bool":
            argv.append(s.flag if v else "--no-" + s.flag[2:])
        elif s.kind == "list":
            argv += [s.flag, *v]
        elif v is None:
            argv.append(f"{s.flag}=none")
        else:
            argv.append(f"{s.flag}={v!r}" if s.kind == "float" else f"{s.flag}={v}")
    return argv


def _field_values(cfg: RunConfig) -> dict:
    return {s.name: getattr(getattr(cfg, s.section), s.name) for s in SPECS}


@settings(max_examples=60, deadline=None)
@given(ALL_VALUES)
def test_parse_flags_reproduces_every_field(values):
    """Pins: for random values of every field, parse_flags(flags for those values) gives back exactly
    those values (bools via --x/--no-x, optionals via 'none', lists via nargs).
    Guards: a field whose flag loses its value (type, choice or list handling) in the parser."""
    cfg = parse_flags(_to_flags(values), check=False)
    assert _field_values(cfg) == values


@settings(max_examples=40, deadline=None)
@given(
    st.fixed_dictionaries({
        "rollout_batch_size": st.integers(1, 4096),
        "n_samples_per_prompt": st.integers(2, 64),
        "lr": st.floats(1e-8, 1.0),
        "max_weight_staleness": st.one_of(st.none(), st.integers(1, 100)),  # 0 needs the sync driver
        "pause_generation_mode": st.sampled_from(["retract", "in_place"]),
        "async_unused_samples_handler": st.sampled_from(["drop", "retry"]),
        "rollout_top_p": st.floats(0.01, 1.0),
        "run_id": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,30}", fullmatch=True).filter(lambda s: ".." not in s),
    })
)
def test_parse_flags_valid_values_pass_validation(values):
    """Pins: random values inside the documented ranges parse, validate and come back unchanged.
    Guards: a validation rule narrower than the documented range."""
    cfg = parse_flags(["--preset", "tiny-reverse4", *_to_flags(values)])
    got = _field_values(cfg)
    assert {k: got[k] for k in values} == values


@settings(max_examples=60, deadline=None)
@given(ALL_VALUES)
def test_json_round_trip_any_values(values):
    """Pins: config_to_json -> config_from_json is the identity for any field values.
    Guards: config.json in the run root (docs/quickstart.md#where-the-run-lives) not resuming into the same config."""
    cfg = replace_fields(RunConfig(), **values)
    assert config_from_json(config_to_json(cfg)) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_json_is_stable_and_sorted():
    """Pins: the JSON is deterministic (sorted keys), so config.json diffs between segments are meaningful.
    Guards: dict-order-dependent output."""
    text = config_to_json(RunConfig())
    assert text == config_to_json(RunConfig())
    import json

    assert list(json.loads(text)) == sorted(json.loads(text))


def test_config_from_dict_rejects_unknown_keys_with_suggestion():
    """Pins: an unknown key in a section or an unknown section is a ConfigError suggesting the closest name.
    Guards: slime's 'setting it anyway' for unknown keys (STYLE d)."""
    with pytest.raises(ConfigError, match="did you mean 'rollout_batch_size'"):
        config_from_dict({"rollout": {"rollout_batch_sise": 3}})
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        config_from_dict({"rolout": {}})
    assert config_from_dict({}) == RunConfig()  # missing sections take defaults


def test_frozen_tree():
    """Pins: RunConfig and every section are frozen; changes go through replace_fields, which copies.
    Guards: components mutating the shared config after validation (STYLE a: setup leaves config alone)."""
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.rollout_batch_size = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout = cfg.rollout  # type: ignore[misc]
    new = replace_fields(cfg, rollout_batch_size=3, lr=0.1)
    assert (new.rollout.rollout_batch_size, new.train.lr) == (3, 0.1)
    assert cfg.rollout.rollout_batch_size is None and new.eval is cfg.eval  # required: no default
    for section in dataclasses.fields(cfg):
        assert type(getattr(cfg, section.name)).__dataclass_params__.frozen


@pytest.mark.parametrize(
    "argv,suggestion",
    [(["--rollout-batch-sise", "1"], "--rollout-batch-size"), (["--fully-asynch"], "--fully-async"),
     (["--no-fully-asyn"], "--no-fully-async"), (["--use-tiss=1"], "--use-tis"),
     (["--eval-interal", "5"], "--eval-interval")],
)
def test_unknown_flag_suggests_closest(argv, suggestion):
    """Pins: an unknown flag is a ConfigError with 'Did you mean <closest>?'.
    Guards: argparse's bare 'unrecognized arguments' or silently accepted prefixes (allow_abbrev)."""
    with pytest.raises(ConfigError) as info:
        parse_flags(["--preset", "tiny-reverse4", *argv])
    assert f"Did you mean {suggestion}?" in str(info.value)


def test_all_unknown_flags_reported_and_abbreviations_refused():
    """Pins: every unknown flag is listed at once; prefixes of real flags are not accepted.
    Guards: a typo'd flag shadowed by argparse abbreviation matching."""
    with pytest.raises(ConfigError) as info:
        parse_flags(["--preset", "tiny-reverse4", "--rollout-batch-sise", "3", "--zzzzqqq"])
    assert "--rollout-batch-sise" in str(info.value) and "--zzzzqqq" in str(info.value)
    assert "docs/reference/flags.md" in str(info.value)  # no close match: point at the reference
    with pytest.raises(ConfigError):
        parse_flags(["--preset", "tiny-reverse4", "--rollout-batch", "3"])


@pytest.mark.parametrize("argv", [["--rollout-batch-size", "many"], ["--pause-generation-mode", "stop"],
                                  ["--lr"], ["positional"]])
def test_bad_flag_values_are_config_errors(argv):
    """Pins: a bad value, a missing value or a stray positional is a ConfigError (never SystemExit).
    Guards: argparse calling sys.exit inside a Flyte task or a library caller."""
    with pytest.raises(ConfigError):
        parse_flags(["--preset", "tiny-reverse4", *argv])


def test_flag_forms():
    """Pins: the accepted spellings: `--x v`, `--x=v`, `--no-x`, `none` for optionals, lists by nargs,
    negative numbers, a base config underneath. Guards: regressions in the user-facing flag syntax."""
    cfg = parse_flags(["--preset", "tiny-reverse4", "--rollout-top-k", "-1", "--save-interval=none", "--no-rollout-shuffle",
                       "--eval-prompt-data", "a=builtin:copy4", "b=builtin:reverse4-heldout",
                       "--rollout-submission-granularity", "none", "--tis-clip", "3"])
    assert cfg.rollout.rollout_top_k == -1 and cfg.train.save_interval is None
    assert cfg.data.rollout_shuffle is False and cfg.train.tis_clip == 3.0
    assert cfg.eval.eval_prompt_data == ["a=builtin:copy4", "b=builtin:reverse4-heldout"]
    assert cfg.rollout.rollout_submission_granularity is None
    base = replace_fields(embedded_default(), lr=0.5)
    assert parse_flags(["--seed", "7"], base=base).train.lr == 0.5


def test_replace_fields_unknown_name():
    """Pins: replace_fields refuses an unknown field with the same suggestion as the CLI.
    Guards: Flyte inputs with a misspelt name being dropped silently."""
    with pytest.raises(ConfigError, match="Did you mean --rollout-batch-size"):
        replace_fields(RunConfig(), rollout_batch_sise=3)


def test_flag_table_shape():
    """Pins: flags are the kebab-case field names, unique across sections; every field has help text;
    defaults are the embedded default; the core miles flag names of docs/configuration.md exist.
    Guards: renamed or undocumented flags (flag names are interface, §12/STYLE b)."""
    flags = [s.flag for s in SPECS]
    assert len(flags) == len(set(flags))
    for s in SPECS:
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.help.strip(), f"{s.flag} has no help"
        assert getattr(getattr(RunConfig(), s.section), s.name) == s.default
    for name in ["--fully-async", "--rollout-batch-size", "--n-samples-per-prompt",
                 "--async-max-concurrent-samples", "--rollout-submission-granularity",
                 "--async-data-buffer-capacity-factor", "--max-weight-staleness",
                 "--async-unused-samples-handler", "--custom-async-data-buffer-path",
                 "--dynamic-sampling-filter-path", "--rollout-sample-filter-path", "--update-weights-interval",
                 "--pause-generation-mode", "--use-tis", "--tis-clip", "--tis-clip-low", "--use-rollout-logprobs",
                 "--eval-interval", "--save-interval", "--eval-hf-dir", "--save-hf", "--eval-keep-snapshots",
                 "--eval-max-in-flight", "--eval-overflow-policy", "--eval-num-gpus"]:
        assert name in flags


def test_derived_values():
    """Pins: the derived values of docs/fully-async.md (budget in groups, granularity default, capacity).
    Guards: drift between the documented formulas and the properties components read."""
    cfg = embedded_default()
    assert cfg.budget_groups == 32 and cfg.submission_granularity == "sample"
    assert cfg.buffer_capacity_groups == 64
    cfg = replace_fields(cfg, async_max_concurrent_samples=20, n_samples_per_prompt=8,
                         async_data_buffer_capacity_factor=0.5)
    assert cfg.budget_groups == 2 and cfg.buffer_capacity_groups == 16
    assert math.isclose(validate(cfg).buffer.async_data_buffer_capacity_factor, 0.5)
    assert cfg.run_uri.endswith("/runs/default") and cfg.run_uri.startswith("file://")
