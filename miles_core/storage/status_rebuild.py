"""STATUS.json rebuilt from the rest of the run root, when it does not parse (truncated, garbage) or is
missing from a run with checkpoints or consumption manifests.

    fields = rebuilt_status(store, why)    # {"state", "last_step", "segment", "updated_at", "message"}

STATUS is derived state: the latest segment is the newest config record (config.json,
config_segment_{n:04d}.json), the last step trained is the newest of the newest complete checkpoint
and the newest consumption manifest, and the run is `finished` when the step it can resume from
(the checkpoint; the manifests when there is no checkpoint) is --num-rollout - 1 or later, else
`segment_done` (a segment that was running when STATUS broke resumes the same way). The message
says it was rebuilt and why. Nothing is written: readers stay read-only, and the next segment
writes a fresh STATUS when it starts.

The layouts are read as plain keys (storage sits below the buffer and the trainer):
buffer/consumed/{step:08d}.json and {save}/step_{k:08d}/COMPLETE, with --save `auto` meaning
{run root}/checkpoints.
"""

from __future__ import annotations

import re
import time

from miles_core.storage import ObjectNotFound, StorageError, Store

CONSUMED = "buffer/consumed/"
_MANIFEST = re.compile(r"^(\d{8})\.json$")
_COMPLETE = re.compile(r"^step_(\d{8})/COMPLETE$")


def rebuilt_status(store: Store, why: str) -> dict:
    """The fields of a STATUS rebuilt from configs, checkpoints and manifests; `why` goes in the message."""
    segment, cfg = latest_config(store)
    checkpoint = newest_checkpoint(store, cfg)
    manifest = last_manifest_step(store)
    resumable = checkpoint if checkpoint is not None else manifest
    num_rollout = (cfg.get("run") or {}).get("num_rollout")
    finished = isinstance(num_rollout, int) and resumable is not None and resumable >= num_rollout - 1
    last = max([s for s in (checkpoint, manifest) if s is not None], default=-1)
    return {"state": "finished" if finished else "segment_done", "last_step": last, "segment": segment,
            "updated_at": time.time(),
            "message": f"rebuilt from the checkpoints (newest {checkpoint}) and consumption manifests (newest "
                       f"{manifest}): {why}"}


def has_history(store: Store) -> bool:
    """Whether the run root holds a checkpoint or a consumption manifest: a run that started a segment."""
    _, cfg = latest_config(store)
    return newest_checkpoint(store, cfg) is not None or last_manifest_step(store) is not None


def latest_config(store: Store) -> tuple[int, dict]:
    """(the newest segment with a config record, its config dict; {} when it does not parse)."""
    segment, cfg = 0, _config(store, "config.json")
    while (found := _config(store, f"config_segment_{segment + 1:04d}.json")) is not None:
        segment, cfg = segment + 1, found
    return segment, cfg or {}


def _config(store: Store, key: str) -> dict | None:
    try:
        record = store.get_json(key)
    except ObjectNotFound:
        return None
    except StorageError:  # does not parse: the segment exists, its settings are unknown
        return {}
    config = record.get("config", record) if isinstance(record, dict) else {}
    return config if isinstance(config, dict) else {}


def newest_checkpoint(store: Store, cfg: dict) -> int | None:
    """The newest step with a COMPLETE marker under the run's --save (None: none, or --save '')."""
    save = (cfg.get("train") or {}).get("save", "auto")
    if not save:
        return None
    where = store.child("checkpoints") if save == "auto" else Store(save)
    steps = [int(m.group(1)) for k in where.list("") if (m := _COMPLETE.match(k))]
    return max(steps, default=None)


def last_manifest_step(store: Store) -> int | None:
    steps = [int(m.group(1)) for k in store.list(CONSUMED) if (m := _MANIFEST.match(k.rsplit("/", 1)[-1]))]
    return max(steps, default=None)
