"""Where eval snapshots live, when one is complete, and which ones to retire (docs/evaluation.md).

Two modes, decided once from the config:
- export: the trainer writes `step_{k:08d}/` (HF safetensors + config.json + tokenizer files, then
  the `.complete` marker last) under `--eval-hf-dir`, or the run root's `snapshots/` by default,
  at the eval cadence; old ones are retired as a ring.
- reuse (`--save-hf`): nothing is exported; evals read the HF checkpoints the checkpointer saves
  at `--save-interval` (validate() requires eval_interval % save_interval == 0). Reused
  checkpoints are never deleted here: they belong to the checkpointer.

Readers never trust a directory without its marker (docs/quickstart.md#where-the-run-lives). The initial model
(`--hf-checkpoint`) is never deleted, even when it sits under the snapshot root.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from miles_core.storage import Store, normalize_uri

log = logging.getLogger(__name__)

MARKERS = (".complete", "COMPLETE")  # snapshots write .complete; trainer checkpoints write COMPLETE
_STEP_RE = re.compile(r"^step_(\d+)$")


def snapshot_dirname(step: int) -> str:
    return f"step_{step:08d}"


def on_cadence(step: int, interval: int | None) -> bool:
    """Step k (0-based) is an eval step when k+1 is a multiple of the interval (the save cadence rule)."""
    return bool(interval) and (step + 1) % interval == 0


@dataclass(frozen=True)
class SnapshotLayout:
    """The snapshot root and how step directories are named in it."""

    root_uri: str
    mode: str  # "export" | "reuse"
    template: str = ""  # reuse mode with a {step} placeholder in the last segment of --save-hf

    @classmethod
    def from_config(cls, cfg, run_uri: str | None = None) -> "SnapshotLayout":
        run_uri = run_uri or cfg.run_uri
        save_hf = cfg.train.save_hf
        if save_hf:
            return cls.for_save_hf(save_hf, run_uri)
        root = cfg.eval.eval_hf_dir or f"{run_uri}/snapshots"
        return cls(normalize_uri(root), "export")

    @classmethod
    def for_save_hf(cls, save_hf: str, run_uri: str) -> "SnapshotLayout":
        if "{step" in save_hf:
            parent, _, last = save_hf.rstrip("/").rpartition("/")
            if "{step" in parent:
                raise ValueError(f"--save-hf={save_hf!r}: the {{step}} placeholder must be in the last path segment.")
            return cls(normalize_uri(parent), "reuse", last)
        return cls(normalize_uri(save_hf), "reuse")

    @property
    def exports(self) -> bool:
        return self.mode == "export"

    def store(self) -> Store:
        return Store(self.root_uri)

    def dirname(self, step: int) -> str:
        return self.template.format(step=step) if self.template else snapshot_dirname(step)

    def uri(self, step: int) -> str:
        return f"{self.root_uri}/{self.dirname(step)}"

    def step_of(self, dirname: str) -> int | None:
        if self.template:
            pattern = re.escape(self.template)
            pattern = re.sub(r"\\\{step(?::[^}]*)?\\\}", r"(\\d+)", pattern)
            m = re.fullmatch(pattern, dirname)
        else:
            m = _STEP_RE.match(dirname)
        return int(m.group(1)) if m else None

    def is_complete(self, step: int, store: Store | None = None) -> bool:
        store = store or self.store()
        return any(store.exists(f"{self.dirname(step)}/{m}") for m in MARKERS)

    def scan(self, store: Store | None = None) -> tuple[list[int], list[int]]:
        """(complete steps, incomplete steps) under the root, sorted, from one listing."""
        store = store or self.store()
        seen: dict[int, bool] = {}
        for key in store.list(""):
            head, _, rest = key.partition("/")
            step = self.step_of(head)
            if step is None:
                continue
            done = rest in MARKERS
            seen[step] = seen.get(step, False) or done
        complete = sorted(s for s, ok in seen.items() if ok)
        return complete, sorted(s for s, ok in seen.items() if not ok)

    def complete_steps(self, store: Store | None = None) -> list[int]:
        return self.scan(store)[0]


def retire_snapshots(layout: SnapshotLayout, keep: int, pending: set[int], *,
                     protected_uris: tuple[str, ...] = ()) -> list[int]:
    """Ring retirement: delete settled exported snapshots beyond the newest `keep`; return the steps deleted.

    Never touches reuse-mode checkpoints, pending snapshots (an eval still needs them), the newest
    complete snapshot (with disk weight transport the engines load from it, and restart on it), or
    a protected URI (the initial model). Incomplete directories older than the newest complete
    snapshot and not pending are leftovers of failed exports and go too.
    """
    if not layout.exports:
        return []
    store = layout.store()
    complete, incomplete = layout.scan(store)
    protected = {normalize_uri(u).rstrip("/") for u in protected_uris if u and not u.startswith("builtin:")}
    settled = [s for s in complete[:-1] if s not in pending]  # the newest complete one always stays
    keep = max(0, keep - (1 if complete and complete[-1] not in pending else 0))
    doomed = settled[:-keep] if keep > 0 else settled
    newest = complete[-1] if complete else -1
    doomed += [s for s in incomplete if s < newest and s not in pending]
    deleted = []
    for step in sorted(doomed):
        if layout.uri(step).rstrip("/") in protected:
            continue
        try:
            store.delete_prefix(layout.dirname(step))
            deleted.append(step)
        except Exception as e:  # noqa: BLE001 - retirement is housekeeping; never fail training for it
            log.warning("could not retire snapshot %s: %s", layout.uri(step), e)
    return deleted
