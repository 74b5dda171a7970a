"""The default data buffer (docs/data-path.md): a bounded FIFO of prompt groups, durable in object storage.

What it owns:
- admission at put: aborted groups go to the unused-samples handler, the dynamic filter drops by
  reason, everything else is committed to `buffer/groups/` before put returns;
- backpressure: at most `capacity_groups` groups held (committing or waiting for get); put blocks,
  nothing is ever evicted;
- staleness at get against `max_weight_staleness` (stale groups go to the handler);
- the consumption record: `record_consumed(step, ids)` writes `buffer/consumed/{step}.json`
  (with the ids rejected at get since the last record), so a reopened buffer serves every
  committed-but-unconsumed group and never a consumed one.
- compaction (`compact(step)`, after each complete checkpoint): one `upto_{step}.json` record of
  what every manifest through that step says, so a reopen reads that record, the manifests after
  it and the objects that still hold unconsumed groups: its cost follows the backlog, not the
  run's history (listings aside). The per-step manifests stay (they are the lineage); with
  `--buffer-delete-consumed-objects` the objects consumed entirely through the checkpoint are
  deleted too, so listings shrink as well.
What it leaves to others: when to record (the trainer/checkpointer, with each step), the data
source's cursor, and which resume step to reopen at (`consumed_through_step`, always explicit).
Reopen lists each prefix once and reads manifests and objects in parallel.

Writes are coalesced (group commit): one writer thread takes every put waiting when it is free,
optionally waiting `coalesce_seconds` after the oldest for more, and commits them as one object
(one PUT/fsync); each waiting put returns when that object is committed. With the default 0, puts
that arrive while an object is being written share the next one, so objects grow with the load
and an idle buffer adds no latency. Groups put in this process are held as the
producer's Group objects (get returns them as they are); groups found on reopen are held as
compact Arrow rows and decoded at get.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

import miles_core.buffer.objects as O
from miles_core.buffer.contract import (
    FILTER_FLAG,
    BufferClosed,
    BufferTimeout,
    DataBufferError,
    UnusedSamplesHandler,
)
from miles_core.buffer.manifests import REBUILT_IDS
from miles_core.buffer.window import Window
from miles_core.failures import chaos
from miles_core.metrics import names as N
from miles_core.samples import Group, groups_to_batch
from miles_core.storage import ObjectNotFound, StorageError, Store, validate_name

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 64 << 20  # close a coalescing window early once this much is waiting
READ_THREADS = 16  # parallel reads on reopen (object-store latency, not CPU, bounds a reopen)


@dataclass(slots=True)
class _Entry:
    """One buffered group: what the index needs, and the payload get returns."""

    group_id: str
    key: str  # the object holding it
    oldest_version: int | None
    position: tuple[int, int] | None
    payload: Any  # Group (put here) or pa.RecordBatch (found on reopen)


class _PendingPut:
    __slots__ = ("batch", "entry", "done", "error", "slot_at")

    def __init__(self, batch: pa.RecordBatch, entry: _Entry, slot_at: float):
        self.batch, self.entry, self.slot_at = batch, entry, slot_at
        self.done = threading.Event()
        self.error: BaseException | None = None


class DurableBuffer:
    """Use `DurableBuffer.open(store, ...)` (or `build_buffer(cfg, handler, consumed_through_step=k)`); close it, or use `with`."""

    def __init__(self, store: Store, *, capacity_groups: int, unused_handler: UnusedSamplesHandler,
                 max_weight_staleness: int | None = None,
                 dynamic_filter: Callable[[Group], tuple[bool, str]] | None = None,
                 coalesce_seconds: float = 0.0, writer_id: str | None = None,
                 foreign_poll_seconds: float | None = None, index_commits: bool = True):
        if capacity_groups < 1:
            raise ValueError(f"buffer capacity must be >= 1 group, got {capacity_groups}")
        self.store = store
        self.capacity = capacity_groups
        self.max_weight_staleness = max_weight_staleness
        self.handler = unused_handler
        self.dynamic_filter = dynamic_filter
        self.coalesce_seconds = max(0.0, coalesce_seconds)
        self.writer_id = validate_name(writer_id or O.new_writer_id(), "buffer writer id")
        self._seq = 0
        self.index_commits = index_commits  # False: a producer's writer, which commits and never serves

        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._has_pending = threading.Condition(self._lock)
        self._available: collections.deque[_Entry] = collections.deque()
        self._reserved = 0  # slots held: committing + available
        self._handed_out = 0  # groups `get` returned since the buffer opened
        self._pending: list[_PendingPut] = []
        self._pending_bytes = 0
        # Not durably consumed yet: group id -> entry (available, or got and awaiting record_consumed).
        self._unrecorded: dict[str, _Entry] = {}
        self._rejected: list[str] = []  # rejected at get since the last record_consumed
        self._remaining: dict[str, set[str]] = {}  # object key -> its groups not yet recorded
        self._members: dict[str, list[str]] = {}  # object key -> all its group ids, until the object is done
        self._done: dict[str, set[int]] = {}  # writer -> seqs of its objects consumed entirely
        self._last_step: int | None = None
        self._last_version: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._window = Window()
        self.quarantined_total = 0
        self.committed_total = 0  # groups committed by this writer
        self._seen: set[str] = set()  # object keys indexed (or found done) by this buffer
        self._foreign_at: dict[str, float] = {}  # other writer -> when its last group was indexed (monotonic)
        self._prompts: dict[tuple[int, int, int], str] = {}  # (epoch, position, attempt) -> the group id holding it
        self._trained = TrainedPrompts()  # the data-source prompts (epoch, position) consumed through the last record
        self._tail = None if foreign_poll_seconds is None else _Tail(self, foreign_poll_seconds)
        self._writer = threading.Thread(target=self._write_loop, name=f"buffer-writer-{self.writer_id}", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ open / resume

    @classmethod
    def open(cls, store: Store, *, consumed_through_step: int, **kw) -> "DurableBuffer":
        """Open the buffer of a run root, rebuilding the index (one listing of each prefix).

        consumed_through_step: the step of the checkpoint a resume restarts from, -1 without one.
        Consumption manifests of later steps are deleted (the restored model never trained on those
        groups, so they become available again). Required: keeping the manifests of steps whose
        training was lost would silently drop their groups.
        """
        if isinstance(consumed_through_step, bool) or not isinstance(consumed_through_step, int) \
                or consumed_through_step < -1:
            raise ValueError(f"consumed_through_step={consumed_through_step!r}: expected the resume checkpoint's "
                             "step, or -1 for a run without a checkpoint")
        buf = cls(store, **kw)
        try:
            buf._load(consumed_through_step)
        except BaseException:
            buf.close()
            raise
        if buf._tail is not None:
            buf._tail.start()  # after the reopen's own listing: an object is indexed once
        return buf

    def _load(self, through: int) -> None:
        consumed = self._load_consumption(through)
        self._consumed_prompts(consumed)
        listed = _group_objects(self.store.list(O.GROUPS))
        with self._lock:
            self._index_keys([k for k in listed if not self._is_done(k)], consumed)
            self._seen.update(listed)
            self._reserved = len(self._available)

    def _consumed_prompts(self, consumed: set[str]) -> None:
        """The prompts (epoch, position, attempt) of consumed or rejected groups, read from their ids,
        so another writer's duplicate of one is refused."""
        for gid in consumed:
            prompt = O.prompt_of_id(gid)
            if prompt is not None:
                self._prompts.setdefault(prompt, gid)

    def _index_keys(self, keys: list[str], consumed: set[str]) -> int:
        """Fetch and index these objects (in parallel); returns the groups made available (counted as they
        are added: gets run while the reads are unlocked, so the queue's length says nothing of them)."""
        self._lock.release()  # reads run unlocked; indexing below holds the lock again
        try:
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="buffer-reopen") as pool:
                fetched = list(zip(keys, pool.map(self._fetch, keys)))
        finally:
            self._lock.acquire()
        added = 0
        for key, stored in fetched:
            if isinstance(stored, BaseException):
                self._quarantine(key, stored)
            elif stored is not None:
                added += self._index_object(key, stored, consumed)
        return added

    def _load_consumption(self, through: int) -> set[str]:
        """Group ids consumed or rejected through `through` (in objects not entirely done); fills `_done`."""
        base_step, consumed = self._load_compaction(self.store.list(O.COMPACTED), through)
        keys = self.store.list(O.CONSUMED)
        later = []
        for key in keys:
            step = O.consumed_step(key)
            if step is None or step <= base_step:
                continue
            if step > through:
                self.store.delete(key)
                log.info("buffer: discarded %s (after resume step %d)", key, through)
            else:
                later.append((step, key))
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="buffer-reopen") as pool:
            manifests = list(pool.map(self._read_manifest, [k for _, k in later]))
        for (step, _), manifest in zip(later, manifests):
            consumed.update(manifest.get("consumed", ()))
            self._trained.add_ids(manifest.get("consumed", ()))
            consumed.update(manifest.get("rejected", ()))
            consumed.update(manifest.get(REBUILT_IDS, ()))  # rebuilt by `miles doctor`: taken, which way unknown
            for key in manifest.get("objects_done", ()):
                self._note_done(key)
            self._last_step = step if self._last_step is None else max(self._last_step, step)
        return consumed

    def _load_compaction(self, keys: list[str], through: int) -> tuple[int, set[str]]:
        """The newest compaction record (its step, its consumed ids); (-1, set()) without one."""
        compacted = sorted((step, k) for k in keys if (step := O.compact_step(k)) is not None)
        for step, key in [c for c in compacted if c[0] > through]:
            self._discard_compaction(step, key, through)
        compacted = [c for c in compacted if c[0] <= through]
        if not compacted:
            return -1, set()  # every manifest through `through` is read instead
        step, key = compacted[-1]
        record = self._read_compaction(key)
        for writer, runs in record.get("objects_done", {}).items():
            self._done.setdefault(writer, set()).update(O.from_ranges(runs))
        self._trained = TrainedPrompts(record.get("trained_positions"))
        self._last_step = step
        return step, set(record.get("consumed", ()))

    def _discard_compaction(self, step: int, key: str, through: int) -> None:
        """A compaction record after the resume step (the resume fell back past a damaged checkpoint): the
        groups it folds were trained by a model that is gone, so they are served again, from the objects."""
        if self._read_manifest(key).get("deleted_consumed_objects"):
            raise DataBufferError(
                f"the resume starts after step {through}, but {self.store.uri(key)} says the objects consumed through "
                f"step {step} were deleted (--buffer-delete-consumed-objects): the groups consumed after step "
                f"{through} are gone and cannot be trained again. Resume from the checkpoint of step {step} or "
                "later, or delete that record to accept losing those groups.")
        self.store.delete(key)
        log.info("buffer: discarded %s (after resume step %d)", key, through)

    def _fetch(self, key: str) -> "list[O.StoredGroup] | BaseException | None":
        """An object's groups; None when it vanished; the decode error when it is undecodable."""
        return O.fetch_object(self.store, key)

    def _index_object(self, key: str, stored: "list[O.StoredGroup]", consumed: set[str]) -> int:
        """Make the object's groups that are neither consumed nor held already available; returns how many."""
        fresh = [sg for sg in stored if sg.group_id not in consumed and sg.group_id not in self._unrecorded]
        fresh = [sg for sg in fresh if not self._duplicate(sg) and not self._trained_already(sg)]
        if not fresh:  # consumed entirely, but no manifest said so: remember it as done
            self._note_done(key)
            return 0
        self._members[key] = [sg.group_id for sg in stored]
        for sg in fresh:
            entry = _Entry(sg.group_id, key, sg.oldest_version, sg.position, sg.rows)
            self._available.append(entry)
            self._unrecorded[sg.group_id] = entry
            self._remaining.setdefault(key, set()).add(sg.group_id)
            self._note_prompt(sg.group_id)
        return len(fresh)

    def _note_prompt(self, group_id: str) -> None:
        prompt = O.prompt_of_id(group_id)
        if prompt is not None:
            self._prompts.setdefault(prompt, group_id)

    def _duplicate(self, sg: "O.StoredGroup") -> bool:
        """Another writer's group for the same prompt attempt as a group already committed (a claim
        block taken over while its first holder was still committing): refused, recorded as rejected,
        counted. A retry of a rejected group has the next attempt number and is no duplicate."""
        prompt = O.prompt_of_id(sg.group_id)
        holder = self._prompts.get(prompt) if prompt is not None else None
        if holder is None or holder == sg.group_id:
            return False
        log.warning("buffer: group %s repeats prompt %s of group %s; refused as a duplicate",
                    sg.group_id, prompt, holder)
        self._rejected.append(sg.group_id)
        self._window.duplicates += 1
        return True

    def _trained_already(self, sg: "O.StoredGroup") -> bool:
        """A group of a prompt that was trained already: a copy of a consumed group (its object copied or
        restored under another key; a reopen reads no object consumed entirely, so its id is not known as
        consumed). Skipped, never served nor recorded: the prompt was trained once."""
        prompt = O.prompt_of_id(sg.group_id)
        if prompt is None or not self._trained.has(prompt[0], prompt[1]):
            return False
        log.warning("buffer: group %s is of prompt (epoch %d, position %d), trained already; skipped (a copy of a "
                    "consumed group?)", sg.group_id, prompt[0], prompt[1])
        return True

    def _note_done(self, key: str) -> None:
        parsed = O.split_group_key(key)
        if parsed is not None:
            self._done.setdefault(parsed[0], set()).add(parsed[1])

    def _is_done(self, key: str) -> bool:
        parsed = O.split_group_key(key)
        return parsed is not None and parsed[1] in self._done.get(parsed[0], ())

    def _read_manifest(self, key: str) -> dict:
        try:
            manifest = self.store.get_json(key)
        except ObjectNotFound:
            return {}
        except StorageError as e:
            raise DataBufferError(
                f"consumption manifest {self.store.uri(key)} is unreadable ({e}); without it the run cannot tell "
                "which groups were trained. Restore it from a backup, or delete it and every later one and "
                "resume from the checkpoint before that step.") from e
        if not isinstance(manifest, dict) or not isinstance(manifest.get("consumed", []), list):
            raise DataBufferError(f"consumption manifest {self.store.uri(key)} is not a miles manifest "
                                  "(expected an object with a 'consumed' list); without it the run cannot tell which "
                                  "groups were trained. Restore it from a backup, or delete it and every later one "
                                  "and resume from the checkpoint before that step.")
        return manifest

    def _read_compaction(self, key: str) -> dict:
        try:
            return self._read_manifest(key)
        except DataBufferError as e:
            why = getattr(e.__cause__, "__cause__", None) or "not a compaction record"
            raise DataBufferError(
                f"compaction record {self.store.uri(key)} does not parse ({str(why)[:200]}): the resume cannot tell "
                f"which groups were trained through its step. `miles doctor {self.store.root_uri} --repair` moves it "
                "aside when every consumption manifest through that step is readable (a resume then reads them "
                "instead); otherwise restore it from a backup.") from e

    def _quarantine(self, key: str, error: BaseException) -> None:
        dst = O.quarantine_key(key)
        log.warning("buffer: quarantining undecodable %s -> %s: %s", key, dst, error)
        self.store.put_json(dst + O.REASON_SUFFIX, O.quarantine_reason(key, error))
        self.store.move(key, dst)
        self._window.quarantined += 1
        self.quarantined_total += 1

    # ------------------------------------------------------------------ put

    def put(self, group: Group) -> None:
        """Store the group (returns once committed), reject it, or block while the buffer is full."""
        self._check_open()
        if group.aborted:
            self.handler.handle(group, "aborted")
            with self._lock:
                self._window.aborted += 1
            return
        if self.dynamic_filter is not None:
            keep, reason = self._filter(group)
            if not keep:
                with self._lock:
                    self._window.drops[N.dynamic_filter_drop_metric(reason)] += 1
                return
        batch = groups_to_batch([group])
        entry = _Entry(group.group_id, "", group.oldest_version, O.position_of(group), group)
        with self._lock:
            t0 = time.monotonic()
            while self._reserved >= self.capacity and not self._closed:
                self._not_full.wait()
            blocked = time.monotonic() - t0
            self._window.blocked_seconds += blocked
            if self._closed:
                raise BufferClosed("buffer closed while put waited for a free slot")
            self._reserved += 1
            p = _PendingPut(batch, entry, time.monotonic())
            self._pending.append(p)
            self._pending_bytes += batch.nbytes
            self._has_pending.notify()
        p.done.wait()
        if p.error is not None:
            raise p.error

    def _index_commit(self, key: str, batch: list[_PendingPut]) -> None:
        for p in batch:
            p.entry.key = key
            self._available.append(p.entry)
            self._unrecorded[p.entry.group_id] = p.entry
            self._note_prompt(p.entry.group_id)
        self._remaining[key] = {p.entry.group_id for p in batch}
        self._members[key] = [p.entry.group_id for p in batch]
        self._not_empty.notify_all()

    def _filter(self, group: Group) -> tuple[bool, str]:
        try:
            keep, reason = self.dynamic_filter(group)
        except Exception as e:
            raise DataBufferError(f"{FILTER_FLAG} function raised on group {group.group_id!r}: {e!r}") from e
        return bool(keep), str(reason)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._has_pending.wait()
                if not self._pending and self._closed:
                    return
                # Coalescing window: until coalesce_seconds after the oldest waiting put, cut short
                # when no further put can get a slot (the buffer is full) or the object is big.
                # Puts arriving while the previous object was being written are already waiting.
                deadline = self._pending[0].slot_at + self.coalesce_seconds
                while (not self._closed and (left := deadline - time.monotonic()) > 0
                       and self._reserved < self.capacity and self._pending_bytes < MAX_OBJECT_BYTES):
                    self._has_pending.wait(left)
                self._pending_bytes = 0
                batch, self._pending = self._pending, []
                key = O.group_key(self.writer_id, self._seq)
                self._seq += 1
            self._commit(key, batch)

    def _commit(self, key: str, batch: list[_PendingPut]) -> None:
        try:
            data = O.encode_object([p.batch for p in batch])
            chaos.point("buffer.commit")
            self.store.put_bytes(key, data)
        except BaseException as e:  # noqa: BLE001 - handed to every waiting put
            with self._lock:
                self._reserved -= len(batch)
                self._not_full.notify_all()
            for p in batch:
                p.error = e
                p.done.set()
            return
        now = time.monotonic()
        with self._lock:
            self._window.bytes_written += len(data)
            self._window.put_seconds.extend(now - p.slot_at for p in batch)
            self.committed_total += len(batch)
            self._seen.add(key)
            if self.index_commits:
                self._index_commit(key, batch)
            else:  # a producer's writer: committed is done; the slot frees at once
                self._reserved -= len(batch)
                self._not_full.notify_all()
        for p in batch:
            p.batch = None
            p.done.set()

    # ------------------------------------------------------------------ get

    def get(self, **context: Any) -> Group:
        """The oldest fresh group (FIFO); waits while empty. Stale groups go to the unused handler.

        Context: current_version (int | None) for staleness; timeout_seconds (float) to raise
        BufferTimeout instead of waiting forever. Other keys are ignored.
        """
        version = context.get("current_version")
        timeout = context.get("timeout_seconds")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if version is not None:
                    self._last_version = version
                entry = self._pop(deadline)
                staleness = self._staleness(entry, version)
                if staleness is not None:
                    self._window.staleness.append(staleness)
                stale = (self.max_weight_staleness is not None and staleness is not None
                         and staleness > self.max_weight_staleness)
                self._handed_out += not stale
            group = entry.payload if isinstance(entry.payload, Group) else O.rows_to_group(entry.payload)
            if not stale:
                return group
            self.handler.handle(group, "stale")
            with self._lock:
                self._window.stale += 1
                self._rejected.append(entry.group_id)

    def _pop(self, deadline: float | None) -> _Entry:
        while True:
            if self._error is not None:
                raise self._error
            if self._available:
                entry = self._available.popleft()
                self._reserved -= 1
                self._not_full.notify_all()  # each get frees a slot: wake blocked producers
                return entry
            if self._closed:
                raise BufferClosed("buffer closed and empty")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise BufferTimeout("no group became available in time (the producer may be starved or stopped)")
            self._not_empty.wait(left)

    @staticmethod
    def _staleness(entry: _Entry, version: int | None) -> int | None:
        if version is None or entry.oldest_version is None:
            return None
        return max(0, version - entry.oldest_version)

    def fail(self, error: BaseException) -> None:
        """The producer failed: the next get raises `error` before returning any queued group (docs/fully-async.md)."""
        with self._lock:
            self._error = error
            self._not_empty.notify_all()

    # ------------------------------------------------------------------ consumption

    def record_consumed(self, step: int, group_ids: list[str]) -> None:
        """Durably mark `group_ids` consumed by training step `step` (with the ids rejected at get since
        the last record). Called by the trainer/checkpointer once per step, steps increasing."""
        with self._lock:
            if self._last_step is not None and step <= self._last_step:
                raise ValueError(f"record_consumed(step={step}): step {self._last_step} is already recorded; "
                                 "record each step once, in increasing order")
            rejected = list(self._rejected)
            done = set()
            for gid in [*group_ids, *rejected]:
                entry = self._unrecorded.get(gid)
                if entry is None:
                    continue
                left = self._remaining.get(entry.key)
                if left is not None:
                    left.discard(gid)
                    if not left:
                        done.add(entry.key)
            writers = collections.Counter(O.writer_of(e.key) for gid in group_ids
                                          if (e := self._unrecorded.get(gid)) is not None)
        manifest = {"step": step, "consumed": list(group_ids), "rejected": rejected,
                    "objects_done": sorted(done), "writers": dict(sorted(writers.items())), "written_at": time.time()}
        chaos.point("buffer.record")
        self.store.put_json(O.consumed_key(step), manifest)
        with self._lock:
            self._last_step = step
            self._trained.add_ids(group_ids)
            del self._rejected[: len(rejected)]
            for gid in [*group_ids, *rejected]:
                self._unrecorded.pop(gid, None)
            for key in done:
                self._remaining.pop(key, None)
                self._members.pop(key, None)
                self._note_done(key)

    def compact(self, through_step: int, *, delete_consumed_objects: bool = False) -> None:
        """Fold the consumption record through `through_step` into `upto_{step}.json`; call it once the
        checkpoint of that step is complete (a resume that falls back past a damaged checkpoint discards this
        record, unless `delete_consumed_objects` made it final). Earlier
        compaction records are deleted; with `delete_consumed_objects`, so is every listed object
        consumed entirely (nothing from this checkpoint on needs them)."""
        with self._lock:
            if self._last_step != through_step:
                raise ValueError(f"compact({through_step}): the last recorded step is {self._last_step}; compact "
                                 "right after recording and checkpointing that step")
            record = {"through_step": through_step, "written_at": time.time(),
                      "deleted_consumed_objects": delete_consumed_objects,
                      "objects_done": {w: O.to_ranges(seqs) for w, seqs in sorted(self._done.items())},
                      "consumed": sorted(gid for key, ids in self._members.items()
                                         for gid in ids if gid not in self._remaining.get(key, ())),
                      "trained_positions": self._trained.ranges()}
        self.store.put_json(O.compact_key(through_step), record)
        for key in self.store.list(O.COMPACTED):
            step = O.compact_step(key)
            if step is not None and step < through_step:
                self.store.delete(key)
        if delete_consumed_objects:
            listed = self.store.list(O.GROUPS)
            with self._lock:
                doomed = [key for key in listed if self._is_done(key)]
            for key in doomed:
                self.store.delete(key)

    def committed_positions(self) -> set[tuple[int, int]]:
        """(epoch, position) of every committed group not durably consumed (available or got but not
        recorded): the prompts a resumed data source must not generate again. Consumed groups are
        behind the checkpointed data-source cursor already."""
        with self._lock:
            return {e.position for e in self._unrecorded.values() if e.position is not None}

    # ------------------------------------------------------------------ metrics and state

    def get_metrics(self) -> dict[str, float]:
        with self._lock:
            window, self._window = self._window, Window()
            buffered = []
            if self._last_version is not None:
                buffered = [s for e in self._available if (s := self._staleness(e, self._last_version)) is not None]
            out = window.emit(len(self._available), buffered)
        handler_metrics = getattr(self.handler, "metrics", None)
        if callable(handler_metrics):
            out.update(handler_metrics())
        return out

    @property
    def queue_size(self) -> int:
        with self._lock:
            return len(self._available)

    def groups_received(self) -> int:
        """Groups available (from any writer) or handed to the drain since the buffer opened: what the
        rollout manager's demand gate counts as made (a group rejected at get or lost left it)."""
        with self._lock:
            return len(self._available) + self._handed_out

    def usable_queue_size(self, version: int | None) -> int:
        """Available groups a get under `version` would not reject as stale."""
        with self._lock:
            if version is None or self.max_weight_staleness is None:
                return len(self._available)
            return sum(1 for e in self._available
                       if (s := self._staleness(e, version)) is None or s <= self.max_weight_staleness)

    def recent_foreign_writers(self, seconds: float = 60.0) -> int:
        """Other writers (producer jobs) whose groups this buffer indexed in the last `seconds`."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for t in self._foreign_at.values() if now - t <= seconds)

    def available_group_ids(self) -> list[str]:
        with self._lock:
            return [e.group_id for e in self._available]

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosed("buffer is closed")

    def close(self) -> None:
        """Commit what is waiting, stop the writer, wake every blocked caller with BufferClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._tail is not None:
                self._tail.stop()
            self._has_pending.notify_all()
            self._not_full.notify_all()
            self._not_empty.notify_all()
        if threading.current_thread() is not self._writer:
            self._writer.join()

    def __enter__(self) -> "DurableBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Tail:
    """Indexes the groups other writers (producer jobs) commit to the run's buffer: every
    `poll_seconds` one listing of `buffer/groups/`, then the objects not seen yet, fetched and
    indexed like a reopen (undecodable ones quarantined, duplicates of a held position refused).
    Those groups take buffer slots too, so this process's own producer is held back while the
    buffer is full of theirs; they are never refused for space (they are committed already)."""

    def __init__(self, buffer: DurableBuffer, poll_seconds: float):
        self.buffer, self.poll_seconds = buffer, max(0.05, poll_seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="buffer-tail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - an outage delays other writers' groups, never the run
                log.warning("buffer: listing other writers' groups failed (tried again in %.1f s): %s",
                            self.poll_seconds, e)

    def poll(self) -> int:
        """One pass; returns the groups it made available."""
        b = self.buffer
        own = f"{O.GROUPS}{b.writer_id}/"
        listed = [k for k in _group_objects(b.store.list(O.GROUPS), warn=False) if not k.startswith(own)]
        with b._lock:
            new = sorted(k for k in listed if k not in b._seen and not b._is_done(k))
            if b._closed or not new:
                return 0
            b._seen.update(new)  # first: a listing of the next poll must not index them again
            try:
                added = b._index_keys(new, set())
            except BaseException:
                b._seen.difference_update(new)  # an outage: read them again at the next poll
                raise
            b._reserved += added
            if added:
                b._not_empty.notify_all()
            now = time.monotonic()
            for key in new:
                b._foreign_at[O.writer_of(key)] = now
        return added


class TrainedPrompts:
    """The data-source prompts (epoch, position) trained so far, as per-epoch closed ranges of positions plus
    those recorded since (consumption is nearly in position order, so the ranges stay few)."""

    def __init__(self, ranges: dict | None = None):
        self._ranges = {int(e): sorted(runs) for e, runs in (ranges or {}).items()}
        self._recent: dict[int, set[int]] = {}

    def add_ids(self, group_ids) -> None:
        for gid in group_ids:
            prompt = O.prompt_of_id(gid)
            if prompt is not None:
                self._recent.setdefault(prompt[0], set()).add(prompt[1])

    def has(self, epoch: int, position: int) -> bool:
        if position in self._recent.get(epoch, ()):
            return True
        runs = self._ranges.get(epoch, [])
        i = bisect.bisect_right(runs, [position, float("inf")]) - 1
        return i >= 0 and runs[i][0] <= position <= runs[i][1]

    def ranges(self) -> dict[str, list[list[int]]]:
        """Every trained position as {epoch: [[first, last], ...]} (the compaction record's field)."""
        for epoch, positions in self._recent.items():
            merged: list[list[int]] = []
            for lo, hi in sorted([*self._ranges.get(epoch, []), *([p, p] for p in positions)]):
                if merged and lo <= merged[-1][1] + 1:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            self._ranges[epoch] = merged
        self._recent = {}
        return {str(e): runs for e, runs in sorted(self._ranges.items())}


def _group_objects(keys: list[str], warn: bool = True) -> list[str]:
    """The group objects ({writer}/{seq:012d}.arrow) among keys listed under buffer/groups/. Anything else there
    (a copy left by hand, a file of another tool) is never read: a copy of a consumed object would serve its
    groups again, since a reopen does not read the objects consumed entirely."""
    objects = [k for k in keys if O.split_group_key(k) is not None]
    if warn and len(objects) < len(keys):
        stray = sorted(set(keys) - set(objects))
        log.warning("buffer: %d file(s) under %s are not group objects and are never read (first: %s); "
                    "`miles doctor` lists them", len(stray), O.GROUPS, stray[0])
    return objects
