"""Flyte inputs -> RunConfig: `flags` (the miles command line) plus a few typed inputs.

The typed inputs exist for the UI and for LaunchPlans (a schedule fixes `run_id` and
`segment_steps`); empty / 0 means "as in flags (or the flag's default)". Giving the same
setting both ways is an error, never a silent override.
"""

from __future__ import annotations

import shlex

from flytekit import FlyteContextManager
from flytekit.core.context_manager import ExecutionState

from miles_core.config import ConfigError, RunConfig, parse_flags, replace_fields
from miles_core.prepare.checks import validate
from miles_core.prepare.resources import ClusterShape
from miles_core.storage import normalize_uri


def run_config(flags: str, run_id: str = "", storage_root: str = "", segment_steps: int = 0,
               cluster: ClusterShape | None = None) -> RunConfig:
    """The validated RunConfig. `cluster`: the Ray cluster the run's training will get on Flyte; on a cluster
    a run that cannot be placed on it is refused here (locally, `run_training` checks the local Ray)."""
    try:
        argv = shlex.split(flags)
    except ValueError as e:
        raise ConfigError(f"flags: cannot split {flags!r}: {e}") from e
    cfg = parse_flags(argv, check=False)
    typed = {"run_id": run_id, "storage_root": storage_root, "segment_steps": segment_steps or None}
    overrides = {}
    for name, value in typed.items():
        if not value:
            continue
        flag = "--" + name.replace("_", "-")
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise ConfigError(f"{flag} is given both in flags and as the workflow input {name}; give it once.")
        overrides[name] = value
    cfg = replace_fields(cfg, **overrides)
    root = normalize_uri(cfg.run.storage_root)  # absolute: Ray workers need not share the cwd
    if root.startswith("file://") and on_cluster():
        raise ConfigError(
            f"--storage-root={cfg.run.storage_root!r} is a local path, but this task runs on a Flyte cluster where "
            "tasks do not share a disk: set storage_root to object storage (s3://bucket/prefix, gs://...)."
        )
    return validate(replace_fields(cfg, storage_root=root), cluster=cluster if on_cluster() else None)


def on_cluster() -> bool:
    """True inside a task pod (pyflyte-execute); False for `pyflyte run` without --remote and in tests."""
    mode = FlyteContextManager.current_context().execution_state.mode
    return mode == ExecutionState.Mode.TASK_EXECUTION
