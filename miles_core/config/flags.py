"""Kebab-case flags -> RunConfig: the parser miles users know, presets first, explicit flags on top.

    cfg = parse_flags(["--rollout-batch-size", "16"])   # checked by the config's own rules

The checks that load plug-ins or read model specs run above the config
(`miles_core.prepare.checks.validate`).
"""

from __future__ import annotations

import argparse
from typing import Any

from miles_core.config.presets import PresetError, preset_values
from miles_core.config.rules import check as check_config
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


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="miles", add_help=False, allow_abbrev=False)
    for s in flag_table():
        kw: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": s.help}
        if s.kind == "bool":
            p.add_argument(s.flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if s.kind == "list":
            kw["nargs"] = "*"
        else:
            kw["type"] = _optional(s) if s.optional else {"int": int, "float": float, "str": str}[s.kind]
        if s.choices:
            kw["choices"] = list(s.choices) + (["none"] if s.optional else [])
            kw.pop("type", None)
        p.add_argument(s.flag, **kw)
    return p


def _optional(s: FlagSpec):
    base = {"int": int, "float": float, "str": str}[s.kind]

    def conv(text: str):
        return None if text.lower() in ("none", "") else base(text)

    conv.__name__ = s.kind
    return conv


def parse_flags(argv: list[str], base: RunConfig | None = None, check: bool = True) -> RunConfig:
    """Flags -> RunConfig (on top of `base`, default: the embedded default), checked by the config's own rules unless check=False."""
    known = known_flags()  # once: flag_table() resolves type hints, too slow to redo per argument
    unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in known]
    if unknown:
        raise ConfigError("\n".join(unknown_flag_message(a.split("=")[0]) for a in unknown))
    values = _parse_values(argv)
    base = base or RunConfig()
    if values.get("preset"):  # the preset first, then every flag given explicitly on top
        try:
            base = replace_fields(base, **preset_values(values["preset"]))
        except PresetError as e:
            raise ConfigError(str(e)) from e
    cfg = replace_fields(base, **values)
    if check:
        check_config(cfg)
    return cfg


def _parse_values(argv: list[str]) -> dict[str, Any]:
    """The fields the flags in `argv` set (only those given)."""
    values = vars(_build_parser().parse_args(argv))
    for name, v in list(values.items()):
        s = SPECS_BY_NAME[name]
        if s.choices and s.optional and v == "none":
            values[name] = None
    return values
