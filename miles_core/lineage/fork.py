"""`miles fork RUN_URI --at-step K --new-run ID [FLAGS...]`: a new run from step K of a run (docs/deployment.md).

    result = fork_run(source_uri, at_step, new_run_id, flags)   # ConfigError for what FLAGS cannot change

The fork prepares a new run root (same storage root unless FLAGS give --storage-root) that looks
like a run whose first segment ended at step K, then prints the command that continues it; the
usual run command with that run id resumes it exactly as a crash resume from step K would:
- config.json: the source's recorded config with FLAGS on top (validated; settings that cannot
  change across a fork are refused by name: the model, the dataset, the trainer's tensor/pipeline/
  context parallel layout); STATUS.json: `segment_done` at step K (so the next segment is 1);
- the checkpoint of step K (trainer, optimizer, RNG, data-source cursor, started-groups count,
  weight version), copied with COMPLETE and LATEST last;
- the buffer: the consumption manifests of steps 0..K (the shared history) and a copy of every
  group object that holds a group not consumed or rejected through K. Copies, not references: the
  two runs stay independent (either may compact or delete its own objects). Groups the source
  consumed after K whose objects it already deleted (--buffer-delete-consumed-objects) cannot be
  carried; they are counted as `groups_lost` (their prompts are behind the data-source cursor);
- data/ (the prepared dataset), model/ (a builtin initial model) and the metric events of steps
  0..K, so the fork's report shows its whole history;
- FORK.json: the origin (source run, step, overrides, counts).
The source run is only read (it may still be running: everything copied is immutable once
written). A fork interrupted midway leaves a root without FORK.json: delete it and fork again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from miles_core.buffer import objects as O
from miles_core.config import ConfigError, RunConfig, parse_flags, replace_fields
from miles_core.config.sections import DataSection, ModelSection
from miles_core.lineage.command import FLAGS, changed_fields, continue_command, overrides
from miles_core.lineage.recorded import FORK_KEY, READ_THREADS, LineageError, RecordedRun
from miles_core.metrics.sink import METRICS_PREFIX, read_metrics
from miles_core.prepare.checks import validate
from miles_core.storage import Store, validate_name
from miles_core.storage.run_root import SEGMENT_DONE, write_config, write_status
from miles_core.train.checkpoint import LATEST, MARKER, CheckpointManager, step_dir

log = logging.getLogger(__name__)

# What a checkpoint, the buffered groups and the data-source cursor of step K are tied to.
FIXED_FIELDS = (tuple(f.name for f in dataclasses.fields(ModelSection))
                + tuple(f.name for f in dataclasses.fields(DataSection))
                + ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
_COPIED_PREFIXES = ("data/", "model/")


@dataclass(frozen=True)
class ForkResult:
    run_uri: str
    source_run: str
    at_step: int
    overrides: dict  # flag -> [source value, fork value]
    groups_carried: int
    objects_copied: int
    groups_lost: int
    command: str


def fork_run(source_uri: str, at_step: int, new_run_id: str, flags: list[str]) -> ForkResult:
    src = RecordedRun.open(source_uri)
    checkpoints = src.require_checkpoint(at_step)
    cfg = fork_config(src, at_step, new_run_id, flags)
    dest = Store(cfg.run_uri)
    dest_checkpoints = CheckpointManager.from_config(cfg.train, dest)
    _require_empty(dest, dest_checkpoints.store)
    manifests = src.manifests(at_step)
    copied, carried = _copy_unconsumed(src, dest, manifests)
    for prefix in _COPIED_PREFIXES:
        _copy_prefix(src.store, dest, prefix)
    for m in manifests:
        dest.put_json(O.consumed_key(int(m["step"])), m)
    _copy_metrics(src, dest, at_step)
    _copy_checkpoint(checkpoints, dest_checkpoints, at_step)
    lost = _lost(src, at_step, carried)
    result = ForkResult(dest.root_uri, src.uri, at_step, overrides(src.cfg, cfg), len(carried), copied, lost,
                        continue_command(cfg))
    write_config(dest, cfg, 0)
    dest.put_json(FORK_KEY, {**dataclasses.asdict(result), "flags": list(flags), "created_at": time.time()})
    write_status(dest, SEGMENT_DONE, last_step=at_step, segment=0,
                 message=f"forked from {src.uri} at step {at_step}")
    return result


def fork_config(src: RecordedRun, at_step: int, new_run_id: str, flags: list[str]) -> RunConfig:
    """The source's config with the fork's id and FLAGS on top; ConfigError on what a fork cannot change."""
    if any(a == "--run-id" or a.startswith("--run-id=") for a in flags):
        raise ConfigError("--run-id: the fork's run id is --new-run")
    cfg = validate(parse_flags(flags, base=replace_fields(src.cfg, run_id=validate_name(new_run_id, "--new-run"))))
    fixed = [f"{FLAGS[name]} ({before!r} -> {after!r})"
             for name, (before, after) in changed_fields(src.cfg, cfg).items() if name in FIXED_FIELDS]
    if fixed:
        raise ConfigError(f"cannot change across a fork: {', '.join(fixed)}. Step {at_step}'s checkpoint, "
                           "buffered groups and data-source cursor belong to the source's model, dataset and "
                           "parallel layout; start a new run (or use --load / --ref-load) to change them.")
    shared = _shared_locations(src.cfg, cfg)
    if shared:
        raise ConfigError(f"the fork would write where the source run writes: {', '.join(shared)}; give the fork "
                           "its own location (--save auto keeps checkpoints in its run root)")
    if cfg.run.num_rollout <= at_step + 1:
        raise ConfigError(f"--num-rollout={cfg.run.num_rollout}: a fork at step {at_step} has nothing left to train; "
                           f"set --num-rollout above {at_step + 1}")
    return cfg


def _shared_locations(src: RunConfig, cfg: RunConfig) -> list[str]:
    """The fork's output locations that are the source's own (checkpoints, HF saves, snapshots)."""
    pairs = [("save", cfg.train.save, src.train.save), ("save_hf", cfg.train.save_hf, src.train.save_hf),
             ("eval_hf_dir", cfg.eval.eval_hf_dir, src.eval.eval_hf_dir)]
    out = [f"{FLAGS[name]}={mine!r}" for name, mine, theirs in pairs if mine not in ("", "auto") and mine == theirs]
    return out + (["--save='' (the fork resumes from a copied checkpoint)"] if not cfg.train.save else [])


def _require_empty(*stores: Store) -> None:
    for store in stores:
        if store.list(""):
            raise LineageError(f"{store.root_uri} already exists and is not empty; choose another --new-run "
                               "(or --storage-root / --save)")


def _copy_unconsumed(src: RecordedRun, dest: Store, manifests: list[dict]) -> tuple[int, set[str]]:
    """Copy every object holding a group not consumed or rejected through the fork step:
    (objects copied, ids of the groups they carry)."""
    taken = {gid for m in manifests for field in ("consumed", "rejected") for gid in m.get(field, ())}
    done = {key for m in manifests for key in m.get("objects_done", ())}
    keys = [k for k in src.group_keys() if k not in done]
    copied, carried = 0, set()
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="fork-copy") as pool:
        writes = []
        for key, data, groups in src.read_objects(keys):
            fresh = {g.group_id for g in groups} - taken
            if fresh:
                writes.append(pool.submit(dest.put_bytes, key, data))
                carried |= fresh
        for w in writes:
            w.result()
            copied += 1
    return copied, carried


def _lost(src: RecordedRun, at_step: int, carried: set[str]) -> int:
    """Groups the source consumed after the fork step whose objects are gone (deleted consumed objects)."""
    later = {gid for m in src.later_manifests(at_step) for gid in m.get("consumed", ())}
    lost = len(later - carried)
    if lost:
        log.warning("fork: %d groups consumed by %s after step %d are no longer stored (deleted consumed objects); "
                    "the fork cannot carry them", lost, src.uri, at_step)
    return lost


def _copy_prefix(src: Store, dest: Store, prefix: str) -> None:
    keys = src.list(prefix)
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="fork-copy") as pool:
        list(pool.map(lambda k: dest.put_bytes(k, src.get_bytes(k)), keys))


def _copy_checkpoint(src: CheckpointManager, dest: CheckpointManager, step: int) -> None:
    """Step `step`'s objects, then its COMPLETE marker, then LATEST (as a save commits them)."""
    d = step_dir(step)
    keys = [k for k in src.store.list(d + "/") if k != f"{d}/{MARKER}"]
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="fork-copy") as pool:
        list(pool.map(lambda k: dest.store.put_bytes(k, src.store.get_bytes(k)), keys))
    dest.store.put_bytes(f"{d}/{MARKER}", src.store.get_bytes(f"{d}/{MARKER}"))  # its file list, verbatim
    dest.store.put_bytes(LATEST, d.encode())


def _copy_metrics(src: RecordedRun, dest: Store, at_step: int) -> None:
    """The source's metric events of steps 0..at_step, one part per component (sorting first)."""
    per_component: dict[str, list[str]] = {}
    for e in read_metrics(src.store):
        if e["step"] <= at_step and e["component"]:
            line = json.dumps({k: e[k] for k in ("step", "time", "name", "value")})
            per_component.setdefault(e["component"], []).append(line)
    for component, lines in per_component.items():
        key = f"{METRICS_PREFIX}/{component}/{0:013d}-forked-{0:06d}.jsonl"
        dest.put_bytes(key, ("\n".join(lines) + "\n").encode())
