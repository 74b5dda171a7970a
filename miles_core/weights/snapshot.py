"""Snapshots: HF checkpoints of the trainer's weights under `{run root}/snapshots/step_{k:08d}/`.

`export_snapshot(trainer, store, step)` writes model.safetensors, config.json and tokenizer files,
then `.complete` last (readers never trust a directory without it, docs/quickstart.md#where-the-run-lives).
Engines get the snapshot's URI and copy it to their own node (`miles_core.storage.node_local.localize`).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from miles_core.storage import COMPLETE_MARKER, Store
from miles_core.weights.tensor_files import put_tensors

MARKER = COMPLETE_MARKER
_STEP = re.compile(r"^step_(\d{8})$")


def snapshot_key(step: int, prefix: str = "snapshots") -> str:
    return f"{prefix}/step_{step:08d}" if prefix else f"step_{step:08d}"


class SnapshotError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def export_snapshot(trainer, store: Store, step: int, *, prefix: str = "snapshots", dtype=None,
                    key: str | None = None) -> str:
    """Write the snapshot of `trainer` for `step` (at `key`, default `{prefix}/step_{k:08d}`); return
    its key. `.complete` is written last."""
    key = snapshot_key(step, prefix) if key is None else key.strip("/")
    marker = f"{key}/{MARKER}" if key else MARKER
    def copy(name: str) -> None:
        store.put_bytes(f"{key}/{name}" if key else name, trainer.aux_files[name])

    # The small files (config, tokenizer) commit in parallel with the weights: each put is fsynced.
    with ThreadPoolExecutor(max_workers=4) as pool:
        small = [pool.submit(copy, name) for name in trainer.aux_files]
        put_tensors(store, f"{key}/model.safetensors" if key else "model.safetensors", trainer.hf_state_dict(dtype),
                    digest=False)  # nothing lists a snapshot's digest: write the bytes once, never read them back
        for f in small:
            f.result()
    store.put_bytes(marker, b"")
    return key


def complete_snapshots(store: Store, prefix: str = "snapshots") -> list[int]:
    steps = []
    for k in store.list(prefix):
        parts = k[len(prefix):].strip("/").split("/")
        if len(parts) == 2 and parts[1] == MARKER and (m := _STEP.match(parts[0])):
            steps.append(int(m.group(1)))
    return sorted(steps)
