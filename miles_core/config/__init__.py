"""One typed config for a run: the section tree, flag parsing and the config's own rules. Plain data:
nothing here loads a plug-in, reads a model or touches a cluster.

    cfg = parse_flags(["--preset", "tiny-reverse4", "--rollout-batch-size", "16"])   # -> RunConfig, checked
    cfg.rollout.rollout_batch_size

`embedded_default()` is the config of `./dev run`: preset tiny-reverse4 (a 2-layer random model on
CPU) over miles' defaults. `check_config(cfg)` raises one `ConfigError` listing every problem with
the values. The full check before a run starts, plug-ins and model specs included, is
`miles_core.prepare.checks.validate`.
"""

from miles_core.config.flags import embedded_default, parse_flags
from miles_core.config.rules import check as check_config
from miles_core.config.tree import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_from_json,
    config_to_dict,
    config_to_json,
    flag_table,
    replace_fields,
)

__all__ = [
    "ConfigError",
    "RunConfig",
    "check_config",
    "config_from_dict",
    "config_from_json",
    "config_to_dict",
    "config_to_json",
    "embedded_default",
    "flag_table",
    "parse_flags",
    "replace_fields",
]
