"""`validate(cfg)`: every check a run's config gets before anything starts (the validation matrix).

The config's own rules (`miles_core.config.rules`) plus the checks that need what lives above the
config: every `--*-path` plug-in is imported and checked against its slot's contract (the reward's
signature, and that the local datasets' rows are ones it can score: `scoring`; and ones the model
can read: `readable`), a packaged
`--hf-checkpoint` is one this install knows, a local one of a family the project handles
(docs/models.md) whose experts the expert-parallel size divides and which the --moe-* model flags
describe, and engines bound beyond loopback have their API
token; given the cluster's shape, that the run's engines, trainer ranks and eval engines fit it
(`miles_core.prepare.resources`), that what the run writes to a node's disk fits what each pod's
node-local volume holds (`miles_core.prepare.disk`, when the shape says), and, on more than one node,
that `--engine-bind-host auto` has its token too. Raises one ConfigError listing every problem, each
naming its flags and what to do; it never rewrites the config.
"""

from __future__ import annotations

import json
import logging
import os

from miles_core.config import RunConfig, replace_fields
from miles_core.config.plugins import PluginError, correction_path, load_plugin
from miles_core.config.sections import EngineSection, ModelSection
from miles_core.config.rules import (moe_flag_problems, raise_problems, recompute_layers_problem, rule_problems,
                                     type_problems)
from miles_core.engines.auth import bind_problem
from miles_core.models.builtin import builtin_config
from miles_core.models.families import UnsupportedModel, spec_of
from miles_core.models.source import PACKAGED, is_builtin
from miles_core.prepare import memory
from miles_core.prepare.disk import disk_problems, node_disk_from_env
from miles_core.prepare.memory import GIB, budget_fit, memory_fit
from miles_core.prepare.model_import import check_supported
from miles_core.prepare.readable import readability_problems
from miles_core.prepare.resources import ClusterShape, fit_problems
from miles_core.prepare.scoring import reward_problems
from miles_core.rollout.episodes import load_generate_function
from miles_core.storage import Store

log = logging.getLogger(__name__)


def validate(cfg: RunConfig, cluster: ClusterShape | None = None) -> RunConfig:
    """`cfg` when every check passes (with `cluster`: also that the run fits it), else one ConfigError
    listing every problem."""
    raise_problems(validation_problems(cfg, cluster))
    return cfg


def setting_warnings(cfg: RunConfig) -> list[str]:
    """Settings only a toy wants, met with a pretrained model (anything but a builtin tiny one): one
    line each, naming the flag, its value and what a pretrained model wants. `miles validate` prints
    them, and so do a run's first lines (`describe_plan`: once, not in every task that validates). Values a preset sets for its own model (tiny-reverse4's lr 2e-3 on a random
    2-layer model) are never judged: the builtin tiny models are the toy."""
    if is_builtin(cfg.model.hf_checkpoint) or not cfg.model.hf_checkpoint:
        return []
    t, r, out = cfg.train, cfg.rollout, []
    if t.lr >= 1e-4:
        out.append(f"--lr {t.lr:g} on a pretrained model: RL post-training uses 1e-6 (miles' default) to 1e-5; "
                   f"at {t.lr:g} Adam moves every weight by about that much per step and wipes out what the "
                   "model knows.")
    if r.rollout_max_response_len is not None and r.rollout_max_response_len <= 8:
        out.append(f"--rollout-max-response-len {r.rollout_max_response_len}: answers of at most "
                   f"{r.rollout_max_response_len} tokens are cut before a pretrained model says anything; "
                   "give the length its task needs (e.g. 1024-8192 for math).")
    if not t.use_dynamic_batch_size and t.micro_batch_size >= 64:
        out.append(f"--micro-batch-size {t.micro_batch_size}: a pretrained model's activations for that many "
                   "samples at once rarely fit a GPU; use 1-8 (miles' default 1) or --use-dynamic-batch-size "
                   "with --max-tokens-per-gpu.")
    return out


def validation_problems(cfg: RunConfig, cluster: ClusterShape | None = None) -> list[str]:
    """Every problem `validate` raises, as a list (`miles validate` adds those of the command line)."""
    types = type_problems(cfg)
    if types:  # the other checks compare values; a wrong type would raise TypeError
        return types
    problems = rule_problems(cfg) + _packaged_model(cfg.model) + _plugins(cfg) + reward_problems(cfg)
    problems += readability_problems(cfg, local_hf_config(cfg.model)) if not problems else []
    problems += _memory(cfg) if not problems else []
    problems += _disk(cfg, cluster) if not problems else []
    exposure = _engine_exposure(cfg.engine, cluster)  # reads only the bind host and the node count
    return problems + exposure + (fit_problems(cfg, cluster) if cluster is not None and not problems else [])


def _packaged_model(model: ModelSection) -> list[str]:
    """What `--hf-checkpoint import:NAME` may name."""
    m = model.hf_checkpoint
    if m.startswith("import:") and m[len("import:"):] not in PACKAGED:
        return [f"--hf-checkpoint={m!r}: unknown packaged model; known: "
                f"{', '.join('import:' + k for k in PACKAGED)} (or a path to a .gguf file)."]
    return []


def _memory(cfg: RunConfig) -> list[str]:
    """The model checks when the model's config is readable here (a builtin model or a local HF
    directory; a remote model is checked when the run starts, after it is present): a local model's
    family and options are ones the project handles (the importer's `check_supported`: refused now,
    not when the import or the run reads it), then `model_problems`."""
    hf_config = local_hf_config(cfg.model)
    if not hf_config:
        return []
    if not is_builtin(cfg.model.hf_checkpoint):
        try:
            check_supported(hf_config, f"--hf-checkpoint={cfg.model.hf_checkpoint!r}")
        except UnsupportedModel as e:
            return [str(e)]
    return model_problems(hf_config, cfg)


def model_problems(hf_config: dict, cfg: RunConfig) -> list[str]:
    """What the trainer's flags need of the model: --recompute-num-layers fits its layers; with
    --gpu-memory-gb, the trainer can fit it (`memory_fit`)."""
    return model_fit(hf_config, cfg)[0]


def model_fit(hf_config: dict, cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(`model_problems`, the warnings of a trainer that may not fit --gpu-memory-gb)."""
    t = cfg.train
    try:
        spec = spec_of(hf_config)
    except (UnsupportedModel, KeyError) as e:
        return [f"--hf-checkpoint={cfg.model.hf_checkpoint!r}: {e}"], []
    problem = recompute_layers_problem(spec.num_layers, t.recompute_method, t.recompute_num_layers)
    problems = ([problem] if problem else []) + moe_flag_problems(spec, t)  # EP and the --moe-* model flags
    if problems:
        return problems, []
    problems, warnings = budget_fit(hf_config, cfg, t.gpu_memory_gb) if t.gpu_memory_gb else ([], [])
    return problems, warnings


def check_memory(cfg: RunConfig, model_uri: str) -> None:
    """ConfigError when `model_problems` finds any for the model at `model_uri` (present by now,
    wherever it lives), a logged warning when the trainer may not fit --gpu-memory-gb; called before
    any role starts."""
    if cfg.train.gpu_memory_gb or cfg.train.recompute_method:
        problems, warnings = model_fit(Store(model_uri).get_json("config.json"), cfg)
        for w in warnings:
            log.warning("trainer memory: %s", w)
        raise_problems(problems)


def _disk(cfg: RunConfig, cluster: ClusterShape | None) -> list[str]:
    """The run's bytes per node against the cluster's node-local volume (`disk_problems`), when the
    shape carries one and the model's config is readable here (else `check_disk` when the run starts)."""
    hf_config = local_hf_config(cfg.model) if cluster is not None and cluster.disk is not None else None
    if not hf_config:
        return []
    try:
        spec_of(hf_config)
    except (UnsupportedModel, KeyError):
        return []  # `_memory` names it
    return disk_problems(hf_config, cfg, cluster.disk, int(max((n.gpus for n in cluster.nodes), default=0)) or None)


def check_disk(cfg: RunConfig, model_uri: str) -> None:
    """In a pod the tasks' templates made (MILES_NODE_DISK_SIZE set), before any role starts: ConfigError
    when the run's bytes per node (`disk_problems`) exceed its node-local volume. Nothing elsewhere (a
    local run); a model validation could read was checked then, this repeats it at no cost."""
    disk = node_disk_from_env()
    if disk is not None:
        raise_problems(disk_problems(Store(model_uri).get_json("config.json"), cfg, disk))


def check_device_memory(cfg: RunConfig, model_uri: str, *, warn: bool = True) -> None:
    """On a trainer rank, before its model is built, without --gpu-memory-gb (checked before the run
    started): the trainer's estimate against the memory of this rank's CUDA device (`memory_fit`):
    ConfigError when the trainer cannot fit it, a logged warning (`warn`) when it may not. Nothing
    without CUDA. `--transformer-impl auto` is counted as the rank will build it (Transformer Engine's
    fused attention where it is installed, as in the project's GPU image: no s x s state)."""
    total = None if cfg.train.gpu_memory_gb else memory.device_memory_bytes()
    if total is None:
        return
    cfg = replace_fields(cfg, transformer_impl=memory.impl_on_this_node(cfg.train))
    problems, warnings = memory_fit(Store(model_uri).get_json("config.json"), cfg, total / GIB,
                                    f"this trainer rank's GPU has {total / GIB:.1f} GiB (--gpu-memory-gb not set)")
    for w in warnings if warn else []:
        log.warning("trainer memory: %s", w)
    raise_problems(problems)


def local_hf_config(m: ModelSection) -> dict | None:
    """The model's config.json when it can be read without a network call, else None."""
    if is_builtin(m.hf_checkpoint):
        return builtin_config(m.hf_checkpoint, m.tiny_num_layers, m.tiny_hidden_size, m.tiny_num_heads)
    path = os.path.join(m.hf_checkpoint.removeprefix("file://"), "config.json")
    if "://" in m.hf_checkpoint.removeprefix("file://") or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _engine_exposure(engine: EngineSection, cluster: ClusterShape | None) -> list[str]:
    problem = bind_problem(engine.engine_bind_host, len(cluster.nodes) if cluster is not None else None)
    return [problem] if problem else []


def _plugins(cfg: RunConfig) -> list[str]:
    """Every plugin path the run will call resolves now (the refused hook paths are not loaded)."""
    slots = [
        (cfg.rollout.custom_rm_path, "--custom-rm-path", ()),
        (cfg.rollout.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path", ()),
        (cfg.rollout.rollout_sample_filter_path, "--rollout-sample-filter-path", ()),
        (cfg.buffer.custom_async_data_buffer_path, "--custom-async-data-buffer-path", ("put", "get", "get_metrics")),
        (correction_path(cfg.train.custom_tis_function_path), "--custom-tis-function-path", ()),
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
