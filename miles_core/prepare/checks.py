"""`validate(cfg)`: every check a run's config gets before anything starts (the validation matrix).

The config's own rules (`miles_core.config.rules`) plus the checks that need what lives above the
config: every `--*-path` plug-in is imported and checked against its slot's contract, a packaged
`--hf-checkpoint` is one this install knows, and engines bound beyond loopback have their API
token; given the cluster's shape, that the run's engines, trainer ranks and eval engines fit it
(`miles_core.prepare.resources`). Raises one ConfigError listing every problem, each naming its flags
and what to do; it never rewrites the config.
"""

from __future__ import annotations

from miles_core.config import RunConfig
from miles_core.config.plugins import PluginError, load_plugin
from miles_core.config.rules import raise_problems, rule_problems, type_problems
from miles_core.engines.auth import bind_problem
from miles_core.models.source import PACKAGED
from miles_core.prepare.resources import ClusterShape, fit_problems
from miles_core.rollout.episodes import load_generate_function


def validate(cfg: RunConfig, cluster: ClusterShape | None = None) -> RunConfig:
    """`cfg` when every check passes (with `cluster`: also that the run fits it), else one ConfigError
    listing every problem."""
    raise_problems(type_problems(cfg))  # the other checks compare values; a wrong type would raise TypeError
    problems = rule_problems(cfg) + _packaged_model(cfg) + _plugins(cfg) + _engine_exposure(cfg)
    raise_problems(problems + (fit_problems(cfg, cluster) if cluster is not None and not problems else []))
    return cfg


def _packaged_model(cfg: RunConfig) -> list[str]:
    """What `--hf-checkpoint import:NAME` may name."""
    m = cfg.model.hf_checkpoint
    if m.startswith("import:") and m[len("import:"):] not in PACKAGED:
        return [f"--hf-checkpoint={m!r}: unknown packaged model; known: "
                f"{', '.join('import:' + k for k in PACKAGED)} (or a path to a .gguf file)."]
    return []


def _engine_exposure(cfg: RunConfig) -> list[str]:
    problem = bind_problem(cfg.engine.engine_bind_host)
    return [problem] if problem else []


def _plugins(cfg: RunConfig) -> list[str]:
    """Every plugin path the run will call resolves now (the refused hook paths are not loaded)."""
    slots = [
        (cfg.rollout.custom_rm_path, "--custom-rm-path", ()),
        (cfg.rollout.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path", ()),
        (cfg.rollout.rollout_sample_filter_path, "--rollout-sample-filter-path", ()),
        (cfg.buffer.custom_async_data_buffer_path, "--custom-async-data-buffer-path", ("put", "get", "get_metrics")),
    ]
    p = []
    for path, flag, methods in slots:
        if path:
            try:
                load_plugin(path, flag, methods)
            except PluginError as ex:
                p.append(str(ex))
    try:  # resolved and signature-checked: async, callable as fn(args, sample, sampling_params)
        load_generate_function(cfg.rollout.custom_generate_function_path)
    except PluginError as ex:
        p.append(str(ex))
    return p
