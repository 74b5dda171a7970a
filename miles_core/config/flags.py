"""Kebab-case flags -> RunConfig: the parser miles users know, presets first, explicit flags on top.

    cfg = parse_flags(["--preset", "tiny-reverse4", "--rollout-batch-size", "16"])   # checked by the config's rules
    cfg, problems = read_flags(argv)                     # the flags that parsed; the rest as problems

Every problem of a command line is reported at once: unknown flags, malformed values (a flag
without its value, a number that is not one, a value outside its choices) and, unless check=False,
the config's own rules (those that concern a flag whose value was malformed are left out: they
would judge its default). One problem is one line; several are the list `invalid configuration:`.

The checks that load plug-ins or read model specs run above the config
(`miles_core.prepare.checks.validate`).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from miles_core.config.presets import PresetError, preset_values
from miles_core.config.rules import rule_problems, type_problems
from miles_core.config.sections import EngineSection, RunSection, default_eval_interval, default_eval_prompt_data
from miles_core.config.tree import (
    SPECS_BY_NAME,
    ConfigError,
    FlagSpec,
    RunConfig,
    flag_table,
    known_flags,
    replace_fields,
    unknown_flag_message,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits; we want one typed error the caller can print
        raise ConfigError(message)


_MISSING = object()  # the value of a scalar flag given without one
_CONVERT = {"int": int, "float": float, "str": str}


def _build_parser() -> argparse.ArgumentParser:
    """Every flag, values kept as text (converted per flag afterwards, so every bad value is reported)."""
    p = _Parser(prog="miles", add_help=False, allow_abbrev=False)
    for s in flag_table():
        kw: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": s.help}
        if s.kind == "bool":
            p.add_argument(s.flag, action=argparse.BooleanOptionalAction, **kw)
        elif s.kind == "list":
            p.add_argument(s.flag, nargs="*", **kw)
        else:
            p.add_argument(s.flag, nargs="?", const=_MISSING, **kw)
    return p


def _convert(s: FlagSpec, text: Any) -> Any:
    """The value of flag `s` from its text; ValueError naming the flag when it is malformed."""
    if s.kind == "list":
        if any(t.lower() == "none" for t in text):  # `--flag none`: the empty list, as with no value
            if len(text) > 1:
                raise ValueError(f"argument {s.flag}: none means no values; it cannot be given with others "
                                 f"({' '.join(text)})")
            return []
        return text
    if s.kind == "bool":
        return text
    if text is _MISSING:
        raise ValueError(f"argument {s.flag}: expected one argument")
    if s.optional and text.lower() in (("none",) if s.choices else ("none", "")):
        return None
    if s.choices:
        if text not in s.choices:
            options = ", ".join(repr(c) for c in (*s.choices, *(["none"] if s.optional else [])))
            raise ValueError(f"argument {s.flag}: invalid choice: {text!r} (choose from {options})")
        return text
    try:
        return _CONVERT[s.kind](text)
    except ValueError:
        raise ValueError(f"argument {s.flag}: invalid {s.kind} value: {text!r}") from None


EMBEDDED_DEFAULT = "tiny-reverse4"


def embedded_default(**fields: Any) -> RunConfig:
    """The embedded default (`./dev run`): preset tiny-reverse4 over the flag defaults, then `fields`."""
    return replace_fields(RunConfig(), preset=EMBEDDED_DEFAULT, **{**preset_values(EMBEDDED_DEFAULT), **fields})


def parse_flags(argv: list[str], base: RunConfig | None = None, check: bool = True) -> RunConfig:
    """Flags -> RunConfig (on top of `base`, default: the flag defaults), checked by the config's own
    rules unless check=False; one ConfigError listing every problem."""
    cfg, problems = read_flags(argv, base)
    raise_flag_problems(problems, config_problems(cfg, problems) if check else [])
    return cfg


def read_flags(argv: list[str], base: RunConfig | None = None) -> tuple[RunConfig, list[str]]:
    """(the config of every flag that parsed, on top of `base`; the problems of the others)."""
    known = known_flags()  # once: flag_table() resolves type hints, too slow to redo per argument
    words = [a.split("=")[0] for a in argv if a.startswith("--")]
    problems = [unknown_flag_message(w) for w in words if w not in known]
    values, bad = _parse_values(argv)
    problems += bad
    if values.get("custom_config_path"):  # miles: the file's keys override the command line
        from_file, bad = config_file_values(values["custom_config_path"])
        values.update(from_file)
        problems += bad
    base = base or RunConfig()
    if values.get("preset"):  # the preset first, then every flag given explicitly on top
        try:
            base = replace_fields(base, **preset_values(values["preset"]))
        except PresetError as e:
            problems.append(str(e))
    cfg = replace_fields(base, **values)
    derived = {**_evals_follow_data(base, cfg, set(values)), **_cpus_follow_backend(base.run, cfg.engine, set(values))}
    return replace_fields(cfg, **derived), problems


# Ray CPUs of a trainer rank on a run with GPUs when --num-cpus-trainer is not given: the train task's
# GPU pods have 8 CPUs per GPU (tasks/cluster.py), shared by a rank with Ray's own processes and, on
# an engine node, the engines'. A rank's torch threads are its reserved CPUs (TrainerWorker), so rank
# 0's export of the weights (casts, safetensors, uploads) no longer runs on the one thread Ray's
# OMP_NUM_THREADS gives a 1-CPU actor.
GPU_TRAINER_CPUS = 4.0


def _cpus_follow_backend(base: RunSection, engine: EngineSection, given: set[str]) -> dict[str, Any]:
    """--num-cpus-trainer, when not given and `base` (the run section before the flags) keeps the declared
    default, is GPU_TRAINER_CPUS on a run whose engines (and so its trainer) use GPUs (--engine-backend sglang)."""
    if ("num_cpus_trainer" not in given and base.num_cpus_trainer == RunSection().num_cpus_trainer
            and engine.engine_backend == "sglang"):
        return {"num_cpus_trainer": GPU_TRAINER_CPUS}
    return {}


def _evals_follow_data(base: RunConfig, cfg: RunConfig, given: set[str]) -> dict[str, Any]:
    """The eval fields the command line leaves to follow its --prompt-data: --eval-prompt-data, when
    not given and `base` (the default, a preset, or a forked run's config) has the eval set of its own
    prompt data, becomes that of `cfg`'s (`default_eval_prompt_data`: a builtin task's held-out split,
    none for other data); --eval-interval, when not given, is none without eval datasets and the
    declared default when they appear where `base` had none."""
    out: dict[str, Any] = {}
    data = cfg.eval.eval_prompt_data
    if "eval_prompt_data" not in given and data == default_eval_prompt_data(base.data.prompt_data):
        data = out["eval_prompt_data"] = default_eval_prompt_data(cfg.data.prompt_data)
    if "eval_interval" not in given and cfg.eval.eval_interval == default_eval_interval(base.eval.eval_prompt_data):
        out["eval_interval"] = default_eval_interval(data)
    elif "eval_interval" not in given and not data:
        out["eval_interval"] = None  # nothing to evaluate
    return out


def config_problems(cfg: RunConfig, flag_problems: list[str] = ()) -> list[str]:
    """The config's own rules on `cfg`, without those about a flag named in `flag_problems`."""
    found = type_problems(cfg)
    return unrelated(found or rule_problems(cfg), flag_problems)  # other rules compare values: types first


def unrelated(problems: list[str], flag_problems: list[str]) -> list[str]:
    """`problems` that name no flag named in `flag_problems` (a flag whose value did not parse: a check
    of it would judge the default, not what the user wrote)."""
    named = {m.group(0) for p in flag_problems for m in _FLAG.finditer(p)}
    return [p for p in problems if not named & {m.group(0) for m in _FLAG.finditer(p)}]


def raise_flag_problems(flag_problems: list[str], other_problems: list[str] = ()) -> None:
    """One ConfigError listing every problem: a lone problem of the command line (read_flags') as its
    line, anything more as the list `invalid configuration:`."""
    problems = [*flag_problems, *other_problems]
    if len(problems) == 1 and flag_problems:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def _parse_values(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(the fields the flags in `argv` set, only those given and well-formed; a problem per other one)."""
    raw, extras = _build_parser().parse_known_args(argv)
    values, problems = {}, _strays(extras)
    for name, text in vars(raw).items():
        try:
            values[name] = _convert(SPECS_BY_NAME[name], text)
        except ValueError as e:
            problems.append(str(e))
    return values, problems


def config_file_values(path: str) -> tuple[dict[str, Any], list[str]]:
    """(the fields `--custom-config-path` sets, a problem per key that is not a flag or has a bad value)."""
    import fsspec
    import yaml

    where = f"--custom-config-path={path!r}"
    try:
        with fsspec.open(path, "r") as f:
            data = yaml.safe_load(f.read())
    except (OSError, ValueError) as e:
        return {}, [f"{where}: cannot read it ({type(e).__name__}: {e})"]
    except yaml.YAMLError as e:
        return {}, [f"{where}: not YAML ({e})"]
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        return {}, [f"{where}: expected a mapping of setting: value, got {type(data).__name__}"]
    values, problems = {}, []
    for key, value in data.items():
        spec = SPECS_BY_NAME.get(str(key))
        if spec is None or spec.name in ("custom_config_path", "preset"):
            flag = "--" + str(key).replace("_", "-")
            reason = "cannot be set from the file" if spec is not None else unknown_flag_message(flag)
            problems.append(f"{where}: key {key!r}: {reason}")
            continue
        try:
            values[spec.name] = _from_yaml(spec, value)
        except ValueError as e:
            problems.append(f"{where}: key {key!r}: {e}")
    return values, problems


def _from_yaml(s: FlagSpec, value: Any) -> Any:
    """A YAML value of flag `s` (typed by YAML, checked as the flag's text would be)."""
    if s.kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if s.kind == "list":
        return _convert(s, [str(v) for v in (value if isinstance(value, list) else [value])])
    if value is None:
        if s.optional:
            return None
        raise ValueError(f"{s.flag} needs a value")
    if isinstance(value, (list, dict, bool)):
        raise ValueError(f"expected one {s.kind}, got {value!r}")
    return _convert(s, str(value))


def _strays(extras: list[str]) -> list[str]:
    """Words that belong to no flag (the value after an unknown flag is that flag's: reported with it)."""
    out = []
    for i, word in enumerate(extras):
        after_unknown = i > 0 and extras[i - 1].startswith("--") and "=" not in extras[i - 1]
        if not word.startswith("--") and not after_unknown:
            out.append(f"unexpected argument {word!r}: flags are --name VALUE (see `miles validate --help`)")
    return out
