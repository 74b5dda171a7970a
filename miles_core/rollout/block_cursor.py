"""Which positions a data source serves under prompt claims (miles_core.rollout.claims).

The claimed blocks' positions are served in order (adopted blocks first, then each block
`claim_next` returns), skipping the positions that the block's earlier writers committed
(`committed_by(writer)`) and those the caller says to skip. A block is finished (`claims.finish`)
once it is exhausted and every position served from it has settled: committed, or dropped; a
recycled position settles only when its retry does. A block the holder no longer holds (fenced,
or taken over) is left at once: its unserved positions are the taker's.

Durable state (`state()`, in the data source's checkpoint): for every block served from and not
finished, the next position to serve, so that a restarted holder adopting it (`claims.adopt_own`)
does not serve again what it served before the checkpoint (consumed groups are not in the
buffer's committed set any more).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from miles_core.rollout.claims import Block, ClaimError, PromptClaims

log = logging.getLogger(__name__)

Position = tuple[int, int]


class BlockCursor:
    def __init__(self, claims: PromptClaims, committed_by: Callable[[str], set[Position]] | None = None):
        self.claims = claims
        self.committed_by = committed_by
        self.block: Block | None = None
        self.next = 0
        self.queue: deque[tuple[Block, int]] = deque()  # adopted blocks and where to start in each
        self.skip: set[Position] = set()  # not to serve from the cursor (committed before, or reserved)
        self.open: dict[int, set[Position]] = {}  # block -> served, not settled
        self.exhausted: set[int] = set()  # served through, waiting for open positions to settle
        self.left: set[int] = set()  # no longer held: its unserved positions are another writer's
        self.left_open: set[Position] = set()  # served from a left block, not settled: the taker serves them
        self.progress: dict[int, int] = {}  # block -> next position, for every block touched, unfinished

    # ------------------------------------------------------------------ serving
    def next_position(self, skip: Callable[[Position], bool]) -> Position:
        """The next position to generate; claims a block when the current one is done."""
        while True:
            if self.block is None or self.next >= self.block.end or not self.claims.holds(self.block.index):
                self._leave()
                self._enter(*(self.queue.popleft() if self.queue else (self.claims.claim_next(), None)))
                self._skip_ahead(skip)
                continue
            pos = (self.block.epoch, self.next)
            self.next += 1
            self.open.setdefault(self.block.index, set()).add(pos)
            self._skip_ahead(skip)  # so the block is known exhausted once its last position is served
            return pos

    def _skip_ahead(self, skip: Callable[[Position], bool]) -> None:
        while self.next < self.block.end:
            pos = (self.block.epoch, self.next)
            if pos in self.skip:
                self.skip.discard(pos)
            elif not skip(pos):
                break
            self.next += 1
        self.progress[self.block.index] = self.next

    def _enter(self, block: Block, start: int | None) -> None:
        self.block, self.next = block, block.start if start is None else start
        self.progress[block.index] = self.next
        self.left.discard(block.index)
        for writer in block.previous_writers if self.committed_by is not None else ():
            self.skip |= {p for p in self.committed_by(writer) if p in block and p[1] >= self.next}

    def _leave(self) -> None:
        b, self.block = self.block, None
        if b is None:
            return
        self._forget_skips(b)
        if self.next >= b.end:
            self.exhausted.add(b.index)
            self._maybe_finish(b.index)
        else:
            self._abandon(b.index)

    def _abandon(self, index: int) -> None:
        """Block `index` is no longer ours: never finish it here; what it has open is the taker's."""
        if self.block is not None and self.block.index == index:
            self.block = None
        self._forget_skips(self.claims.block_of(index))
        self.exhausted.discard(index)
        self.left.add(index)
        self.left_open |= self.open.pop(index, set())

    def _forget_skips(self, block: Block) -> None:
        self.skip = {p for p in self.skip if p not in block}

    # ------------------------------------------------------------------ settling
    def settled(self, pos: Position) -> None:
        """A position served from a block settled (committed, or dropped for good)."""
        index = self.claims.index_of(pos)
        served = self.open.get(index)
        self.left_open.discard(pos)
        if served is None:
            return
        served.discard(pos)
        if self.block is not None and self.block.index == index and self.next >= self.block.end:
            self._leave()  # served through: finished now if nothing else is open
        else:
            self._maybe_finish(index)

    def reserve(self, pos: Position) -> None:
        """A position of an adopted block that the caller serves itself (a restored in-flight or recycled
        one): not served from the cursor, and unsettled until `settled`."""
        self.open.setdefault(self.claims.index_of(pos), set()).add(pos)
        self.skip.add(pos)

    def gave_away(self, pos: Position) -> bool:
        """True (once) for a recycled position served from a block this holder no longer holds: the block
        goes to another writer (or back to this one after expiry), which serves it as not committed.
        Other recycled positions (committed groups rejected as stale) are only ever retried here."""
        index = self.claims.index_of(pos)
        if pos in self.open.get(index, ()) and not self.claims.holds(index):
            self._abandon(index)
        if pos not in self.left_open:
            return False
        self.left_open.discard(pos)
        return True

    def _maybe_finish(self, index: int) -> None:
        if index not in self.exhausted or self.open.get(index):
            return
        self.exhausted.discard(index)
        self.open.pop(index, None)
        self.progress.pop(index, None)
        try:
            self.claims.finish(index)
        except ClaimError as e:  # taken over meanwhile: the taker finishes it
            log.warning("prompt claims: %s", e)

    # ------------------------------------------------------------------ durable state
    def state(self) -> dict:
        """Per unfinished block the next position to serve, and the positions served from blocks and not
        settled (those a restart serves again only if it adopts their block)."""
        opened = self.left_open.union(*self.open.values())
        return {"progress": sorted([i, n] for i, n in self.progress.items()), "open": sorted(map(list, opened))}

    def restore(self, adopted: list[Block], saved: dict) -> None:
        """Serve the adopted blocks first, each from where `saved` (an earlier `state()`) left it."""
        progress = saved_progress(saved)
        self.block, self.skip, self.open, self.exhausted = None, set(), {}, set()
        self.left, self.left_open = set(), set()
        self.progress = {b.index: progress[b.index] for b in adopted if b.index in progress}
        self.queue = deque((b, self.progress.get(b.index)) for b in sorted(adopted, key=lambda b: b.index))


def saved_progress(saved: dict) -> dict[int, int]:
    """{block index: next position} of a `BlockCursor.state()`: what the holder had served by then."""
    return {int(i): int(n) for i, n in saved.get("progress", [])}
