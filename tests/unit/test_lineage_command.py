"""The command line a fork prints: `flags_of(cfg)` parses back to the same config.

Pins: every kind of field survives the round trip (bools switched off, optional values set to
none, lists, empty lists, floats, strings that start with `--` or are empty). Guards: a fork whose printed
command would continue the run with other settings than the ones it recorded.
"""

from __future__ import annotations

from miles_core.config import RunConfig, parse_flags, replace_fields
from miles_core.lineage.command import flags_of, overrides


def test_flags_of_round_trips_every_kind_of_field():
    cfg = replace_fields(RunConfig(), run_id="b", storage_root="file:///tmp/x", progress=False, eps_clip=0.1,
                         eps_clip_high=0.3, max_weight_staleness=3, eval_prompt_data=[], eval_interval=None,
                         sglang_extra_args="--foo 1 --bar", save="", lr=1e-3 / 3)
    flags = flags_of(cfg)
    assert parse_flags(flags, check=False) == cfg
    assert "--no-progress" in flags and "--max-weight-staleness=3" in flags


def test_flags_of_the_default_is_empty_and_a_preset_is_listed_as_its_values():
    assert flags_of(RunConfig()) == []
    cfg = parse_flags(["--preset", "smollm2-arith"], check=False)
    flags = flags_of(cfg)
    assert not any(f.startswith("--preset") for f in flags)
    assert replace_fields(parse_flags(flags, check=False), preset=cfg.run.preset) == cfg


def test_overrides_name_the_flags_that_changed():
    base = RunConfig()
    assert overrides(base, replace_fields(base, run_id="x", kl_loss_coef=0.1)) == {"--kl-loss-coef": [0.0, 0.1]}

