"""What a run is about to do, said before it starts; what to do instead when it already finished.

    print(describe_plan(cfg, flags, inputs), file=sys.stderr)   # the first lines of `./dev run`

A run that will train says how many steps (new, or resuming after the last recorded one), where
its run root and its report go, and roughly how long it takes on this machine. A run whose
STATUS.json says `finished` at --num-rollout says so, and gives the command that trains it further
(the same command with a larger --num-rollout) and the ones that show what it did.

The time is an estimate: from step times this run already recorded (a resumed run), else from the
another run of the same shape under the same storage root, else, for a builtin model on the
CPU engine, from a measurement of the embedded default (`REFERENCE`); otherwise none is given.
"""

from __future__ import annotations

import os
import shlex
import statistics
from dataclasses import dataclass

from miles_core.config import RunConfig
from miles_core.config.sections import RunSection
from miles_core.metrics.names import STEP_SECONDS
from miles_core.metrics.sink import read_metrics
from miles_core.prepare.checks import setting_warnings
from miles_core.storage import StorageError, StorageUnavailable, Store, normalize_uri
from miles_core.storage.run_root import (
    FINISHED,
    RunStatus,
    get_json_or_none,
    read_config,
    read_status,
    require_first_config,
    segment_config_key,
)

WORKFLOW = "pyflyte run workflows/fully_async.py fully_async_rl"
PREFIX = "[miles]"
SIBLINGS_READ = 20  # other runs looked at for a measured step time


@dataclass(frozen=True)
class Timing:
    step_seconds: float
    startup_seconds: float
    basis: str  # where the figures come from, said with the estimate


# The embedded default (32 prompts x 8 samples per step) measured on a 2-core machine: median 0.55 s
# per step after ~35 s of start-up (docs/quickstart.md).
REFERENCE = Timing(0.55, 35.0, "the embedded default measured on a 2-core machine, scaled to this batch")
REFERENCE_SAMPLES = 32 * 8


def describe_plan(cfg: RunConfig, flags: str = "", inputs: dict[str, str] | None = None) -> str:
    """The lines that open a run (see the module docstring); `flags` and `inputs` are the workflow's
    (to print the command that continues a finished run)."""
    store = Store(cfg.run_uri)
    status = read_status(store)
    if status is not None and is_finished(cfg.run, status):
        return finished_notice(cfg, status, flags, inputs or {})
    require_first_config(store)  # the segment refuses a damaged one: said before anything starts
    start = 0 if status is None else status.last_step + 1
    end = cfg.run.total_steps if cfg.run.segment_steps is None else min(cfg.run.total_steps,
                                                                        start + cfg.run.segment_steps)
    what = "a new run" if status is None else f"resuming after step {status.last_step} (segment {status.segment + 1})"
    lines = [f"{PREFIX} {what}: steps {start}..{end - 1} of --num-rollout {cfg.run.total_steps} "
             f"({cfg.driver} driver, model {cfg.model.hf_checkpoint}, data {cfg.data.prompt_data})",
             f"{PREFIX} run root: {_where(cfg.run_uri)}",
             f"{PREFIX} report: {_where(cfg.run_uri)}/report.html when the run ends (any time: miles report "
             f"{shlex.quote(cfg.run_uri)} -o report.html)"]
    warnings = [f"{PREFIX} warning: {w}" for w in setting_warnings(cfg)]  # said once, where a run starts
    return "\n".join(lines + [_time_line(cfg, store, end - start)] + warnings)


def is_finished(run: RunSection, status: RunStatus | None) -> bool:
    return status is not None and status.state == FINISHED and status.last_step >= run.total_steps - 1


def finished_notice(cfg: RunConfig, status: RunStatus, flags: str = "", inputs: dict[str, str] | None = None) -> str:
    """A finished run: nothing to train; how to train it further and how to look at it."""
    more = max(cfg.run.total_steps, status.last_step + 1) * 2
    uri = shlex.quote(cfg.run_uri)
    return "\n".join([
        f"{PREFIX} run {_where(cfg.run_uri)} already finished: {status.last_step + 1} of --num-rollout "
        f"{cfg.run.total_steps} steps trained; nothing to train.",
        f"{PREFIX} to train it further, raise --num-rollout (e.g. to {more}; ./dev run takes the same inputs):",
        f"    {rerun_command(flags, inputs or {}, more)}",
        f"{PREFIX} to look at it: miles runs show {uri}; report: {_where(cfg.run_uri)}/report.html",
    ])


def rerun_command(flags: str, inputs: dict[str, str], num_rollout: int) -> str:
    """The workflow command with the same flags and inputs and --num-rollout set to `num_rollout`."""
    words = _without(shlex.split(flags), "--num-rollout") + ["--num-rollout", str(num_rollout)]
    extra = "".join(f" --{name} {shlex.quote(str(value))}" for name, value in inputs.items() if value)
    return f"{WORKFLOW} --flags {shlex.quote(shlex.join(words))}{extra}"


def _without(words: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w == flag:
            skip = True
        elif not w.startswith(flag + "="):
            out.append(w)
    return out


def _where(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


# ----------------------------------------------------------------------------- how long


def _time_line(cfg: RunConfig, store: Store, steps: int) -> str:
    timing = measured_timing(store) or sibling_timing(cfg) or reference_timing(cfg)
    if timing is None:
        return f"{PREFIX} time: unknown until the first steps (the progress line shows the step rate)"
    total = timing.startup_seconds + steps * timing.step_seconds
    return (f"{PREFIX} about {_duration(total)} on this machine ({os.cpu_count()} CPUs): {timing.step_seconds:.2f} s "
            f"per step + {timing.startup_seconds:.0f} s start-up, from {timing.basis}")


def measured_timing(store: Store) -> Timing | None:
    """Step and start-up times this run root recorded (its first segment), or None."""
    steps = {e["step"]: e for e in read_metrics(store, "trainer") if e["name"] == STEP_SECONDS and e["value"]}
    if not steps:
        return None
    first, written = steps[min(steps)], _written_at(store)  # step 0 ends at its event's time
    startup = max(0.0, first["time"] - first["value"] - written) if written else REFERENCE.startup_seconds
    return Timing(statistics.median(e["value"] for e in steps.values()), startup, "the step times recorded in "
                  f"{_where(store.root_uri)}")


def _written_at(store: Store) -> float:
    """When the first segment wrote its config (its start), 0.0 when unknown."""
    record = get_json_or_none(store, segment_config_key(0)) or {}
    return float(record.get("written_at") or 0.0)


def sibling_timing(cfg: RunConfig) -> Timing | None:
    """Timing of another run of the same shape (model, data, batch, engine) under the same storage root."""
    root = Store(normalize_uri(cfg.run.storage_root))
    for run_id in root.list_dirs("runs")[:SIBLINGS_READ]:
        store = root.child(f"runs/{run_id}")
        if run_id != cfg.run.run_id and _same_shape(cfg, _first_config(store)):
            timing = measured_timing(store)
            if timing is not None:
                return timing
    return None


def _first_config(store: Store) -> dict | None:
    """Another run's first config; None when it has none or it does not parse (its own runs say so)."""
    try:
        found = read_config(store, 0)
    except StorageUnavailable:
        raise
    except StorageError:
        return None
    return found if isinstance(found, dict) else None


def _same_shape(cfg: RunConfig, other: dict | None) -> bool:
    if not other:
        return False
    pairs = [("model", "hf_checkpoint"), ("data", "prompt_data"), ("rollout", "rollout_batch_size"),
             ("rollout", "n_samples_per_prompt"), ("engine", "engine_backend")]
    return all(other.get(sec, {}).get(name) == getattr(getattr(cfg, sec), name) for sec, name in pairs)


def reference_timing(cfg: RunConfig) -> Timing | None:
    if not cfg.model.hf_checkpoint.startswith("builtin:") or cfg.engine.engine_backend != "cpu":
        return None
    scale = cfg.rollout.groups_per_step * cfg.rollout.n_samples_per_prompt / REFERENCE_SAMPLES
    return Timing(REFERENCE.step_seconds * scale, REFERENCE.startup_seconds, REFERENCE.basis)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
