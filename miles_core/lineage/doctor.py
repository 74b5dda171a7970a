"""`miles doctor RUN_URI [--repair] [--verify-checksums] [--json]`: a run root checked end to end, and repaired.

    report = diagnose("file:///x/.miles/runs/r")   # Report: .findings, .errors, .can_continue
    print(render_report(report))
    report = repair("file:///x/.miles/runs/r")     # the repairs below, then the check again; RepairRefused
                                                   # while a live writer holds the lease

Every part is read through the reader the run itself uses, so doctor says what a resume or a reader would
meet:
- markers: config.json and each resumed segment's config record (miles_core.config.record), STATUS.json
  (run_root.parse_status; one that does not parse is rebuilt on read by storage.status_rebuild), the
  checkpoints' LATEST pointer;
- the lease (storage.lease.LeaseRecord): parses; released, held (by whom, until when) or expired;
- checkpoints (train.checkpoint.CheckpointManager.verify): each complete one against its COMPLETE (sizes;
  checksums with --verify-checksums, or when the checkpoint is small, as a resume does), the one a resume
  starts from, and step directories without COMPLETE older than the newest complete one (an interrupted
  save's orphans);
- consumption records (buffer.manifests.read_consumption): manifests that do not parse or are missing, the
  compaction record, judged against the step a resume starts from as buffer.durable reopens them;
- buffer objects against the manifests (buffer.objects.decode_object): objects that do not decode, groups
  the records name whose object is gone before all its groups were consumed, gaps in a writer's objects,
  objects holding groups an earlier object holds (a copy), files there that are not group objects;
- eval results and requests (eval.results), snapshots (eval.snapshots: the marker);
- temporaries of unfinished writes (Store.list_temporaries), except young ones under a live lease.
A finding has a key (a URI), a kind, a severity (ok; warning: the run continues but something is lost or
degraded; error: the run cannot continue as it is), what it means for the run, the fix, and the repair
`--repair` makes for it, if any.

`--repair` makes only these repairs, and refuses while a live writer holds the lease:
- STATUS.json that does not parse (or is missing from a run with history): rebuilt from the checkpoints and
  consumption manifests (storage.status_rebuild);
- a consumption manifest the compaction record covers that does not parse: rebuilt from the compaction
  record when its groups can be told exactly (buffer.manifests says how, and what a rebuilt one records);
- moved under quarantine/doctor/{time}/ + the original key (never deleted): records that do not parse
  (eval results and requests, a resumed segment's config record, the lease record, the compaction record
  when every manifest through its step is readable, a manifest that is rebuilt), temporaries of unfinished
  writes, checkpoint step directories without COMPLETE older than the newest complete one, files under
  buffer/groups/ that are not group objects;
- a buffer object that does not decode, or whose groups an earlier object holds all of: moved to
  buffer/quarantine/ with a `.reason.json`, as a buffer reopen does with one that does not decode.
It never moves or deletes the only stored copy of a committed group that decodes, a complete checkpoint,
or config.json (readers need it where it is: restore it from a backup). Each repair run writes
quarantine/doctor/{time}/REPAIRS.json.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import miles_core.buffer.objects as O
from miles_core.buffer.manifests import REBUILT_IDS, ConsumptionRecord, read_consumption
from miles_core.config import ConfigError
from miles_core.config.record import read_run_config
from miles_core.config.tree import RunConfig, config_from_dict
from miles_core.eval.results import REQUESTS_PREFIX, SKIPPED_NAME, evaluated, read_result, result_key
from miles_core.eval.snapshots import SnapshotLayout
from miles_core.lineage.recorded import FORK_KEY
from miles_core.samples import SchemaError
from miles_core.storage import ObjectNotFound, StorageError, StorageUnavailable, Store, normalize_uri
from miles_core.storage.lease import LEASE_KEY, LeaseError, LeaseRecord
from miles_core.storage.run_root import (
    CONFIG_KEY,
    STATUS_KEY,
    get_json_or_none,
    parse_status,
    require_run,
    segment_config_key,
    write_status,
)
from miles_core.storage.status_rebuild import has_history, rebuilt_status
from miles_core.train.checkpoint import LATEST, CheckpointError, CheckpointManager, step_dir

OK, WARNING, ERROR = "ok", "warning", "error"
QUARANTINE = "quarantine/doctor"
IN_FLIGHT_SECONDS = 3600.0  # a temporary this young, under a live lease, is a write in progress
READ_THREADS = 16  # object-store latency, not CPU, bounds reading every object
_STEP_KEY = re.compile(r"^step_(\d{8})/")
_REQUEST = re.compile(r"^eval/requests/step_\d+\.json$")


class RepairRefused(ValueError):
    """`miles doctor --repair` on a run root a live writer holds: nothing was changed."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class Repair:
    """What --repair does for a finding: `action` on `key` of `store`."""

    action: str  # rebuild_status | rebuild_manifest | quarantine | quarantine_dir | quarantine_object
    store: Store
    key: str
    detail: Any = None
    order: int = 0  # repairs run in this order: temporaries, directories, objects, records, rebuilds

    def describe(self) -> str:
        if self.action == "rebuild_manifest":
            return (f"rebuild it from {self.detail['from']} ({_plural(len(self.detail['ids']), 'group')}, consumed or "
                    "rejected); "
                    f"the original goes under {QUARANTINE}/{{time}}/")
        return {"rebuild_status": "rebuild it from the checkpoints and consumption manifests; a damaged original goes "
                                  f"under {QUARANTINE}/{{time}}/",
                "quarantine": f"move it under {QUARANTINE}/{{time}}/",
                "quarantine_dir": f"move its files under {QUARANTINE}/{{time}}/",
                "quarantine_object": f"move it to {O.QUARANTINE} with a .reason.json"}[self.action]


@dataclass
class Finding:
    key: str  # the file or prefix, as a URI
    kind: str
    severity: str
    what: str  # what was found
    meaning: str = ""  # what it means for the run
    fix: str = ""
    repair: Repair | None = None

    def to_json(self) -> dict:
        return {"key": self.key, "kind": self.kind, "severity": self.severity, "what": self.what,
                "meaning": self.meaning, "fix": self.fix, "repair": self.repair.describe() if self.repair else None}


@dataclass
class Report:
    run_uri: str
    findings: list[Finding]
    lease_holder: str = ""  # the live writer, "" when none holds the lease now
    lease_expires_at: float = 0.0
    repairs: list[dict] | None = None  # what --repair did (None: not asked)
    before: "Report | None" = None  # the findings --repair started from

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def can_continue(self) -> bool:
        return self.count(ERROR) == 0

    def to_json(self) -> dict:
        out = {"run_uri": self.run_uri, "findings": [f.to_json() for f in _ordered(self.findings)],
               "errors": self.count(ERROR), "warnings": self.count(WARNING), "can_continue": self.can_continue}
        if self.repairs is not None:
            out["repairs"] = self.repairs
            out["before_repair"] = self.before.to_json() if self.before else None
        return out


def diagnose(run_uri: str, *, verify_checksums: bool = False) -> Report:
    """Every finding of the run root at `run_uri` (RunNotFound when it holds no run); writes nothing."""
    with _quiet():
        return _Doctor(run_uri, verify_checksums).run()


def repair(run_uri: str, *, verify_checksums: bool = False) -> Report:
    """The repairs of the findings that have one (see the module doc), then the check again: the report of
    what remains, with `repairs` and `before`. RepairRefused, changing nothing, while a live writer holds
    the lease."""
    before = diagnose(run_uri, verify_checksums=verify_checksums)
    if before.lease_holder:
        raise RepairRefused(
            f"run root {before.run_uri} is being written by {before.lease_holder} (its lease expires "
            f"{_when(before.lease_expires_at)}): doctor repairs only a run root no writer holds. Let that segment "
            "end, or wait for its lease to expire if it died, and run `miles doctor --repair` again.")
    stamp = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"  # two repairs never collide
    store = Store(before.run_uri)
    done = []
    with _quiet():
        for f in sorted((f for f in before.findings if f.repair), key=lambda f: f.repair.order):
            try:
                done.append({"key": f.key, "kind": f.kind, **_apply(f.repair, stamp, f.what)})
            except StorageUnavailable:
                raise
            except (StorageError, OSError, ValueError) as e:
                done.append({"key": f.key, "kind": f.kind, "action": "failed", "detail": f"{type(e).__name__}: {e}"})
        if done:
            store.put_json(f"{QUARANTINE}/{stamp}/REPAIRS.json", {"at": time.time(), "repairs": done})
    after = diagnose(run_uri, verify_checksums=verify_checksums)
    after.repairs, after.before = done, before
    return after


# ----------------------------------------------------------------------------- the checks


class _Doctor:
    def __init__(self, run_uri: str, verify_checksums: bool):
        self.store = require_run(Store(normalize_uri(run_uri)))
        self.uri = self.store.root_uri
        self.verify_checksums = verify_checksums
        self.now = time.time()
        self.findings: list[Finding] = []
        self.lease_holder, self.lease_expires_at = "", 0.0

    def add(self, key: str, kind: str, severity: str, what: str, meaning: str = "", fix: str = "",
            repair: Repair | None = None) -> None:
        self.findings.append(Finding(key, kind, severity, what, meaning, fix, repair))

    def run(self) -> Report:
        self.cfg = self._configs()
        self._status()
        self._lease()
        self.resume = self._checkpoints()
        self.record = read_consumption(self.store)
        self.objects = self._read_objects()
        self._consumption()
        self._buffer_objects()
        self._evals()
        self._snapshots()
        self._temporaries()
        return Report(self.uri, self.findings, self.lease_holder, self.lease_expires_at)

    # ------------------------------------------------------------------ markers

    def _configs(self) -> RunConfig:
        """Check config.json and every resumed segment's record; the newest config that parses (the defaults
        when none does: the layout doctor then assumes is the default one)."""
        good, segment = None, 0
        while segment == 0 or self.store.exists(segment_config_key(segment)):
            key = segment_config_key(segment)
            try:
                cfg = read_run_config(self.store, segment)
            except StorageUnavailable:
                raise
            except (StorageError, ConfigError, ValueError, TypeError, AttributeError) as e:
                self._bad_config(segment, key, e)
            else:
                if cfg is None and segment == 0:
                    self._missing_config()
                good = cfg or good
            segment += 1
        if good is not None and not any(f.kind == "config" for f in self.findings):
            self.add(self.store.uri(CONFIG_KEY), "config", OK,
                     f"config.json{f' and {segment - 1} resumed segments' if segment > 1 else ''} parse"
                     f"{'' if segment > 1 else 's'}")
        if good is None:
            self.add(self.store.uri(CONFIG_KEY), "layout", OK, "no config record parses: the checks below assume the "
                     "default layout (checkpoints under checkpoints/, snapshots under snapshots/)")
        return good if good is not None else config_from_dict({})

    def _bad_config(self, segment: int, key: str, e: Exception) -> None:
        why = f"does not parse as a run config ({type(e).__name__}: {str(e)[:300]})"
        if segment == 0:
            self.add(self.store.uri(key), "config", ERROR, why,
                     "config.json records how the run started: the next execution refuses to continue over it (its "
                     "plan and its training segment say so), and `miles runs show`, lineage, fork and replay of a run "
                     "without a later segment record fail on it",
                     "restore it from a backup. It is {\"segment\": 0, \"written_at\": ..., \"config\": {...}}; "
                     "`miles validate` with the run's flags prints the resolved config that goes under \"config\". "
                     "--repair leaves it where it is.")
            return
        self.add(self.store.uri(key), "config", WARNING, why,
                 f"the record of segment {segment}'s settings: `miles runs show`, lineage, fork, replay, the report "
                 "and producer jobs read the newest segment's config and stop on it; training continues (the next "
                 "segment writes its own).",
                 "restore it from a backup, or let --repair move it aside (readers then use the previous segment's).",
                 Repair("quarantine", self.store, key, order=3))

    def _missing_config(self) -> None:
        later = self.store.exists(segment_config_key(1))
        self.add(self.store.uri(CONFIG_KEY), "config", WARNING, "missing",
                 "the record of how the run started is gone: readers use the newest segment's config"
                 if later else "`miles runs show`, lineage, fork and replay say the run never started a training "
                               "segment until a new segment writes its config",
                 "restore it from a backup")

    def _status(self) -> None:
        key = self.store.uri(STATUS_KEY)
        try:
            raw = self.store.get_bytes(STATUS_KEY)
        except ObjectNotFound:
            if not has_history(self.store):
                self.add(key, "status", OK, "none: the run never started a segment")
                return
            rebuilt = rebuilt_status(self.store, "")
            self.add(key, "status", WARNING, "missing, in a run that has checkpoints or consumption manifests",
                     f"every reader and the next segment rebuild it on read from the checkpoints and consumption "
                     f"manifests ({rebuilt['state']} after step {rebuilt['last_step']}, segment {rebuilt['segment']}) "
                     "and warn each time; nothing is lost",
                     "--repair writes the rebuilt one",
                     Repair("rebuild_status", self.store, STATUS_KEY, "STATUS.json was missing", order=5))
            return
        try:
            status = parse_status(raw)
        except (ValueError, TypeError) as e:
            rebuilt = rebuilt_status(self.store, "")
            self.add(key, "status", WARNING, f"does not parse ({len(raw)} bytes: {str(e)[:200]})",
                     f"every reader and the next segment rebuild it on read from the checkpoints and consumption "
                     f"manifests ({rebuilt['state']} after step {rebuilt['last_step']}, segment {rebuilt['segment']}) "
                     "and warn each time; nothing is lost",
                     "--repair writes the rebuilt one (the damaged file is kept under quarantine/doctor/)",
                     Repair("rebuild_status", self.store, STATUS_KEY, f"STATUS.json did not parse ({e})", order=5))
            return
        message = f": {status.message}" if status.message else ""
        self.add(key, "status", OK, f"{status.state} after step {status.last_step} (segment {status.segment}){message}")

    def _lease(self) -> None:
        key = self.store.uri(LEASE_KEY)
        try:
            raw = self.store.get_bytes(LEASE_KEY)
        except ObjectNotFound:
            self.add(key, "lease", OK, "none: no segment ever held it")
            return
        try:
            rec = LeaseRecord.from_bytes(raw, key)
        except LeaseError as e:
            self.add(key, "lease", ERROR, f"not a lease record ({len(raw)} bytes)",
                     f"the next segment stops with LeaseError: it cannot tell whether a writer holds the run root "
                     f"({str(e).split(' is not a lease record ', 1)[-1].split(';', 1)[0].strip('()')})",
                     "make sure no segment of this run is running, then let --repair move it aside (the next "
                     "segment creates a fresh one)", Repair("quarantine", self.store, LEASE_KEY, order=3))
            return
        if rec.released:
            self.add(key, "lease", OK, f"released by {rec.holder}")
        elif self.now < rec.expires_at:
            self.lease_holder, self.lease_expires_at = rec.holder, rec.expires_at
            self.add(key, "lease", OK, f"held by {rec.holder} until {_when(rec.expires_at)}",
                     "a segment is writing the run root now: another segment is refused until it ends, and "
                     "--repair is refused")
        else:
            self.add(key, "lease", WARNING, f"expired {_when(rec.expires_at)}, held by {rec.holder} and never released",
                     "its segment stopped without ending (killed, or its node lost): the next segment takes the "
                     "lease over and trains again the steps after the last checkpoint")

    # ------------------------------------------------------------------ checkpoints

    def _checkpoints(self) -> int:
        """Check every checkpoint; the step a resume starts from (-1: none)."""
        mgr = CheckpointManager.from_config(self.cfg.train, self.store)
        if mgr.store is None:
            self.add(self.uri, "checkpoints", OK, "checkpoints are disabled (--save ''): a resume starts at step 0")
            return -1
        mgr.verify_checksums = self.verify_checksums or mgr.verify_checksums
        self.ckpt = mgr
        where = self._in_run_root(mgr.store)
        complete = mgr.complete_steps()
        wrong = {step: mgr.verify(step) for step in complete}
        verified = [s for s in complete if not wrong[s]]
        resume = max(verified, default=-1)
        for step in complete:
            if wrong[step]:
                self._bad_checkpoint(mgr, step, wrong[step], resume)
        if verified:
            how = "sizes and checksums" if mgr.verify_checksums else "sizes; checksums of those under 256 MiB"
            legacy = [s for s in verified if _legacy(mgr, s)]
            old = f"; steps {_steps(legacy)} have an older version's empty COMPLETE: trusted, not verified" \
                if legacy else ""
            self.add(mgr.store.uri(), "checkpoints", OK,
                     f"{len(verified)} of {len(complete)} complete checkpoints verify ({how}): steps "
                     f"{_steps(verified)}; a resume starts after step {resume}{old}")
        elif not complete:
            self.add(mgr.store.uri(), "checkpoints", OK, "no complete checkpoint: a resume starts at step 0")
        self._incomplete_dirs(mgr, complete, where)
        self._latest(mgr, complete, verified)
        return resume

    def _bad_checkpoint(self, mgr: CheckpointManager, step: int, wrong: list[str], resume: int) -> None:
        key, what = mgr.store.uri(step_dir(step)), "does not verify against its COMPLETE: " + "; ".join(wrong)[:600]
        fix = ("restore its files from a backup; otherwise leave it: the run writes this step again when it gets "
               "there (--repair never moves a complete checkpoint)")
        if resume < 0:
            self.add(key, "checkpoint", ERROR, what, "no complete checkpoint verifies: a resume stops with "
                     "CheckpointError", "restore a checkpoint from a backup, or move the damaged step directories "
                     "away to start over from step 0")
        elif step > resume:
            self.add(key, "checkpoint", WARNING, what,
                     f"a resume skips it and falls back to step {resume}: steps {resume + 1}..{step} are trained "
                     "again (their groups consumed again)", fix)
        else:
            self.add(key, "checkpoint", WARNING, what,
                     f"older than the checkpoint a resume starts from (step {resume}): only a further fallback would "
                     "need it", fix)

    def _incomplete_dirs(self, mgr: CheckpointManager, complete: list[int], where: tuple[Store, str]) -> None:
        steps = sorted({int(m.group(1)) for k in mgr.store.list("") if (m := _STEP_KEY.match(k))} - set(complete))
        newest = max(complete, default=-1)
        for step in steps:
            key = mgr.store.uri(step_dir(step))
            if step < newest:
                self.add(key, "orphaned-checkpoint", WARNING,
                         f"a step directory without COMPLETE, older than the newest complete checkpoint ({newest})",
                         "an interrupted save: never read, it only takes space",
                         "--repair moves its files under quarantine/doctor/",
                         Repair("quarantine_dir", where[0], where[1] + step_dir(step), order=1))
            else:
                self.add(key, "checkpoint", OK, "a step directory without COMPLETE (a save in progress or interrupted)",
                         "never read: the run writes that step again when it saves it")

    def _latest(self, mgr: CheckpointManager, complete: list[int], verified: list[int]) -> None:
        key = mgr.store.uri(LATEST)
        try:
            named = mgr.store.get_bytes(LATEST).decode(errors="replace").strip()
        except ObjectNotFound:
            if complete:
                self.add(key, "latest", WARNING, "missing",
                         "the run does not read it (a resume lists the checkpoints); tools that follow LATEST find "
                         "nothing", "the next checkpoint writes it")
            return
        if named in {step_dir(s) for s in verified}:
            self.add(key, "latest", OK, f"points at {named}")
            return
        if named in {step_dir(s) for s in complete}:
            start = f"step {verified[-1]}, the newest that verifies" if verified else "none: no checkpoint verifies"
            self.add(key, "latest", WARNING, f"points at {named}, which does not verify against its COMPLETE",
                     f"a resume does not start from it but after {start}; tools that follow LATEST are misled",
                     "the next checkpoint rewrites it")
            return
        newest = f" (the newest complete one is {step_dir(complete[-1])})" if complete else ""
        self.add(key, "latest", WARNING, f"points at {named[:80]!r}, which is not a complete checkpoint{newest}",
                 "the run does not read it (a resume lists the checkpoints and starts from the newest that "
                 "verifies); tools that follow LATEST are misled", "the next checkpoint rewrites it")

    # ------------------------------------------------------------------ records

    def _consumption(self) -> None:
        rec, resume = self.record, self.resume
        steps = sorted([*rec.manifests, *rec.unreadable])
        compaction = self._compaction_step()
        # As the buffer reopens at `resume`: a compaction after it is discarded and every manifest read instead.
        base = rec.compacted_through if rec.compacted_through is not None and rec.compacted_through <= resume else -1
        if rec.compaction_error:
            self._bad_compaction(rec, compaction)
        elif rec.compacted_through is not None and rec.compacted_through > resume and rec.compaction_deleted_objects:
            self.add(self.store.uri(O.compact_key(rec.compacted_through)), "compaction", ERROR,
                     f"compacts through step {rec.compacted_through}, after the step a resume starts from ({resume}), "
                     "and its consumed objects were deleted (--buffer-delete-consumed-objects)",
                     f"the groups consumed after step {resume} are gone and cannot be trained again: the resume stops "
                     "with DataBufferError", "restore the checkpoint of that step (or a later one) from a backup, or "
                     "move the record away to accept losing those groups")
        for step, why in rec.unreadable.items():
            self._bad_manifest(step, why.replace(self.store.uri(O.consumed_key(step)) + " ", "", 1), base, resume)
        self._missing_manifests(steps, base, resume)
        if steps:
            through = "" if rec.compacted_through is None else f", compacted through step {rec.compacted_through}"
            rebuilt = f", {len(rec.rebuilt_steps())} rebuilt by doctor" if rec.rebuilt_steps() else ""
            self.add(self.store.uri(O.CONSUMED), "manifests", OK,
                     f"{len(rec.manifests)} of {len(steps)} consumption manifests parse (steps {steps[0]}..{steps[-1]})"
                     f"{through}{rebuilt}")

    def _compaction_step(self) -> int | None:
        return max((s for k in self.store.list(O.COMPACTED) if (s := O.compact_step(k)) is not None), default=None)

    def _bad_compaction(self, rec: ConsumptionRecord, step: int | None) -> None:
        key = O.compact_key(step) if step is not None else O.COMPACTED
        readable = step is not None and all(s in rec.manifests for s in range(step + 1))
        self.add(self.store.uri(key), "compaction", ERROR, rec.compaction_error,
                 "a resume reads it to know what was consumed and stops with DataBufferError",
                 "--repair moves it aside: every consumption manifest through its step is readable, so a resume "
                 "reads them instead (slower, nothing lost)" if readable else
                 "restore it from a backup (a manifest through its step is missing or does not parse, so the "
                 "manifests cannot stand in for it)",
                 Repair("quarantine", self.store, key, order=3) if readable else None)

    def _bad_manifest(self, step: int, why: str, base: int, resume: int) -> None:
        key = self.store.uri(O.consumed_key(step))
        through = self.record.compacted_through
        if through is not None and step <= through:
            repair = self._manifest_rebuild(step)
            fix = (f"--repair rebuilds it from the compaction record ({_plural(len(repair.detail['ids']), 'group')}, "
                   "consumed or rejected: which of the two, and their order, is not recorded)" if repair else
                   "restore it from a backup (it cannot be rebuilt exactly: "
                   f"{self._why_not_rebuilt(step) or 'the compaction record leaves no group for it'})")
            if step <= base:
                self.add(key, "manifest", WARNING, why,
                         f"training is unaffected (the compaction through step {base} stands for it on resume), but "
                         f"which groups step {step} took is unknown: `runs show` and lineage count them as consumed or "
                         "rejected at an unreadable step, fork and replay through it refuse", fix, repair)
            else:
                self.add(key, "manifest", ERROR, why,
                         f"a resume from step {resume} falls back before the compaction (step {through}) and reads "
                         "every manifest instead: it cannot tell this step's groups from unconsumed ones and stops with "
                         "DataBufferError rather than train them twice", fix, repair)
        elif step <= resume:
            self.add(key, "manifest", ERROR, why,
                     f"a resume (from step {resume}) cannot tell its groups from unconsumed ones and stops with "
                     "DataBufferError rather than train them twice",
                     "restore it from a backup, or delete it and every later manifest and resume from a checkpoint "
                     "before that step")
        else:
            self.add(key, "manifest", WARNING, why,
                     f"after the step a resume starts from ({resume}): the resume deletes it and trains that step "
                     "again; until then `runs show` counts its groups as available", "none needed")

    def _missing_manifests(self, steps: list[int], base: int, resume: int) -> None:
        missing = sorted(set(range(steps[-1] + 1)) - set(steps)) if steps else []
        covered = [s for s in missing if s <= base]
        at_risk = [s for s in missing if base < s <= resume]
        if covered:
            self.add(self.store.uri(O.CONSUMED), "manifest", WARNING,
                     f"no consumption manifest for steps {_steps(covered)}",
                     "training is unaffected (the compaction record stands for them), but which groups those steps "
                     "took is unknown to lineage, fork and replay", "restore them from a backup")
        if at_risk:
            self.add(self.store.uri(O.CONSUMED), "manifest", ERROR,
                     f"no consumption manifest for steps {_steps(at_risk)}, at or before the step a resume starts "
                     f"from ({resume})",
                     "a resume cannot see that those steps consumed their groups and serves them again: they would "
                     "be trained twice", "restore them from a backup")

    def _manifest_rebuild(self, step: int) -> Repair | None:
        """The rebuild of covered step `step`'s manifest when its groups can be told exactly, else None."""
        rec = self.record
        if self._why_not_rebuilt(step):
            return None
        through = rec.compacted_through
        ids = set(rec.compacted_ids)
        for writer, seqs in rec.compacted_done.items():
            for seq in seqs:
                ids.update(g.group_id for g in self.objects[O.group_key(writer, seq)])
        for s, m in rec.manifests.items():
            if s <= through:
                ids.difference_update(m.get("consumed", ()), m.get("rejected", ()), m.get(REBUILT_IDS, ()))
        if not ids:
            return None
        return Repair("rebuild_manifest", self.store, O.consumed_key(step),
                      {"ids": sorted(ids), "from": O.compact_key(through), "step": step}, order=4)

    def _why_not_rebuilt(self, step: int) -> str:
        rec = self.record
        through = rec.compacted_through
        others = [s for s in range(through + 1) if s != step and s not in rec.manifests]
        if others:
            return f"the manifests of steps {_steps(others)} are missing or do not parse too"
        gone = [O.group_key(w, s) for w, seqs in rec.compacted_done.items() for s in sorted(seqs)
                if not isinstance(self.objects.get(O.group_key(w, s)), list)]
        if gone:
            return f"{len(gone)} objects the compaction counts as consumed are gone or do not decode"
        return ""

    def _evals(self) -> None:
        good = 0
        for step, names in sorted(evaluated(self.store).items()):
            for name in sorted(names):
                key = result_key(step, name)
                try:
                    if name == SKIPPED_NAME:
                        if not isinstance(self.store.get_json(key), dict):
                            raise ValueError("not a JSON object")
                    else:
                        read_result(self.store, step, name)
                    good += 1
                except StorageUnavailable:
                    raise
                except (StorageError, ValueError, TypeError, AttributeError) as e:
                    self.add(self.store.uri(key), "eval-result", WARNING, f"does not parse ({str(e)[:200]})",
                             f"readers skip it (`runs show`, lineage, the report miss step {step}'s {name} eval) and "
                             "the eval scheduler counts the step as evaluated",
                             "--repair moves it under quarantine/doctor/ (the step then counts as not evaluated)",
                             Repair("quarantine", self.store, key, order=3))
        for key in self.store.list(REQUESTS_PREFIX):
            if not _REQUEST.match(key):
                continue
            try:
                if not isinstance(self.store.get_json(key), dict):
                    raise ValueError("not a JSON object")
            except StorageUnavailable:
                raise
            except (StorageError, ValueError) as e:
                self.add(self.store.uri(key), "eval-request", WARNING, f"does not parse ({str(e)[:200]})",
                         "the eval follower and lineage cannot read this request", "--repair moves it under "
                         "quarantine/doctor/", Repair("quarantine", self.store, key, order=3))
        if good:
            self.add(self.store.uri("eval"), "eval-results", OK, f"{_plural(good, 'eval result')}: each parses")

    def _snapshots(self) -> None:
        layout = SnapshotLayout.from_config(self.cfg, self.uri)
        complete, incomplete = layout.scan()
        newest = max(complete, default=-1)
        for step in incomplete:
            if step < newest and layout.exports:
                self.add(layout.uri(step), "snapshot", WARNING, "a snapshot directory without its .complete marker",
                         f"an export that did not finish: step {step} was never evaluated from it; the run retires "
                         "such directories with its next snapshots", "none needed")
            else:
                self.add(layout.uri(step), "snapshot", OK, "a snapshot directory without its marker (an export in "
                         "progress or interrupted): never read")
        self.add(layout.root_uri, "snapshots", OK,
                 f"{_plural(len(complete), 'complete snapshot')}{f' (steps {_steps(complete)})' if complete else ''}")

    # ------------------------------------------------------------------ buffer objects

    def _read_objects(self) -> dict[str, list[O.StoredGroup] | Exception | None]:
        """Every group object decoded: its groups, the decode error, or None when it vanished meanwhile."""
        listed = self.store.list(O.GROUPS)
        keys = [k for k in listed if O.split_group_key(k) is not None]
        self.strays = [k for k in listed if O.split_group_key(k) is None]
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="doctor-read") as pool:
            return dict(zip(keys, pool.map(lambda key: O.fetch_object(self.store, key), keys)))

    def _buffer_objects(self) -> None:
        rec = self.record
        done = self._done()
        fork = self._fork_record()
        # A fork holds the source's manifests of steps 0..at_step without the objects consumed entirely by then.
        shared = int(fork.get("at_step", -1)) if isinstance(fork.get("at_step"), int) else -1
        for key, got in self.objects.items():
            if isinstance(got, Exception):
                parsed = O.split_group_key(key)
                consumed = parsed is not None and parsed[1] in done.get(parsed[0], ())
                self.add(self.store.uri(key), "group-object", WARNING, f"does not decode ({str(got)[:300]})",
                         "its groups were all consumed: only lineage and replay lose its samples" if consumed else
                         "a buffer reopen moves it to buffer/quarantine/: the groups it held are never trained",
                         f"--repair moves it to {O.QUARANTINE} now, with the reason",
                         Repair("quarantine_object", self.store, key, str(got), order=2))
        self._strays()
        self._copies()
        present = {g.group_id for got in self.objects.values() if isinstance(got, list) for g in got}
        quarantined = {p for k in self.store.list(O.QUARANTINE) if k.endswith(".arrow")
                       and (p := O.split_group_key(O.GROUPS + k[len(O.QUARANTINE):])) is not None}
        self._gaps(done, quarantined, float(fork.get("created_at") or 0.0) if fork else 0.0)
        through = max(-1 if rec.compacted_through is None else rec.compacted_through, shared)
        named_later = {g for s, m in rec.manifests.items() if s > through
                       for g in (*m.get("consumed", ()), *m.get("rejected", ()))}
        lost = sorted((set(rec.compacted_ids) | named_later) - present)
        if lost:
            also = " (or quarantined as undecodable)" if quarantined else ""
            self.add(self.store.uri(O.GROUPS), "lost-groups", WARNING,
                     f"{len(lost)} groups the consumption records name are in no stored object (first: "
                     f"{', '.join(lost[:3])}): their objects were deleted{also} before all their groups were consumed",
                     "the groups of those objects that were not consumed yet are lost: never trained",
                     "restore the objects from a backup")
        retention = rec.compaction_deleted_objects or self.cfg.buffer.buffer_delete_consumed_objects
        early = {g for s, m in rec.manifests.items() if shared < s <= through for g in m.get("consumed", ())} - present
        if early and not retention:
            first = ", ".join(sorted(early)[:3])
            self.add(self.store.uri(O.GROUPS), "consumed-groups-gone", WARNING,
                     f"{len(early)} consumed groups are in no stored object (first: {first}), and the run does not "
                     "delete consumed objects (--buffer-delete-consumed-objects is off)",
                     "training is unaffected; lineage shows no samples for them and replay through their steps "
                     "refuses", "restore the objects from a backup")
        if self.objects and not any(f.kind in ("group-object", "lost-groups", "lost-object")
                                    for f in self.findings):
            self.add(self.store.uri(O.GROUPS), "group-objects", OK,
                     f"{len(self.objects)} group objects decode ({len(present)} groups); none the records need is gone")

    def _strays(self) -> None:
        for key in self.strays:
            self.add(self.store.uri(key), "stray-file", WARNING,
                     f"not a group object (those are {O.GROUPS}{{writer}}/{{seq:012d}}.arrow): the run did not "
                     "write it",
                     "the run and its readers never read it: groups it may hold are not trained from it",
                     "--repair moves it under quarantine/doctor/", Repair("quarantine", self.store, key, order=3))

    def _copies(self) -> None:
        """Objects holding groups another object holds too: a copy (a restore, a copy by hand), not a write of the
        run, which commits each group once. The original is the object the consumption records name as consumed,
        else the first in key order."""
        done = self._done()
        holders: dict[str, list[str]] = {}
        for key, got in self.objects.items():
            for g in got if isinstance(got, list) else ():
                holders.setdefault(g.group_id, []).append(key)
        copies: dict[str, dict[str, str]] = {}  # copy -> {group id: the original's key}
        for gid, keys in holders.items():
            if len(keys) > 1:
                original = next((k for k in keys if (p := O.split_group_key(k)) and p[1] in done.get(p[0], ())),
                                keys[0])
                for key in keys:
                    if key != original:
                        copies.setdefault(key, {})[gid] = original
        for key, groups in sorted(copies.items()):
            whole = len(groups) == len(self.objects[key])
            first = sorted(groups)[0]
            self.add(self.store.uri(key), "duplicate-groups", WARNING,
                     f"{'all ' if whole else ''}{_plural(len(groups), 'group')} of it are in "
                     f"{self.store.uri(groups[first])} too (first: {', '.join(sorted(groups)[:3])})",
                     "a copy: a resume serves none of its groups whose prompt was trained already (nor any group "
                     "twice); lineage shows the first object in key order",
                     "--repair moves it to buffer/quarantine/" if whole else "move it away if it is a copy",
                     Repair("quarantine_object", self.store, key, "a copy: its groups are in another object",
                            order=2) if whole else None)

    def _fork_record(self) -> dict:
        try:
            fork = get_json_or_none(self.store, FORK_KEY)
        except StorageUnavailable:
            raise
        except StorageError:
            return {}
        return fork if isinstance(fork, dict) else {}

    def _done(self) -> dict[str, set[int]]:
        """writer -> seqs of its objects consumed entirely (the compaction record and the manifests say so)."""
        done = {w: set(seqs) for w, seqs in self.record.compacted_done.items()}
        for m in self.record.manifests.values():
            for key in m.get("objects_done", ()):
                parsed = O.split_group_key(key)
                if parsed is not None:
                    done.setdefault(parsed[0], set()).add(parsed[1])
        return done

    def _gaps(self, done: dict[str, set[int]], quarantined: set[tuple[str, int]], forked_at: float) -> None:
        """Objects missing between a writer's first (seq 0) and its newest that no record says were consumed (in a
        fork, the source's writers, which started before it, are skipped: it copied only their unconsumed objects)."""
        present: dict[str, set[int]] = {}
        for key in self.objects:
            writer, seq = O.split_group_key(key)
            present.setdefault(writer, set()).add(seq)
        for writer, seqs in sorted(present.items()):
            started = writer[1:14]
            if forked_at and started.isdigit() and int(started) < forked_at * 1000:
                continue
            known = seqs | done.get(writer, set()) | {s for w, s in quarantined if w == writer}
            for seq in sorted(set(range(max(seqs))) - known):
                self.add(self.store.uri(O.group_key(writer, seq)), "lost-object", WARNING,
                         "missing: writer's later objects are stored and no record says this one was consumed",
                         "if it was committed (a write that failed leaves the same gap), the groups it held are lost: "
                         "never trained", "restore it from a backup")

    # ------------------------------------------------------------------ temporaries

    def _temporaries(self) -> None:
        stores = [self.store]
        mgr = getattr(self, "ckpt", None)
        if mgr is not None and not self._in_run_root(mgr.store)[1]:
            stores.append(mgr.store)
        for store in stores:
            for key, info in store.list_temporaries("").items():
                if key.startswith(QUARANTINE + "/"):
                    continue  # moved aside by an earlier repair
                modified = info["modified"]
                if self.lease_holder and (modified is None or self.now - modified < IN_FLIGHT_SECONDS):
                    continue  # a write of the live segment, in flight
                age = f", {_age(self.now - modified)} old" if modified is not None else ""
                self.add(store.uri(key), "temporary", WARNING,
                         f"a temporary of a write that never finished ({info['size']} bytes{age})",
                         "left by a crash between writing and committing: never read, it only takes space",
                         "--repair moves it under quarantine/doctor/", Repair("quarantine", store, key, order=0))

    def _in_run_root(self, store: Store) -> tuple[Store, str]:
        """(the run root's Store, `store`'s prefix in it) when `store` lies under the run root, else (store, "")."""
        root = self.store.root_uri.rstrip("/") + "/"
        if store.root_uri.startswith(root):
            return self.store, store.root_uri[len(root):].strip("/") + "/"
        return store, ""


# ----------------------------------------------------------------------------- repairs


def _apply(r: Repair, stamp: str, what: str) -> dict:
    aside = f"{QUARANTINE}/{stamp}/"
    if r.action == "quarantine":
        r.store.move(r.key, aside + r.key)
        return {"action": "moved", "to": r.store.uri(aside + r.key)}
    if r.action == "quarantine_dir":
        keys = [*r.store.list(r.key + "/"), *r.store.list_temporaries(r.key + "/")]
        for key in keys:
            r.store.move(key, aside + key)
        if not r.store.list(r.key + "/") and not r.store.list_temporaries(r.key + "/"):
            r.store.delete_prefix(r.key)  # nothing is left in it: the empty directories of file://
        return {"action": "moved", "to": r.store.uri(aside + r.key), "files": len(keys)}
    if r.action == "quarantine_object":
        dst = O.quarantine_key(r.key)
        r.store.put_json(dst + O.REASON_SUFFIX, O.quarantine_reason(r.key, SchemaError(str(r.detail))))
        r.store.move(r.key, dst)
        return {"action": "moved", "to": r.store.uri(dst)}
    if r.action == "rebuild_manifest":
        r.store.move(r.key, aside + r.key)
        d = r.detail
        r.store.put_json(r.key, {"step": d["step"], "consumed": [], "rejected": [], "objects_done": [],
                                 REBUILT_IDS: d["ids"], "rebuilt_from": d["from"], "rebuilt_at": time.time(),
                                 "rebuilt_because": what[:500]})
        return {"action": "rebuilt", "from": r.store.uri(d["from"]), "groups": len(d["ids"]),
                "original": r.store.uri(aside + r.key)}
    if r.action == "rebuild_status":
        if r.store.exists(r.key):
            r.store.move(r.key, aside + r.key)
        fields = rebuilt_status(r.store, f"{r.detail}; written by `miles doctor --repair`")
        write_status(r.store, fields["state"], last_step=fields["last_step"], segment=fields["segment"],
                     message=fields["message"])
        return {"action": "rebuilt", "state": fields["state"], "last_step": fields["last_step"],
                "segment": fields["segment"]}
    raise ValueError(f"unknown repair {r.action!r}")


# ----------------------------------------------------------------------------- text


_LABEL = {ERROR: "ERROR", WARNING: "WARNING", OK: "ok"}


def render_report(report: Report) -> str:
    lines = []
    if report.repairs is not None:
        lines.append(f"repairs in {report.run_uri}:" if report.repairs else
                     f"nothing to repair in {report.run_uri}")
        for r in report.repairs:
            lines.append(f"  {r['action']:<8} {r['key']}" + "".join(
                f"\n           {k}: {v}" for k, v in r.items() if k not in ("action", "key", "kind")))
        lines.append("after repair:" if report.repairs else "")
    lines.append(f"doctor {report.run_uri}")
    for f in _ordered(report.findings):
        lines.append(f"{_LABEL[f.severity]:<8} {f.kind:<20} {f.key}")
        lines.append(f"         {f.what}")
        if f.severity != OK or f.meaning:
            lines += [f"         means: {f.meaning}"] if f.meaning else []
        if f.severity != OK and f.fix:
            lines.append(f"         fix: {f.fix}")
    errors, warnings = report.count(ERROR), report.count(WARNING)
    repairable = sum(1 for f in report.findings if f.repair)
    verdict = ("the run can continue as it is" if report.can_continue else
               "the run cannot continue as it is")
    hint = (f"; `miles doctor --repair` repairs {repairable} of them" if repairable and report.repairs is None else "")
    lines.append(f"{_plural(errors, 'error')}, {_plural(warnings, 'warning')}: {verdict}{hint}")
    return "\n".join(line for line in lines if line is not None)


def _legacy(mgr: CheckpointManager, step: int) -> bool:
    try:
        return mgr.listed_files(step) is None
    except CheckpointError:
        return False


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ordered(findings: list[Finding]) -> list[Finding]:
    rank = {ERROR: 0, WARNING: 1, OK: 2}
    return sorted(findings, key=lambda f: rank[f.severity])


def _steps(steps: list[int]) -> str:
    runs = O.to_ranges(set(steps))
    text = ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in runs[:8])
    return text + (f", ... ({len(steps)})" if len(runs) > 8 else "")


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The readers' own warnings (a manifest skipped, STATUS rebuilt) are findings here: not printed twice."""
    logger = logging.getLogger("miles_core")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)
