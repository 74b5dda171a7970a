"""Command lines of the lineage commands: a config back into miles flags.

    flags_of(cfg)                  # ["--run-id=b", "--eps-clip=0.1", ...]: parse_flags(that) == cfg
    continue_command(cfg)          # the `pyflyte run ... --flags '...'` that trains that run
    changed_fields(a, b), overrides(base, cfg)   # what a derived config changes, by field / by flag

`flags_of` lists every field that differs from its default (the eval datasets and interval: from
those that follow its --prompt-data; never `--preset`: the resolved values
are listed instead, so a preset cannot re-set what the user changed back). Strings go as
`--flag=value`, so a value that starts with `--` is not read as a flag.
"""

from __future__ import annotations

import shlex
from typing import Any

from miles_core.config import RunConfig, config_to_dict, flag_table
from miles_core.config.sections import default_eval_interval, default_eval_prompt_data
from miles_core.driver.plan import WORKFLOW

FLAGS = {s.name: s.flag for s in flag_table()}  # field name -> --flag


def flags_of(cfg: RunConfig) -> list[str]:
    d = config_to_dict(cfg)
    # the eval fields' defaults follow the data (`parse_flags` resolves them from --prompt-data)
    followed = {"eval_prompt_data": default_eval_prompt_data(cfg.data.prompt_data),
                "eval_interval": default_eval_interval(cfg.eval.eval_prompt_data)}
    out: list[str] = []
    for spec in flag_table():
        value = d[spec.section][spec.name]
        if spec.name != "preset" and value != followed.get(spec.name, spec.default):
            out += _flag(spec, value)
    return out


def _flag(spec, value: Any) -> list[str]:
    if spec.kind == "bool":
        return [spec.flag if value else "--no-" + spec.flag[2:]]
    if value is None:
        return [f"{spec.flag}=none"]
    if spec.kind == "list":
        return [spec.flag, *map(str, value)]
    return [f"{spec.flag}={value!r}" if spec.kind == "float" else f"{spec.flag}={value}"]


def changed_fields(a: RunConfig, b: RunConfig) -> dict[str, tuple]:
    """field name -> (value in a, value in b), for every field that differs."""
    da, db = config_to_dict(a), config_to_dict(b)
    return {name: (da[sec][name], db[sec][name]) for sec in da for name in da[sec] if da[sec][name] != db[sec][name]}


def overrides(base: RunConfig, cfg: RunConfig) -> dict[str, list]:
    """--flag -> [base value, cfg value] for every setting cfg changes (the run id aside)."""
    return {FLAGS[name]: [old, new] for name, (old, new) in changed_fields(base, cfg).items() if name != "run_id"}


def continue_command(cfg: RunConfig) -> str:
    return f"{WORKFLOW} --flags {shlex.quote(shlex.join(flags_of(cfg)))}"

