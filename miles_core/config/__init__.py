"""One typed config for a run: the section tree, flag parsing and validation.

    cfg = parse_flags(["--rollout-batch-size", "16"])   # -> RunConfig, validated
    cfg.rollout.rollout_batch_size

`validate(cfg)` runs before any cluster starts and raises one `ConfigError` listing every problem.
"""

from miles_core.config.tree import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_from_json,
    config_to_dict,
    config_to_json,
    flag_table,
    parse_flags,
    replace_fields,
)
from miles_core.config.validate import validate

__all__ = [
    "ConfigError",
    "RunConfig",
    "config_from_dict",
    "config_from_json",
    "config_to_dict",
    "config_to_json",
    "flag_table",
    "parse_flags",
    "replace_fields",
    "validate",
]
