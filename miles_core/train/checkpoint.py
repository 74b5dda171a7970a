"""Trainer checkpoints in a Store: `{save}/step_{k:08d}/` with a COMPLETE marker written last.

A checkpoint holds model.safetensors, optimizer.safetensors, rng.safetensors (tensors, no
pickle), trainer.json (the optimizer state's skeleton, python RNG, model spec) and
extras.json: opaque JSON the caller passes (data-source cursor, buffer consumption, weight
version). Every object is committed atomically by the Store; `COMPLETE` goes last, then the
`LATEST` pointer. Under tensor parallelism each TP rank's shards go to `{part}.tp{r:02d}.safetensors` /
`trainer.tp{r:02d}.json`, written by the DP-rank-0 replica of that TP rank (DP replicas hold the
same state), and global rank 0 marks the directory complete after a barrier. Under expert
parallelism each EP rank holds its own experts (and their optimizer state): its files carry
`.ep{e:02d}` too and are written by its expert-DP rank 0. Every rank loads its TP (and EP) rank's
files, so a checkpoint resumes at any DP size; another TP or EP size is refused. `latest()` trusts only directories with the marker (one listing), so a crash
mid-save leaves the previous checkpoint as the latest.

Checkpoints prove themselves: COMPLETE lists every file of every rank with its size and sha256
(miles_core/train/checkpoint_manifest.py). `load_latest` verifies the checkpoint it picks (sizes
always; checksums with --verify-checkpoint-checksums or when the checkpoint is under
CHEAP_CHECKSUM_BYTES) and falls back to the newest one that verifies, warning what was wrong with each
skipped one. Every rank runs the same check on the same listing, so all ranks pick the same step.
"""

from __future__ import annotations

import json
import logging
import re

import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from miles_core.failures import chaos
from miles_core.storage import ObjectNotFound, StorageError, StorageUnavailable, Store
from miles_core.train import checkpoint_manifest as manifest
from miles_core.train import collectives
from miles_core.train.process_groups import checkpoint_group
from miles_core.weights.snapshot import export_snapshot
from miles_core.storage.tensor_files import put_tensors

MARKER = "COMPLETE"
LATEST = "LATEST"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
TENSOR_PARTS = ("model", "optimizer", "rng")
CHEAP_CHECKSUM_BYTES = 256 << 20  # a checkpoint this small has its checksums verified on every resume

log = logging.getLogger(__name__)


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def _layout() -> tuple[bool, bool, str]:
    """(this rank writes shards, this rank marks complete, file suffix of its TP rank and EP rank).
    The writer of each (TP rank, EP rank) is its expert-DP rank 0 (without EP: DP rank 0)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True, True, ""
    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    suffix = f".tp{ps.get_tensor_model_parallel_rank():02d}" if tp > 1 else ""
    suffix += f".ep{ps.get_expert_model_parallel_rank():02d}" if ep > 1 else ""
    return ps.get_expert_data_parallel_rank() == 0, dist.get_rank() == 0, suffix


def _barrier() -> None:
    """Wait for every rank's part of a save, in the checkpoint group (a CPU group: not subject to
    --distributed-timeout-minutes, so the slowest upload cannot get the waiting ranks torn down)."""
    group = checkpoint_group()
    if group is not None:
        collectives.barrier(group)


class CheckpointError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


class CheckpointManager:
    """Saves and restores a Trainer's state (plus caller extras) under one Store prefix.

    It owns its cadence: the driver calls `maybe_save(step, ..., last=...)` every step, and a
    manager without a store (`--save ''`) does nothing. With `save_hf`, every save also writes an
    HF checkpoint there (`{step}` in it is replaced, else `step_{k:08d}/` is appended), with the
    snapshot's `.complete` marker, so eval can reuse it.
    """

    def __init__(self, store: Store | None, *, interval: int | None = None, save_hf: str = "",
                 verify_checksums: bool = False):
        self.store = store
        self.interval = interval
        self.save_hf = save_hf
        self.verify_checksums = verify_checksums

    @classmethod
    def from_config(cls, train, run_store: Store) -> "CheckpointManager":
        """From TrainSection: --save auto = {run root}/checkpoints, '' = disabled, else a URI."""
        store = None if not train.save else run_store.child("checkpoints") if train.save == "auto" else Store(train.save)
        return cls(store, interval=train.save_interval, save_hf=train.save_hf,
                   verify_checksums=train.verify_checkpoint_checksums)

    def due(self, step: int, last: bool = False) -> bool:
        """Save after step k when (k + 1) is a multiple of --save-interval, and at the last step."""
        if self.store is None:
            return False
        return last or (self.interval is not None and (step + 1) % self.interval == 0)

    def maybe_save(self, step: int, trainer, extras: dict | None = None, *, last: bool = False) -> str | None:
        if not self.due(step, last):
            return None
        uri = self.save(step, trainer, extras)
        if self.save_hf and not _layout()[1]:
            trainer.join_export()  # rank 0 writes the HF checkpoint; its TP peers help gather it
        elif self.save_hf:
            if "{step" in self.save_hf:  # {step} or a formatted {step:08d}, as eval's SnapshotLayout reads it
                export_snapshot(trainer, Store(self.save_hf.format(step=step)), step, key="")
            else:
                export_snapshot(trainer, Store(self.save_hf), step, prefix="")
        return uri

    def save(self, step: int, trainer, extras: dict | None = None) -> str:
        if self.store is None:
            raise CheckpointError("checkpoints are disabled (--save ''); set --save to a location")
        tensors, meta = trainer.checkpoint_state()
        d = step_dir(step)
        writes, marks, suffix = _layout()
        if writes:
            self._write_shards(d, suffix, tensors, meta)
        chaos.point("checkpoint.write")
        _barrier()  # every TP rank's shards are committed before rank 0 marks the checkpoint complete
        if marks:
            extra = {"extras.json": self._put(f"{d}/extras.json", _json_bytes({"step": step, **(extras or {})}))}
            self.store.put_bytes(f"{d}/{MARKER}", manifest.encode(manifest.merge(self.store, d, extra)))
            self.store.put_bytes(LATEST, d.encode())
        _barrier()
        return self.store.uri(d)

    def _write_shards(self, d: str, suffix: str, tensors: dict, meta: dict) -> None:
        """This rank's tensor files and trainer meta, then its part of the manifest (their digests). A
        complete checkpoint of this step (a resume fell back before it) loses its marker first: while
        its files are replaced it must not be trusted."""
        self.store.delete(f"{d}/{MARKER}")
        files = {f"{part}{suffix}.safetensors": put_tensors(self.store, f"{d}/{part}{suffix}.safetensors",
                                                             tensors[part]) for part in TENSOR_PARTS}
        files[f"trainer{suffix}.json"] = self._put(f"{d}/trainer{suffix}.json", _json_bytes(meta))
        self.store.put_bytes(f"{d}/{manifest.part_name(suffix)}", _json_bytes(files))

    def _put(self, key: str, data: bytes) -> dict:
        self.store.put_bytes(key, data)
        return manifest.digest(data)

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
        tensors, meta, extras = self.read(step)
        trainer.load_checkpoint_state(tensors, meta)
        return extras

    def read(self, step: int) -> tuple[dict, dict, dict]:
        """(tensors by part, trainer meta, extras) of this rank's files of step `step`."""
        d = step_dir(step)
        files = self.listed_files(step)
        suffix = _layout()[2]
        try:
            meta = self.store.get_json(f"{d}/trainer{suffix}.json")
            tensors = {part: load_tensors(self.store.get_bytes(f"{d}/{part}{suffix}.safetensors"))
                       for part in TENSOR_PARTS}
            extras = self.store.get_json(f"{d}/extras.json")
        except ObjectNotFound as e:
            raise self._missing(d, files, e) from e
        except StorageUnavailable:
            raise
        except (StorageError, SafetensorError) as e:  # undecodable JSON or safetensors
            raise CheckpointError(f"checkpoint {self.store.uri(d)} is unreadable: {e}") from e
        return tensors, meta, extras

    def _missing(self, d: str, files: dict | None, e: ObjectNotFound) -> CheckpointError:
        listed = [name for name in (files or {}) if str(e).endswith(f"/{d}/{name}")]
        if listed:
            return CheckpointError(f"checkpoint {self.store.uri(d)} is damaged: its {MARKER} lists {listed[0]}, "
                                   "which is missing")
        return CheckpointError(f"checkpoint {self.store.uri(d)} has no {e} for this trainer's layout; "
                               "was it saved with another --tensor-model-parallel-size or --expert-model-parallel-size?")

    def listed_files(self, step: int) -> dict[str, dict] | None:
        """The files step `step`'s COMPLETE lists (None: an older version's empty marker)."""
        d = step_dir(step)
        try:
            raw = self.store.get_bytes(f"{d}/{MARKER}")
        except ObjectNotFound as e:
            raise CheckpointError(f"{self.store.uri(d)} has no {MARKER} marker; "
                                  "it is incomplete and not trusted") from e
        try:
            return manifest.decode(raw, self.store.uri(f"{d}/{MARKER}"))
        except ValueError as e:
            raise CheckpointError(str(e)) from e

    def verify(self, step: int, checksums: bool | None = None) -> list[str]:
        """What is wrong with step `step` against its COMPLETE (empty: it verifies). Sizes always;
        checksums with verify_checksums or when the checkpoint is under CHEAP_CHECKSUM_BYTES, or as
        `checksums` says (False: sizes only, nothing is read but the listing)."""
        try:
            files = self.listed_files(step)
        except CheckpointError as e:
            return [str(e)]
        if manifest.is_legacy(files):
            log.info("checkpoint %s has an empty %s (written by an older version): its files are not verified",
                     self.store.uri(step_dir(step)), MARKER)
            return []
        if checksums is None:
            checksums = self.verify_checksums or manifest.total_size(files) < CHEAP_CHECKSUM_BYTES
        return manifest.problems(self.store, step_dir(step), files, checksums)

    def latest_verified(self) -> int | None:
        """The newest complete step that verifies, warning for each newer one skipped and what was wrong;
        None without a complete step; CheckpointError when none verifies."""
        steps = self.complete_steps()
        for step in reversed(steps):
            wrong = self.verify(step)
            if not wrong:
                return step
            log.warning("checkpoint %s does not verify, skipped (falling back to an older one): %s",
                        self.store.uri(step_dir(step)), "; ".join(wrong))
        if steps:
            raise CheckpointError(
                f"no checkpoint under {self.store.uri()} verifies (steps {steps}; the warnings above say what is "
                "wrong with each). Restore a checkpoint from a backup, or delete the damaged step directories "
                "to start over from step 0.")
        return None

    def load_latest(self, trainer) -> tuple[int, dict] | None:
        """Restore the newest checkpoint that verifies (see `latest_verified`); None without one."""
        step = self.latest_verified()
        if step is None:
            return None
        return step, self.load(step, trainer)


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
