"""RunConfig (the section tree), kebab-case flag parsing, and JSON round trips."""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from miles_core.config.miles_flags import not_supported_message
from miles_core.config.sections import (
    SECTIONS,
    BufferSection,
    DataSection,
    EngineSection,
    EvalSection,
    MetricsSection,
    ModelSection,
    RolloutSection,
    RunSection,
    TrainSection,
)
from miles_core.storage import run_root_uri


class ConfigError(ValueError):
    """Bad configuration. The message names every offending flag and what to do."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    buffer: BufferSection = field(default_factory=BufferSection)
    engine: EngineSection = field(default_factory=EngineSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    # Derived values. They never overwrite a field the user set.
    @property
    def driver(self) -> str:
        if self.run.fully_async:
            return "fully-async"
        return "one-step-off" if self.run.one_step_off else "sync"

    @property
    def submission_granularity(self) -> str:
        g = self.rollout.rollout_submission_granularity
        return g or ("sample" if self.run.fully_async else "group")

    @property
    def budget_groups(self) -> int:
        """Groups that may be in flight at once (docs/fully-async.md)."""
        r = self.rollout
        if r.async_max_concurrent_samples is not None:
            return max(1, r.async_max_concurrent_samples // r.n_samples_per_prompt)
        return r.rollout_batch_size

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """miles: rollout_batch_size x n_samples_per_prompt / --global-batch-size (default 1)."""
        gbs = self.train.global_batch_size
        return 1 if not gbs else max(1, self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt // gbs)

    @property
    def buffer_capacity_groups(self) -> int:
        return max(1, int(self.buffer.async_data_buffer_capacity_factor * self.rollout.rollout_batch_size))

    @property
    def run_uri(self) -> str:
        return run_root_uri(self.run.storage_root, self.run.run_id)


# ----------------------------------------------------------------------------- field catalogue


@dataclass(frozen=True)
class FlagSpec:
    section: str
    name: str
    flag: str
    kind: str  # bool | int | float | str | list
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None


def _kind(tp) -> tuple[str, bool]:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _kind(args[0])[0], True
    if origin is list:
        return "list", False
    return {bool: "bool", int: "int", float: "float", str: "str"}[tp], False


def flag_table() -> list[FlagSpec]:
    """Every flag, in section order: the single source for the parser and the docs reference."""
    specs = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, optional = _kind(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            specs.append(
                FlagSpec(section, f.name, "--" + f.name.replace("_", "-"), kind, optional, default,
                         f.metadata.get("help", ""), f.metadata.get("choices"))
            )
    return specs


SPECS_BY_NAME = {s.name: s for s in flag_table()}


def known_flags() -> set[str]:
    names = set()
    for s in flag_table():
        names.add(s.flag)
        if s.kind == "bool":
            names.add("--no-" + s.flag[2:])
    return names


def unknown_flag_message(flag: str) -> str:
    if refused := not_supported_message(flag):
        return refused
    close = difflib.get_close_matches(flag, sorted(known_flags()), n=1)
    hint = f" Did you mean {close[0]}?" if close else " See `miles validate --help` or docs/reference/flags.md."
    return f"unknown flag {flag}.{hint}"


def replace_fields(cfg: RunConfig, **values) -> RunConfig:
    """A copy of cfg with fields (by flat name, e.g. rollout_batch_size=8) replaced."""
    per_section: dict[str, dict] = {}
    for name, v in values.items():
        spec = SPECS_BY_NAME.get(name)
        if spec is None:
            raise ConfigError(unknown_flag_message("--" + name.replace("_", "-")))
        per_section.setdefault(spec.section, {})[name] = v
    return dataclasses.replace(
        cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **vals) for sec, vals in per_section.items()}
    )


# ----------------------------------------------------------------------------- JSON


def config_to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_to_json(cfg: RunConfig) -> str:
    return json.dumps(config_to_dict(cfg), indent=2, sort_keys=True)


def config_from_dict(d: dict) -> RunConfig:
    sections = {}
    for sec, cls in SECTIONS.items():
        raw = dict(d.get(sec, {}))
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(raw) - names)
        if bad:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, sorted(names), n=1)) else repr(k)
                     for k in bad]
            raise ConfigError(f"config section '{sec}' has unknown keys {', '.join(hints)}; known: {sorted(names)}")
        sections[sec] = cls(**raw)
    extra = sorted(set(d) - set(SECTIONS))
    if extra:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, list(SECTIONS), n=1))
                 else repr(k) for k in extra]
        raise ConfigError(f"config has unknown sections {', '.join(hints)}; known: {list(SECTIONS)}")
    return RunConfig(**sections)


def config_from_json(text: str) -> RunConfig:
    return config_from_dict(json.loads(text))

