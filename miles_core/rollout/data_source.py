"""The data source: which prompt group the producer generates next, with a durable cursor.

It owns the order in which the normalized prompt rows of a run (`miles_core.rollout.prompts.load_prompts`:
dicts {prompt: token ids, label: str, task: str, metadata: JSON str}) are served, and nothing
else: generation, rewards and storage belong to the producer and the buffer.

Order: epoch by epoch; within an epoch the rows are served in a permutation seeded by
(seed, epoch) when shuffling, else in dataset order. A *position* is `(epoch, index into that
epoch's order)`; the sample's `prompt_index` is the dataset row. Each served group gets a fresh
group id `e{epoch}-p{position}-a{attempt}` and every sample's metadata JSON carries
`{"epoch", "position", "attempt"}` (plus the row's task and metadata).

Exactly once across crashes and segments (docs/deployment.md). `state()` is JSON-able and saved
with each checkpoint. It holds the cursor, the recycle queue and the *outstanding* positions:
groups served but not yet reported settled (`settled(group)`: committed, or rejected at put by
the buffer). `restore(state, committed)` rebuilds the source from it: `committed` lists the
positions whose groups are durably in the buffer (available or consumed) as
`(epoch, position, attempt)` (or `(epoch, position)`, meaning any attempt). On restore,
outstanding and recycled positions already committed at or after their attempt are dropped,
the rest are served again first; positions at or after the cursor that are committed are
skipped when the cursor reaches them. So no prompt is generated twice or lost.

Recycle queue (`--async-unused-samples-handler retry`): `recycle(group)` puts the prompt of a
rejected group back; recycled prompts are served before new ones, under the next attempt number.

Claim mode (`claims=`, under `--allow-rollout-producers`: several writers generate for one run).
The source serves only the positions of the blocks its holder claimed in the run root
(miles_core.rollout.claims, miles_core.rollout.block_cursor): epoch by epoch in the same seeded
order, skipping what a block's earlier writers committed (`committed_by(writer)`), finishing a block
once every position served from it settled. Group ids become `e{epoch}-p{position}-a{attempt}-{holder}`
(unique across writers) and the metadata also carries `"writer": holder`. `restore` adopts the
holder's own unfinished blocks (`claims.adopt_own`) and serves their unsettled positions first. A
checkpoint taken in one mode cannot be resumed in the other (DataSourceError).
"""

from __future__ import annotations

import json
import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from miles_core.rollout.block_cursor import BlockCursor, saved_progress
from miles_core.rollout.claims import PromptClaims
from miles_core.samples import Group, Sample

log = logging.getLogger(__name__)

STATE_VERSION = 1
_ANY_ATTEMPT = 1 << 62

Position = tuple[int, int]


class DataSourceError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class ServedPrompt:
    epoch: int
    position: int
    attempt: int


def position_of(group_or_sample: Group | Sample) -> tuple[int, int, int] | None:
    """(epoch, position, attempt) of a served group from its first sample's metadata; None when the
    metadata does not carry one (a group that did not come from a DataSource)."""
    sample = group_or_sample.samples[0] if isinstance(group_or_sample, Group) else group_or_sample
    try:
        meta = json.loads(sample.metadata or "{}")
        return int(meta["epoch"]), int(meta["position"]), int(meta.get("attempt", 0))
    except (KeyError, TypeError, ValueError):
        return None


class DataSource:
    """Serves prompt groups of `n_samples_per_prompt` copies in a durable, seeded order.

    Not thread-safe; the producer calls it from one asyncio loop.
    """

    def __init__(self, rows: list[dict], n_samples_per_prompt: int, *, seed: int = 1, shuffle: bool = True,
                 claims: PromptClaims | None = None,
                 committed_by: Callable[[str], set[tuple[int, int]]] | None = None):
        if not rows:
            raise DataSourceError("the prompt dataset has no rows; nothing to generate from")
        if n_samples_per_prompt < 1:
            raise DataSourceError(f"n_samples_per_prompt={n_samples_per_prompt} must be >= 1")
        self.rows = rows
        self.n = n_samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []
        self._recycled: deque[ServedPrompt] = deque()  # served first, in order
        self._outstanding: dict[Position, int] = {}  # served, not settled -> attempt
        self._next_attempt: dict[Position, int] = {}  # positions served more than once
        self._skip: dict[Position, int] = {}  # committed at/after the cursor -> highest attempt
        self.claims = claims
        self._cursor = _claim_cursor(claims, committed_by, len(rows))

    # ------------------------------------------------------------------ serving
    def next_group(self) -> Group:
        """The next prompt group: a recycled prompt first, else the next cursor position."""
        served = self._next_recycled() or self._advance()
        self._outstanding[(served.epoch, served.position)] = served.attempt
        return self._make_group(served)

    def _next_recycled(self) -> ServedPrompt | None:
        while self._recycled:
            served = self._recycled.popleft()
            key = (served.epoch, served.position)
            if self._cursor is None or not self._cursor.gave_away(key):
                return served
            log.info("prompt claims: not retrying %s: its block went to another writer, which generates it", key)
        return None

    def _advance(self) -> ServedPrompt:
        if self._cursor is not None:
            return self._advance_claimed()
        while True:
            if self.position >= len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
            pos = (self.epoch, self.position)
            self.position += 1
            if pos in self._skip:  # committed by an earlier segment after its last checkpoint
                del self._skip[pos]
                continue
            return ServedPrompt(pos[0], pos[1], 0)

    def _advance_claimed(self) -> ServedPrompt:
        pos = self._cursor.next_position(lambda p: self._skip.pop(p, None) is not None)
        self.epoch, self.position = pos[0], pos[1] + 1
        return ServedPrompt(pos[0], pos[1], max(self._next_attempt.get(pos, 0), self._outstanding.get(pos, -1) + 1))

    def order(self, epoch: int) -> list[int]:
        """Dataset row indices in the order epoch `epoch` serves them."""
        if epoch != self._order_epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"miles-data-{self.seed}-{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def _make_group(self, served: ServedPrompt) -> Group:
        row_index = self.order(served.epoch)[served.position]
        row = self.rows[row_index]
        gid = f"e{served.epoch}-p{served.position}-a{served.attempt}"
        meta = _row_metadata(row)
        meta.update(epoch=served.epoch, position=served.position, attempt=served.attempt)
        if self.claims is not None:
            gid, meta["writer"] = f"{gid}-{self.claims.holder}", self.claims.holder
        if row.get("task"):
            meta["task"] = row["task"]
        meta_json = json.dumps(meta, sort_keys=True)
        label = row.get("label", "")
        label = label if isinstance(label, str) else json.dumps(label)
        prompt = [int(t) for t in row["prompt"]]
        samples = [Sample(group_id=gid, prompt_index=row_index, sample_index=i, prompt_ids=list(prompt),
                          label=label, metadata=meta_json) for i in range(self.n)]
        return Group(gid, row_index, samples)

    # ------------------------------------------------------------------ feedback
    def settled(self, group: Group) -> None:
        """The group's fate no longer depends on this source: committed to the buffer, or rejected
        at put (then dropped, or back here through `recycle`)."""
        pos = position_of(group)
        if pos is not None and self._outstanding.get(pos[:2]) == pos[2]:
            del self._outstanding[pos[:2]]
            if self._cursor is not None:
                self._cursor.settled(pos[:2])

    def recycle(self, group: Group) -> None:
        """Serve this group's prompt again (the retry handler), under the next attempt number."""
        pos = position_of(group)
        if pos is None:
            raise DataSourceError(f"group {group.group_id!r} carries no epoch/position metadata; "
                                  "only groups served by this data source can be recycled")
        key = pos[:2]
        attempt = max(pos[2], self._next_attempt.get(key, 0) - 1) + 1
        self._next_attempt[key] = attempt + 1
        if self._outstanding.get(key) == pos[2]:
            del self._outstanding[key]
        self._recycled.append(ServedPrompt(key[0], key[1], attempt))

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    @property
    def recycled(self) -> int:
        return len(self._recycled)

    # ------------------------------------------------------------------ durable state
    def state(self) -> dict:
        """JSON-able cursor state for the checkpoint (see the module docstring)."""
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "outstanding": sorted([e, p, a] for (e, p), a in self._outstanding.items()),
            "recycled": [[s.epoch, s.position, s.attempt] for s in self._recycled],
            "skip": sorted([e, p, a] for (e, p), a in self._skip.items()),
        }
        if self._cursor is not None:
            state["claims"] = self._cursor.state()
        return state

    def restore(self, state: dict, committed: Iterable[tuple[int, ...]] = ()) -> "RestoreReport":
        """Continue from a checkpointed `state()`, skipping what the buffer already committed.

        Returns what happened to the checkpoint's started-but-unsettled groups, which the
        producer needs to restore its started-groups count.
        """
        if state.get("version") != STATE_VERSION:
            raise DataSourceError(f"data-source state version {state.get('version')!r} is not {STATE_VERSION}; "
                                  "this checkpoint was written by an incompatible miles-flyte")
        if state["num_rows"] != len(self.rows):
            raise DataSourceError(
                f"the checkpoint's data-source cursor was saved over {state['num_rows']} prompt rows, but the "
                f"dataset now has {len(self.rows)}; resume with the same --prompt-data (or start a new run id)")
        _check_mode(state, self._cursor is not None)
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        best: dict[Position, int] = {}
        for c in committed:
            key, attempt = (int(c[0]), int(c[1])), (int(c[2]) if len(c) > 2 else _ANY_ATTEMPT)
            best[key] = max(best.get(key, -1), attempt)
        already_skipped = set()
        for e, p, a in state.get("skip", []):  # committed beyond an earlier checkpoint, counted then
            best[(e, p)] = max(best.get((e, p), -1), a)
            already_skipped.add((e, p))
        if self._cursor is not None:
            return self._restore_claimed(state, best, already_skipped)

        report = RestoreReport()
        self._outstanding, self._recycled, self._next_attempt = {}, deque(), {}
        for e, p, a in state.get("outstanding", []):
            if best.get((e, p), -1) >= a:
                report.committed_outstanding += 1
            else:  # lost in flight: serve again first; it was already counted as started
                self._recycled.append(ServedPrompt(e, p, a))
                report.reserved_outstanding += 1
        for e, p, a in state.get("recycled", []):
            if best.get((e, p), -1) >= a:
                report.committed_beyond_checkpoint += 1
            else:
                self._recycled.append(ServedPrompt(e, p, a))
            self._next_attempt[(e, p)] = a + 1
        cursor = (self.epoch, self.position)
        self._skip = {k: a for k, a in best.items() if k >= cursor}
        report.committed_beyond_checkpoint += len(self._skip.keys() - already_skipped)
        return report

    def _restore_claimed(self, state: dict, best: dict[Position, int], already_skipped: set) -> "RestoreReport":
        """Claim mode: adopt the holder's unfinished blocks; serve their unsettled positions first (the
        checkpoint's in-flight and recycled ones under their attempt), skip what was committed."""
        saved = state["claims"]
        adopted = self.claims.adopt_own()
        self._cursor.restore(adopted, saved)
        mine, from_blocks = {b.index for b in adopted}, {(e, p) for e, p in saved.get("open", [])}
        report = RestoreReport()
        self._outstanding, self._recycled, self._next_attempt = {}, deque(), {}
        for e, p, a in state.get("outstanding", []):
            if best.get((e, p), -1) >= a:
                report.committed_outstanding += 1
            elif self._serve_restored(ServedPrompt(e, p, a), (e, p) in from_blocks, mine):
                report.reserved_outstanding += 1
        for e, p, a in state.get("recycled", []):
            self._next_attempt[(e, p)] = a + 1
            if best.get((e, p), -1) >= a:
                report.committed_beyond_checkpoint += 1
            else:
                self._serve_restored(ServedPrompt(e, p, a), (e, p) in from_blocks, mine)
        self._skip = {k: a for k, a in best.items() if self.claims.index_of(k) in mine}
        progress = saved_progress(saved)
        report.committed_beyond_checkpoint += sum(
            1 for k in self._skip.keys() - already_skipped if k[1] >= progress.get(self.claims.index_of(k), -1))
        return report

    def _serve_restored(self, served: ServedPrompt, from_block: bool, mine: set[int]) -> bool:
        """Serve a checkpointed unsettled prompt again: a retry of a committed group (only this source
        retries it), or a block's position if its block was adopted; False when another writer has it."""
        key = (served.epoch, served.position)
        if from_block and self.claims.index_of(key) not in mine:
            return False
        self._recycled.append(served)
        if from_block:
            self._cursor.reserve(key)
        return True


@dataclass
class RestoreReport:
    """How restoring the cursor accounted for groups started around the checkpoint."""

    committed_outstanding: int = 0  # in flight at the checkpoint, committed since: nothing to do
    reserved_outstanding: int = 0  # in flight at the checkpoint, lost: served again (already counted)
    committed_beyond_checkpoint: int = 0  # started after the checkpoint and committed: now counted


def _claim_cursor(claims: PromptClaims | None, committed_by, num_rows: int) -> BlockCursor | None:
    if claims is None:
        if committed_by is not None:
            raise DataSourceError("committed_by is only used with prompt claims (claims=...)")
        return None
    if claims.num_rows != num_rows:
        raise DataSourceError(f"the prompt claims are over {claims.num_rows} rows but the dataset has {num_rows}")
    return BlockCursor(claims, committed_by)


def _check_mode(state: dict, claimed: bool) -> None:
    if claimed and "claims" not in state:
        raise DataSourceError("the checkpoint's data-source cursor was saved without --allow-rollout-producers; "
                              "resuming it with the flag is not supported (start a new run id, or resume without it)")
    if not claimed and "claims" in state:
        raise DataSourceError("the checkpoint's data-source cursor was saved with --allow-rollout-producers "
                              "(prompts claimed in blocks); resuming it without the flag is not supported")


def _row_metadata(row: dict) -> dict:
    raw = row.get("metadata") or {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw else {}
        except ValueError as e:
            raise DataSourceError(f"prompt row metadata is not JSON: {raw[:80]!r}") from e
    return dict(raw) if isinstance(raw, dict) else {"metadata": raw}
