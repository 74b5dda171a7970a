"""Prompt claims in the run root: which writer generates which block of prompt positions.

Under `--allow-rollout-producers` several writers (the trainer's own rollout, and producer jobs on
this or other clusters) generate groups for one run. The prompt positions `(epoch, position)` of the
data source's seeded order are split into blocks of `block_size` consecutive positions of one epoch
(`blocks_per_epoch = ceil(num_rows / block_size)`; global block `g` is epoch `g // blocks_per_epoch`),
and a writer generates only the blocks it claimed:

    claims/{index:010d}.json   {index, epoch, start, end, holder, writer, token, done, released,
                                claimed_at, renewed_at, ttl_seconds, block_size, num_rows,
                                previous: [{holder, writer}, ...]}

Every write is a compare-and-swap (miles_core.storage.conditional): a new block is claimed by a
conditional create (of two writers creating the same index one wins, the other tries the next), an
expired one is taken over, renewed, finished or released by a conditional replace of the version read.
A unique token in each write makes every version distinct, so a version never comes back (no ABA).

Expiry needs no clock agreement between hosts (producers run on other clusters): like the run-root
lease's watching rule, a record is expired for a writer once its version has stayed the same for the
record's TTL on that writer's monotonic clock, and the takeover replaces exactly that version, so a
renewal in between makes it fail. The wall-clock times in the record are for people only.
The holder renews every held block every TTL/3 (`ClaimRenewer`) and stops serving a block (`holds`
turns false for good) TTL*3/4 after the start of its last successful renewal, before any other writer
can see it expired (a full TTL after it last saw the record change), so at most the groups already in
flight at that moment are generated twice.

Holders: a stable identity, unique among live processes ("trainer" for the run's own rollout, the
producer id for a producer job); `writer` is the buffer writer id it commits under now, recorded so
that a taker-over knows whose committed groups to skip (`Block.previous_writers`).
Cost: `claims/` is listed at most every TTL/4; a claim reads the unfinished records of other holders
(a record read as done is never read again) and creates at the highest index seen + 1.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass

from miles_core.storage import Store, validate_name
from miles_core.storage.conditional import conditional_object

log = logging.getLogger(__name__)

FENCE_FRACTION = 0.75  # a holder stops serving a block this far into the TTL after its last renewal
RENEW_FRACTION = 1 / 3  # ClaimRenewer's default interval, as a fraction of the TTL
MAX_CREATE_ATTEMPTS = 10_000
_KEY_RE = re.compile(r"^claims/(\d{10})\.json$")


@dataclass(frozen=True)
class Block:
    """A claimed block: positions [start, end) of `epoch`'s order."""

    index: int
    epoch: int
    start: int
    end: int
    previous_writer: str | None = None  # the writer that held it just before this holder's writer, else None
    previous_writers: tuple[str, ...] = ()  # every earlier writer, oldest first (skip what each committed)

    def __contains__(self, position: tuple[int, int]) -> bool:
        return position[0] == self.epoch and self.start <= position[1] < self.end


class ClaimError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class _Held:
    record: dict
    version: str
    valid_until: float  # monotonic: the fence
    finishing: bool = False  # finish() could not write `done`: the next renewal does


@dataclass
class _Seen:
    version: str
    since: float  # monotonic, when this version was first read


class PromptClaims:
    """One holder's claims in a run root (see the module doc). Thread-safe."""

    PREFIX = "claims/"

    def __init__(self, store: Store, holder: str, *, writer: str, num_rows: int, block_size: int,
                 ttl_seconds: float):
        self.store = store
        self.holder = validate_name(holder, "prompt-claim holder")
        self.writer = validate_name(writer, "buffer writer id")
        if num_rows < 1:
            raise ClaimError(f"prompt claims need a dataset with rows (num_rows={num_rows})")
        if block_size < 1:
            raise ClaimError(f"--prompt-claim-block-size={block_size} must be >= 1")
        if not ttl_seconds > 0:
            raise ClaimError(f"--prompt-claim-ttl-seconds={ttl_seconds} must be > 0")
        self.num_rows, self.block_size, self.ttl = int(num_rows), int(block_size), float(ttl_seconds)
        self.blocks_per_epoch = -(-self.num_rows // self.block_size)
        self._io = threading.RLock()  # one store operation on our records at a time
        self._mutex = threading.Lock()  # _mine / _dropped, held briefly (holds() never waits on I/O)
        self._mine: dict[int, _Held] = {}
        self._dropped: dict[int, _Held] = {}  # fenced: not served any more, but finish() may still land
        self._known: set[int] = set()
        self._done: set[int] = set()
        self._seen: dict[int, _Seen] = {}
        self._lost: list[int] = []  # fenced since the last renew(), reported by it
        self._listed_at: float | None = None
        self._next_create = 0

    # ------------------------------------------------------------------ geometry
    def key(self, index: int) -> str:
        return f"{self.PREFIX}{index:010d}.json"

    def block_of(self, index: int, previous: list[dict] | tuple = ()) -> Block:
        epoch, k = divmod(index, self.blocks_per_epoch)
        start = k * self.block_size
        writers = tuple(dict.fromkeys(str(p["writer"]) for p in previous))
        return Block(index, epoch, start, min(start + self.block_size, self.num_rows),
                     writers[-1] if writers else None, writers)

    def index_of(self, position: tuple[int, int]) -> int:
        """The global block index of `(epoch, position)`."""
        return position[0] * self.blocks_per_epoch + position[1] // self.block_size

    # ------------------------------------------------------------------ holding
    @property
    def held(self) -> list[int]:
        with self._mutex:
            self._fence()
            return sorted(self._mine)

    def holds(self, index: int) -> bool:
        """True while this holder may serve block `index`; once False, False for good."""
        with self._mutex:
            self._fence()
            return index in self._mine

    def _fence(self) -> list[int]:
        now = time.monotonic()
        fenced = sorted(i for i, h in self._mine.items() if now >= h.valid_until)
        for i in fenced:
            self._dropped[i] = self._mine.pop(i)
            self._lost.append(i)
            log.warning("prompt claims: block %d of %s fenced (no renewal succeeded for %g s); it is no longer "
                        "served here and another writer takes it over", i, self.holder, self.ttl * FENCE_FRACTION)
        return fenced

    def _hold(self, index: int, record: dict, version: str, started: float) -> None:
        with self._mutex:
            self._dropped.pop(index, None)
            self._mine[index] = _Held(record, version, started + self.ttl * FENCE_FRACTION)
        self._known.add(index)
        self._seen.pop(index, None)

    # ------------------------------------------------------------------ records
    def _record(self, index: int, *, previous: list[dict], claimed_at: float | None = None, **flags) -> dict:
        b, now = self.block_of(index), time.time()
        rec = {"index": index, "epoch": b.epoch, "start": b.start, "end": b.end, "holder": self.holder,
               "writer": self.writer, "token": uuid.uuid4().hex, "done": False, "released": False,
               "claimed_at": now if claimed_at is None else claimed_at, "renewed_at": now,
               "ttl_seconds": self.ttl, "block_size": self.block_size, "num_rows": self.num_rows,
               "previous": list(previous)}
        rec.update(flags)
        return rec

    def _parse(self, index: int, data: bytes) -> dict | None:
        """The record, or None when it does not parse (taken over as expired); ClaimError when it was
        written for another geometry (writers disagree on the prompt data or block size)."""
        try:
            rec = json.loads(data)
            ok = (isinstance(rec, dict) and rec.get("index") == index and isinstance(rec.get("done"), bool)
                  and all(isinstance(rec.get(k), str) and rec[k] for k in ("holder", "writer", "token"))
                  and isinstance(rec.get("ttl_seconds"), (int, float)) and rec["ttl_seconds"] > 0
                  and isinstance(rec.get("previous", []), list)
                  and all(isinstance(p, dict) and isinstance(p.get("writer"), str) for p in rec.get("previous", [])))
        except ValueError:
            ok = False
        if not ok:
            return None
        self._check_geometry(index, rec)
        return rec

    def _check_geometry(self, index: int, rec: dict) -> None:
        b = self.block_of(index)
        theirs = (rec.get("epoch"), rec.get("start"), rec.get("end"), rec.get("block_size", self.block_size),
                  rec.get("num_rows", self.num_rows))
        if theirs != (b.epoch, b.start, b.end, self.block_size, self.num_rows):
            raise ClaimError(
                f"prompt claim {self.store.uri(self.key(index))} was written by {rec.get('holder')!r} for block "
                f"size {theirs[3]} over {theirs[4]} prompt rows, but this writer uses {self.block_size} over "
                f"{self.num_rows}: every writer of a run needs the same --prompt-data and --prompt-claim-block-size")

    def _put(self, index: int, record: dict, version: str | None) -> str | None:
        """Conditional create (version None) or replace; the new version, None if another write came first.
        A lost race is re-read: a retried PUT can answer 412 although its first attempt landed."""
        obj = conditional_object(self.store, self.key(index))
        data = json.dumps(record, sort_keys=True).encode()
        got = obj.create(data) if version is None else obj.replace(data, version)
        if got is not None:
            return got
        current = obj.read()
        return current[1] if current is not None and _token(current[0]) == record["token"] else None

    def _read(self, index: int) -> tuple[dict | None, str] | None:
        current = conditional_object(self.store, self.key(index)).read()
        if current is None:
            return None
        return self._parse(index, current[0]), current[1]

    # ------------------------------------------------------------------ claiming
    def claim_next(self) -> Block:
        """The next block to generate: another holder's expired unfinished block first (taken over),
        else a block never claimed (the lowest index above every one seen). Never a live one."""
        with self._io:
            with self._mutex:
                self._fence()
            self._list()
            return self._take_over_expired() or self._create_next()

    def _list(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and self._listed_at is not None and now - self._listed_at < self.ttl / 4:
            return
        for key in self.store.list(self.PREFIX):
            m = _KEY_RE.match(key)
            if m:
                self._known.add(int(m.group(1)))
        self._listed_at = now

    def _candidates(self) -> list[int]:
        with self._mutex:
            mine = set(self._mine)
        return sorted(self._known - self._done - mine)

    def _take_over_expired(self) -> Block | None:
        for index in self._candidates():
            t0 = time.monotonic()
            got = self._read(index)
            if got is None:  # deleted by hand: a gap the next create may fill
                self._known.discard(index)
                continue
            rec, version = got
            if rec is not None and rec["done"]:
                self._done.add(index)
                self._seen.pop(index, None)
            elif self._expired(index, rec, version, t0):
                block = self._take(index, rec, version, t0)
                if block is not None:
                    return block
        return None

    def _expired(self, index: int, rec: dict | None, version: str, now: float) -> bool:
        if rec is None or rec.get("released"):
            return True
        seen = self._seen.get(index)
        if seen is None or seen.version != version:
            self._seen[index] = _Seen(version, now)
            return False
        return now - seen.since >= float(rec["ttl_seconds"])

    def _take(self, index: int, rec: dict | None, version: str, t0: float) -> Block | None:
        previous = [] if rec is None else rec.get("previous", []) + [{"holder": rec["holder"], "writer": rec["writer"]}]
        new = self._record(index, previous=previous)
        got = self._put(index, new, version)
        if got is None:
            self._seen.pop(index, None)  # renewed or taken by another meanwhile
            return None
        self._hold(index, new, got, t0)
        if rec is None:
            log.warning("prompt claims: block %d had an unreadable record %s; %s took it over and generates all of "
                        "its prompts (what its writer committed is unknown)", index, self.key(index), self.holder)
        else:
            log.warning("prompt claims: %s took over block %d from %s (writer %s), whose claim %s", self.holder, index,
                        rec["holder"], rec["writer"], "was released" if rec.get("released") else "expired")
        return self.block_of(index, previous)

    def _create_next(self) -> Block:
        index = max(self._next_create, max(self._known, default=-1) + 1)
        for _ in range(MAX_CREATE_ATTEMPTS):
            t0 = time.monotonic()
            rec = self._record(index, previous=[])
            version = self._put(index, rec, None)
            self._known.add(index)
            if version is not None:
                self._hold(index, rec, version, t0)
                self._next_create = index + 1
                return self.block_of(index)
            index += 1
        raise ClaimError(f"{self.holder} could not claim a prompt block in {self.store.uri(self.PREFIX)} in "
                         f"{MAX_CREATE_ATTEMPTS} attempts; the store's conditional writes do not behave")

    # ------------------------------------------------------------------ renew, finish, release
    def renew(self) -> list[int]:
        """Extend every held claim (ClaimRenewer calls this every TTL/3) and write `done` where finish()
        could not. Returns the indices lost since the last call: taken over by another writer, or fenced
        after renewals failed; they are no longer held. A storage error is logged and the block kept
        until its fence."""
        with self._io:
            with self._mutex:
                self._fence()
                lost, self._lost = self._lost, []
                todo = sorted([*self._mine.items(), *((i, h) for i, h in self._dropped.items() if h.finishing)])
            for index, held in todo:
                if not self._renew_one(index, held):
                    lost.append(index)
            return sorted(lost)

    def _renew_one(self, index: int, held: _Held) -> bool:
        t0 = time.monotonic()
        new = dict(held.record, token=uuid.uuid4().hex, renewed_at=time.time(), done=held.finishing)
        try:
            version = self._put(index, new, held.version)
        except Exception as e:  # noqa: BLE001 - storage trouble: retried at the next renewal until fenced
            log.warning("prompt claims: renewing block %d failed (%s: %s); it is fenced in %.3g s unless a renewal "
                        "succeeds", index, type(e).__name__, str(e)[:300], max(0.0, held.valid_until - t0))
            return True
        with self._mutex:
            self._after_renewal(index, held, new, version, t0)
        if version is None:
            log.warning("prompt claims: block %d of %s was taken over by another writer; it is no longer served "
                        "here", index, self.holder)
        return version is not None

    def _after_renewal(self, index: int, held: _Held, new: dict, version: str | None, t0: float) -> None:
        """Under _mutex. A block fenced during the write stays fenced (with the new version, so a later
        finish() can still land); a renewal that wrote `done` ends the claim."""
        table = self._mine if self._mine.get(index) is held else self._dropped
        if version is None or held.finishing:
            table.pop(index, None)
            if version is not None:
                self._done.add(index)
        elif table.get(index) is held:
            table[index] = _Held(new, version, t0 + self.ttl * FENCE_FRACTION)

    def finish(self, index: int) -> None:
        """Every position of block `index` settled (committed or dropped): mark it done, never claimed again.
        If the write fails for storage trouble, the next renewal writes it."""
        with self._io:
            with self._mutex:
                held = self._mine.get(index) or self._dropped.get(index)
                if held is None:
                    raise ClaimError(f"{self.holder} cannot finish prompt block {index}: it does not hold it")
                held.finishing = True
            done = dict(held.record, token=uuid.uuid4().hex, renewed_at=time.time(), done=True)
            try:
                version = self._put(index, done, held.version)
            except Exception as e:  # noqa: BLE001
                log.warning("prompt claims: finishing block %d failed (%s: %s); the next renewal retries", index,
                            type(e).__name__, str(e)[:300])
                return
            with self._mutex:
                self._mine.pop(index, None)
                self._dropped.pop(index, None)
            if version is not None:
                self._done.add(index)
            else:
                log.warning("prompt claims: block %d was taken over from %s before it finished; the taker "
                            "generates its prompts that writer %s did not commit", index, self.holder, self.writer)

    def release(self) -> None:
        """Clean stop: give every unfinished claim back at once (another writer may take it now)."""
        with self._io:
            with self._mutex:
                todo = sorted({**self._dropped, **self._mine}.items())
                self._mine.clear()
                self._dropped.clear()
            for index, held in todo:
                new = dict(held.record, token=uuid.uuid4().hex, renewed_at=time.time(), done=held.finishing,
                           released=not held.finishing)
                try:
                    if self._put(index, new, held.version) is None:
                        log.warning("prompt claims: block %d was taken over before %s released it", index,
                                    self.holder)
                except Exception as e:  # noqa: BLE001 - it then expires on its own
                    log.warning("prompt claims: releasing block %d failed (%s: %s); it expires in %.0f s", index,
                                type(e).__name__, str(e)[:300], self.ttl)

    # ------------------------------------------------------------------ restart
    def adopt_own(self) -> list[Block]:
        """A restarted holder's own unfinished claims, re-asserted under the new writer id whatever their
        expiry (unless another writer took them over). Their `previous_writers` include the holder's
        earlier writer ids, so the caller can skip what they committed."""
        with self._io:
            self._list(force=True)
            return [b for b in (self._adopt(i) for i in self._candidates()) if b is not None]

    def _adopt(self, index: int) -> Block | None:
        t0 = time.monotonic()
        got = self._read(index)
        rec = got[0] if got is not None else None
        if rec is None or rec["done"] or rec["holder"] != self.holder:
            if rec is not None and rec["done"]:
                self._done.add(index)
            return None
        previous = list(rec.get("previous", []))
        if rec["writer"] != self.writer:
            previous.append({"holder": rec["holder"], "writer": rec["writer"]})
        new = self._record(index, previous=previous, claimed_at=rec.get("claimed_at"))
        version = self._put(index, new, got[1])
        if version is None:
            log.warning("prompt claims: block %d of %s was taken over while it was being adopted", index, self.holder)
            return None
        self._hold(index, new, version, t0)
        return self.block_of(index, previous)


def _token(data: bytes) -> str | None:
    try:
        rec = json.loads(data)
    except ValueError:
        return None
    return rec.get("token") if isinstance(rec, dict) else None


class ClaimRenewer:
    """Renews a holder's claims on a daemon thread every `interval_seconds` (default TTL/3), until stop().

    The holder needs it (or its own renew() calls at that cadence) for as long as it serves claimed
    blocks: a claim not renewed for TTL*3/4 is fenced and, a TTL later, taken over."""

    def __init__(self, claims: PromptClaims, interval_seconds: float | None = None):
        self.claims = claims
        self.interval = claims.ttl * RENEW_FRACTION if interval_seconds is None else float(interval_seconds)
        if not 0 < self.interval <= claims.ttl / 3:
            raise ClaimError(f"claim renewal interval {self.interval} s must be in (0, TTL/3 = {claims.ttl / 3:g} s], "
                             "so that a holder gets two renewals before it is fenced at 3/4 of the TTL")
        self.lost: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="miles-prompt-claims", daemon=True)

    def start(self) -> "ClaimRenewer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "ClaimRenewer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.lost.extend(self.claims.renew())
            except Exception as e:  # noqa: BLE001 - keep renewing; the fence covers a long outage
                log.warning("prompt claims: renewal round failed (%s: %s)", type(e).__name__, str(e)[:300])

