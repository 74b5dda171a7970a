"""A recorded run, read-only: its config, checkpoints, consumption manifests and buffered groups.

    src = RecordedRun.open("file:///x/.miles/runs/a")   # RunNotFound / LineageError on a bad root
    src.require_checkpoint(k)                          # or LineageError listing the complete steps
    src.manifests(k)                                   # buffer/consumed/{0..k}.json, in step order
    for key, data, groups in src.read_objects(keys): ...

Fork and replay read the source run only through this view, which never writes. The config is
the run root's latest segment (`run_root.read_config`), re-rooted at the URI it was opened with:
a run recorded with a relative `--storage-root` (e.g. `.miles`) must not send reads to another
directory when the command runs elsewhere.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

from miles_core.buffer import objects as O
from miles_core.buffer.manifests import REBUILT_IDS, BadManifest, ConsumptionRecord, parse_manifest, read_consumption
from miles_core.config import RunConfig, replace_fields
from miles_core.config.record import read_run_config
from miles_core.storage import ObjectNotFound, StorageError, Store, normalize_uri
from miles_core.storage.run_root import require_run
from miles_core.train.checkpoint import CheckpointManager

log = logging.getLogger(__name__)

READ_THREADS = 16  # object-store latency, not CPU, bounds reading many objects
FORK_KEY = "FORK.json"  # a forked run's origin (miles_core.lineage.fork)
_RUN_URI = re.compile(r"^(?P<root>.+)/runs/(?P<run_id>[^/]+)$")


class LineageError(ValueError):
    """A fork or replay that cannot be done as asked; the message names the problem and what to do."""

    def __init__(self, message: str):
        super().__init__(message)


def rooted(cfg: RunConfig, run_uri: str) -> RunConfig:
    """`cfg` with --storage-root / --run-id taken from `run_uri` ({storage_root}/runs/{run_id})."""
    m = _RUN_URI.match(run_uri)
    return cfg if m is None else replace_fields(cfg, storage_root=m["root"], run_id=m["run_id"])


@dataclass(frozen=True)
class RecordedRun:
    uri: str
    store: Store
    cfg: RunConfig

    @classmethod
    def open(cls, run_uri: str) -> "RecordedRun":
        store = require_run(Store(normalize_uri(run_uri)))
        cfg = read_run_config(store)
        if cfg is None:
            raise LineageError(f"{store.root_uri} has no config.json: it never started a training segment, so "
                               "there is no recorded config, checkpoint or consumption to fork or replay")
        return cls(store.root_uri, store, rooted(cfg, store.root_uri))

    def source(self) -> "RecordedRun | None":
        """The run this one was forked from (its FORK.json), None for a run that was not forked."""
        try:
            origin = self.store.get_json(FORK_KEY)
        except ObjectNotFound:
            return None
        return RecordedRun.open(origin["source_run"])

    @property
    def checkpoints(self) -> CheckpointManager:
        return CheckpointManager.from_config(self.cfg.train, self.store)

    def complete_steps(self) -> list[int]:
        manager = self.checkpoints
        return [] if manager.store is None else manager.complete_steps()

    def require_checkpoint(self, step: int) -> CheckpointManager:
        """The checkpoint manager, when step `step` has a complete checkpoint; else LineageError."""
        steps = self.complete_steps()
        if step not in steps:
            have = ", ".join(map(str, steps)) or "none (--save '' or no save yet)"
            raise LineageError(f"{self.uri} has no complete checkpoint of step {step}; complete checkpoints: {have}")
        return self.checkpoints

    def manifests(self, through: int, start: int = 0) -> list[dict]:
        """The consumption manifests of steps start..through, in step order (what each step trained on)."""
        steps = range(start, through + 1)
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="lineage-read") as pool:
            found = list(pool.map(self._manifest, [O.consumed_key(step) for step in steps]))
        missing = [step for step, m in zip(steps, found) if m is None]
        if missing:
            raise LineageError(f"{self.uri} lacks the consumption manifests of steps {_ranges(missing)} "
                               f"({self.store.uri(O.CONSUMED)}); without them the groups each step trained on "
                               "are unknown")
        return found

    def recorded_steps(self) -> list[int]:
        """The steps that have a consumption manifest, in order."""
        return sorted(s for k in self.store.list(O.CONSUMED) if (s := O.consumed_step(k)) is not None)

    def later_manifests(self, after: int) -> list[dict]:
        """The consumption manifests of the steps after `after` that exist now and parse (one that does
        not is skipped with a warning; `consumption()` says which)."""
        return [m for s, m in self.consumption().manifests.items() if s > after]

    def consumption(self) -> ConsumptionRecord:
        """Every manifest that parses, the steps whose manifest does not, and the compaction record."""
        return read_consumption(self.store)

    def _manifest(self, key: str) -> dict | None:
        try:
            manifest = parse_manifest(self.store.get_bytes(key), self.store.uri(key))
        except ObjectNotFound:
            return None
        except BadManifest as e:
            raise LineageError(f"{e}: the groups that step trained on are unknown, so the run cannot be forked or "
                               "replayed through it. Restore the file from a backup, or fork or replay an earlier "
                               "step.") from e
        if REBUILT_IDS in manifest:
            raise LineageError(f"{self.store.uri(key)} was rebuilt from the compaction record (`miles doctor "
                               "--repair`): it says which groups that step took, not which it trained or in what "
                               "order, so the run cannot be forked or replayed through it. Restore the original "
                               "from a backup, or fork or replay an earlier step.")
        return manifest

    def group_keys(self) -> list[str]:
        """Every committed group object, in commit order (writer ids start with their start time)."""
        return sorted(k for k in self.store.list(O.GROUPS) if O.split_group_key(k) is not None)

    def read_objects(self, keys: list[str]) -> Iterator[tuple[str, bytes, list[O.StoredGroup]]]:
        """(key, bytes, groups) of each object, in order; vanished or undecodable ones are skipped
        with a warning (a run moves undecodable objects to quarantine; they hold nothing to reuse)."""
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="lineage-read") as pool:
            for key, got in zip(keys, pool.map(self._read_object, keys)):
                if isinstance(got, tuple):
                    yield key, *got
                else:
                    log.warning("skipping group object %s: %s", self.store.uri(key), got)

    def _read_object(self, key: str) -> tuple[bytes, list[O.StoredGroup]] | str:
        try:
            data = self.store.get_bytes(key)
            return data, O.decode_object(data, self.store.uri(key))
        except ObjectNotFound:
            return "vanished (deleted since it was listed)"
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - an undecodable object is skipped, named in the log
            return f"undecodable: {e}"


def _ranges(steps: list[int]) -> str:
    return ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in O.to_ranges(set(steps)))
