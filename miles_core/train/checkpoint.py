"""Trainer checkpoints in a Store: `{save}/step_{k:08d}/` with a COMPLETE marker written last.

A checkpoint holds model.safetensors, optimizer.safetensors, rng.safetensors (tensors, no
pickle), trainer.json (optimizer hyper-parameters and scalar state, python RNG, model spec) and
extras.json: opaque JSON the caller passes (data-source cursor, buffer consumption, weight
version). Every object is committed atomically by the Store; `COMPLETE` goes last, then the
`LATEST` pointer. `latest()` trusts only directories with the marker (one listing), so a crash
mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import re

from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from miles_core.storage import ObjectNotFound, Store

MARKER = "COMPLETE"
LATEST = "LATEST"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
TENSOR_PARTS = ("model", "optimizer", "rng")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


class CheckpointManager:
    """Saves and restores a Trainer's state (plus caller extras) under one Store prefix."""

    def __init__(self, store: Store):
        self.store = store

    def save(self, step: int, trainer, extras: dict | None = None) -> str:
        tensors, meta = trainer.checkpoint_state()
        d = step_dir(step)
        for part in TENSOR_PARTS:
            self.store.put_bytes(f"{d}/{part}.safetensors", save_tensors(tensors[part]))
        self.store.put_json(f"{d}/trainer.json", meta)
        self.store.put_json(f"{d}/extras.json", {"step": step, **(extras or {})})
        self.store.put_bytes(f"{d}/{MARKER}", b"")
        self.store.put_bytes(LATEST, d.encode())
        return self.store.uri(d)

    def complete_steps(self) -> list[int]:
        steps = []
        for key in self.store.list(""):
            parts = key.split("/")
            if len(parts) == 2 and parts[1] == MARKER and (m := _STEP_DIR.match(parts[0])):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        """The newest step with a COMPLETE marker (None when there is none)."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def load(self, step: int, trainer) -> dict:
        """Restore `trainer` from step `step`; return the extras the caller saved."""
        d = step_dir(step)
        if not self.store.exists(f"{d}/{MARKER}"):
            raise CheckpointError(f"{self.store.uri(d)} has no {MARKER} marker; it is incomplete and not trusted")
        try:
            tensors = {part: load_tensors(self.store.get_bytes(f"{d}/{part}.safetensors")) for part in TENSOR_PARTS}
            meta = self.store.get_json(f"{d}/trainer.json")
            extras = self.store.get_json(f"{d}/extras.json")
        except (ObjectNotFound, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {self.store.uri(d)} is unreadable: {e}") from e
        trainer.load_checkpoint_state(tensors, meta)
        return extras

    def load_latest(self, trainer) -> tuple[int, dict] | None:
        step = self.latest()
        if step is None:
            return None
        return step, self.load(step, trainer)
