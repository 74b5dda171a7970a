"""Can the run's rewards score it? Checked by `validate` before anything starts, not at the first group.

    reward_problems(cfg)    # --custom-rm-path's signature; the local datasets' rows against the reward

The reward (`--custom-rm-path`) must be callable the way the rollout calls it
(`miles_core.rollout.rewards.signature_problem`: one positional argument, two with `needs_text`, no
other required one). A dataset on this machine (--prompt-data, and each --eval-prompt-data, as a
path or file://) is read (its first `MAX_ROWS` rows, as stored) and each row must have
- the prompt column (--input-key) and, when --label-key is set, the label column;
- with the builtin reward (no --custom-rm-path) and no --custom-generate-function-path (which may set
  rewards itself): a `task` the builtin reward scores (`BUILTIN_REWARD_TASKS`).
Builtin datasets are scorable by construction; datasets in object storage are read (and their rows
checked) by the data step, before any role starts. Rows that are not JSON objects are left to the
data step, which names every bad row.
"""

from __future__ import annotations

import os
from itertools import islice

from miles_core.config import RunConfig
from miles_core.config.plugins import PluginError, load_plugin
from miles_core.prepare.dataset import source_rows
from miles_core.rollout.prompts import DatasetError
from miles_core.rollout.rewards import BUILTIN_REWARD_TASKS, signature_problem

MAX_ROWS = 10_000  # rows read per dataset at validation: enough to catch a wrong column or task
_SHOWN = 3  # rows named per problem


def reward_problems(cfg: RunConfig) -> list[str]:
    """Every reason the run's reward cannot score it (see the module docstring)."""
    problems = _signature(cfg.rollout.custom_rm_path)
    for flag, source in local_datasets(cfg):
        problems += _rows_problems(cfg, flag, source)
    return problems


def _signature(path: str) -> list[str]:
    if not path:
        return []
    try:
        problem = signature_problem(load_plugin(path, "--custom-rm-path"), path)
    except PluginError:
        return []  # reported by the plug-in check, once
    return [problem] if problem else []


def local_datasets(cfg: RunConfig) -> list[tuple[str, str]]:
    """(flag, source) of each dataset on this machine's filesystem."""
    named = [("--prompt-data", cfg.data.prompt_data)]
    named += [(f"--eval-prompt-data {item.partition('=')[0]}", item.partition("=")[2])
              for item in cfg.eval.eval_prompt_data]
    return [(flag, source) for flag, source in named if _is_local(source)]


def _is_local(source: str) -> bool:
    """A file on this machine (a missing one is the config rules' problem, reported once)."""
    path = source.removeprefix("file://")
    return bool(source) and not source.startswith("builtin:") and "://" not in path and os.path.isfile(path)


def _rows_problems(cfg: RunConfig, flag: str, source: str) -> list[str]:
    builtin = not cfg.rollout.custom_rm_path and not cfg.rollout.rm_type and not cfg.rollout.custom_generate_function_path
    missing_prompt, missing_label, unscored = [], [], []
    try:
        for where, row in islice(source_rows(source), MAX_ROWS):
            if not isinstance(row, dict):
                continue
            if row.get(cfg.data.input_key) is None:
                missing_prompt.append(where)
            if cfg.data.label_key and row.get(cfg.data.label_key) is None:
                missing_label.append(where)
            if builtin and (row.get("task") or "") not in BUILTIN_REWARD_TASKS:
                unscored.append(f"{where}: task {row.get('task') or ''!r}")
    except DatasetError as e:
        return [f"{flag}={source!r}: {e}"]
    return [f"{flag}={source!r}: {text}" for text in (
        _rows(missing_prompt, f"no prompt column {cfg.data.input_key!r}", "set --input-key to the prompt column"),
        _rows(missing_label, f"no label column {cfg.data.label_key!r}", "set --label-key to the label column "
              "(--label-key '' for none: the reward then gets an empty label)"),
        _rows(unscored, "a task the builtin reward does not score",
              f"give each row a `task` of {', '.join(BUILTIN_REWARD_TASKS)}, or set --custom-rm-path module:function"),
    ) if text]


def _rows(found: list[str], what: str, fix: str) -> str:
    if not found:
        return ""
    more = f", ... ({len(found)} rows)" if len(found) > _SHOWN else ""
    return f"rows with {what} ({'; '.join(found[:_SHOWN])}{more}): {fix}."
