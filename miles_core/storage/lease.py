"""One writer per run root (docs/training.md): a lease object that its holder renews and that fences it.

    with Lease.acquire(store, ttl_seconds=60) as lease:   # LeaseHeld (naming the holder) if another lives
        ...
        lease.check()                                      # LeaseLost once the holder must stop writing
    # released on exit (also when the body raised)

The lease is `LEASE.json` in the run root: holder (host/pid/token, plus the Flyte execution when
there is one), a random token, a renewal counter, acquired/renewed/expires-at (the holder's wall
clock), the TTL and renewal interval. It is created and replaced only by compare-and-swap
(miles_core.storage.conditional: S3 `If-None-Match: *` / `If-Match: <ETag>`, link(2)+flock(2) on file://),
so of two contenders at most one wins, whether both create or both take over the same expired record.

Timings (`--lease-ttl-seconds`, default 60; `--lease-renew-seconds`, default TTL/4 = 15):
- the holder's heartbeat thread renews every renewal interval, conditional on the version it holds;
  a renewal that finds another record means the lease was taken over: the holder is fenced at once;
- fencing: the holder stops writing TTL - margin (margin = TTL/4: 45 s by default) after the start of
  its last successful renewal, measured on its monotonic clock. `check()` raises LeaseLost from then
  on, whether or not the heartbeat thread still runs (a hung storage call cannot extend it);
- a contender that finds a live record watches it: a renewal (or a new holder) seen while watching
  proves the holder alive and it is refused (LeaseHeld) within about one renewal interval; the record
  is free once released, once the contender's wall clock passes `expires_at`, or once it has stayed
  unchanged for a whole TTL of watching. Clocks must agree within the margin (NTP keeps them within
  milliseconds); the watching rule alone needs no clock agreement. Takeover is a conditional replace.
- release writes a released record (conditional on the holder's version), so the next writer, e.g. the
  retry of a failed task, takes over at once; a SIGKILLed holder's lease is taken over after expiry.
What the fence does not cover: a commit that began before the fence finishes after it; and actors of
the fenced holder (the producer) keep running until the driver, raising LeaseLost, tears them down.
Both end well before a contender may take over (the margin, 15 s by default).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from miles_core.storage import Store
from miles_core.storage.conditional import ConditionalObject, conditional_object

log = logging.getLogger(__name__)

LEASE_KEY = "LEASE.json"
DEFAULT_TTL_SECONDS = 60.0


class LeaseHeld(RuntimeError):
    """Another writer holds the run root's lease (a user-level error: retrying does not help)."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


class LeaseLost(RuntimeError):
    """This writer's lease ended (renewals failed or another took it over): it must stop writing."""

    def __init__(self, message: str):
        super().__init__(message)


class LeaseError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    token: str
    seq: int  # 0 when acquired, +1 per renewal
    acquired_at: float
    renewed_at: float
    expires_at: float
    ttl_seconds: float
    renew_seconds: float
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "LeaseRecord":
        try:
            d = json.loads(data)
            return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
        except (ValueError, TypeError, KeyError) as e:
            raise LeaseError(f"{where} is not a lease record ({e}); if no writer runs on this run root, "
                             "delete it, or let `miles doctor RUN_URI --repair` move it aside") from e

    def renewed(self, now: float) -> "LeaseRecord":
        return dataclasses.replace(self, seq=self.seq + 1, renewed_at=now, expires_at=now + self.ttl_seconds)


def holder_label(token: str) -> str:
    """host/pid/token, plus the Flyte execution and attempt when running as a Flyte task."""
    label = f"{socket.gethostname()}/pid{os.getpid()}/{token[:8]}"
    execution = os.environ.get("FLYTE_INTERNAL_EXECUTION_ID")
    if execution:
        label += f" (flyte execution {execution}, attempt {os.environ.get('FLYTE_ATTEMPT_NUMBER', '0')})"
    return label


def check_timings(ttl_seconds: float, renew_seconds: float | None) -> float:
    """The renewal interval for these timings (default TTL/4); ValueError when they cannot work."""
    renew = ttl_seconds / 4 if renew_seconds is None else renew_seconds
    if not ttl_seconds > 0 or not renew > 0:
        raise ValueError(f"lease TTL ({ttl_seconds}) and renewal interval ({renew}) must be > 0")
    if renew > ttl_seconds / 3:
        raise ValueError(f"lease renewal interval {renew} s must be <= TTL/3 = {ttl_seconds / 3:g} s, so that a "
                         "holder gets two renewals before it is fenced at 3/4 of the TTL")
    return renew


class Lease:
    """The run root's write lease. Use `Lease.acquire(...)`; see the module doc for the protocol."""

    def __init__(self, store: Store, *, ttl_seconds: float = DEFAULT_TTL_SECONDS, renew_seconds: float | None = None,
                 key: str = LEASE_KEY, obj: ConditionalObject | None = None):
        self.store, self.key = store, key
        self.obj = obj if obj is not None else conditional_object(store, key)
        self.ttl_seconds = float(ttl_seconds)
        self.renew_seconds = check_timings(self.ttl_seconds, renew_seconds)
        self.margin_seconds = self.ttl_seconds / 4
        self.token = uuid.uuid4().hex
        self.holder = holder_label(self.token)
        self._mutex = threading.Lock()
        self._record: LeaseRecord | None = None
        self._version = ""
        self._valid_until = 0.0  # monotonic
        self._lost: str | None = "not acquired"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, store: Store, **kw) -> "Lease":
        lease = cls(store, **kw)
        lease._acquire()
        return lease

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ acquire

    def _acquire(self) -> None:
        watched, since, lost_race, claims = None, 0.0, False, 0
        while True:
            current = self.obj.read()
            if claims >= 10:
                raise LeaseError(f"could not take the lease {self.store.uri(self.key)} in {claims} attempts; the "
                                 "store's conditional writes do not behave (see miles_core.storage.conditional)")
            if current is None:
                claims += 1
                if self._claim(None):
                    return
                lost_race = True
                continue
            rec = LeaseRecord.from_bytes(current[0], self.store.uri(self.key))
            if (rec.token, rec.seq) != watched:
                if (watched is not None or lost_race) and not rec.released:
                    raise self._held(rec)  # renewed or taken by another while we watched: alive
                watched, since = (rec.token, rec.seq), time.monotonic()
            if rec.released or time.time() >= rec.expires_at or time.monotonic() - since >= rec.ttl_seconds:
                claims += 1
                if self._claim(current[1]):
                    if not rec.released:
                        log.warning("lease on %s: took over from %s, whose lease expired", self.store.uri(), rec.holder)
                    return
                lost_race = True  # another contender won: the next read names it
                continue
            time.sleep(min(1.0, rec.renew_seconds / 4))

    def _claim(self, version: str | None) -> bool:
        now, t0 = time.time(), time.monotonic()
        rec = LeaseRecord(self.holder, self.token, 0, now, now, now + self.ttl_seconds, self.ttl_seconds,
                          self.renew_seconds)
        data = rec.to_bytes()
        got = self._settle(self.obj.create(data) if version is None else self.obj.replace(data, version), rec)
        if got is None:
            return False
        with self._mutex:
            self._record, self._version, self._valid_until, self._lost = rec, got, self._fence_at(t0), None
        log.info("lease on %s acquired by %s (TTL %g s, renewed every %g s)", self.store.uri(), self.holder,
                 self.ttl_seconds, self.renew_seconds)
        self._thread = threading.Thread(target=self._heartbeat, name="miles-lease", daemon=True)
        self._thread.start()
        return True

    def _settle(self, version: str | None, wrote: LeaseRecord) -> str | None:
        """The version of what we wrote; a lost race (None) is re-read, since a retried PUT can answer
        412 although its first attempt landed."""
        if version is not None:
            return version
        current = self.obj.read()
        if current is None:
            return None
        rec = LeaseRecord.from_bytes(current[0], self.store.uri(self.key))
        return current[1] if (rec.token, rec.seq, rec.released) == (wrote.token, wrote.seq, wrote.released) else None

    def _held(self, rec: LeaseRecord) -> LeaseHeld:
        now = time.time()
        return LeaseHeld(
            f"run root {self.store.uri()} is being written by {rec.holder} (lease renewed {now - rec.renewed_at:.0f} s "
            f"ago, expires in {max(0.0, rec.expires_at - now):.0f} s): one writer per run root. Wait for that segment "
            f"to end; if it died, its lease expires {rec.ttl_seconds:.0f} s after its last renewal and the next run "
            "takes over.", holder=rec.holder)

    # ------------------------------------------------------------------ hold

    def _fence_at(self, renewal_started: float) -> float:
        return renewal_started + self.ttl_seconds - self.margin_seconds

    def check(self) -> None:
        """Raise LeaseLost unless this writer may still write to the run root."""
        with self._mutex:
            if self._lost is None and time.monotonic() >= self._valid_until:
                self._lost = f"no renewal succeeded for {self.ttl_seconds - self.margin_seconds:g} s"
            reason = self._lost
        if reason is not None:
            raise LeaseLost(f"lost the write lease on {self.store.uri()} ({reason}); this writer stopped writing "
                            "to the run root. A retry takes the lease over once it is free.")

    @property
    def held(self) -> bool:
        try:
            self.check()
            return True
        except LeaseLost:
            return False

    def renew(self) -> None:
        """One renewal (the heartbeat calls this); LeaseLost when the record is no longer ours."""
        t0 = time.monotonic()
        with self._mutex:
            if self._lost is not None:
                return
            rec, version = self._record, self._version
        new = rec.renewed(time.time())
        got = self._settle(self.obj.replace(new.to_bytes(), version), new)
        if got is None:
            current = self.obj.read()
            other = LeaseRecord.from_bytes(current[0], self.store.uri(self.key)).holder if current else "nobody"
            raise LeaseLost(f"the lease record changed under its holder; it now names {other}")
        with self._mutex:
            if self._lost is None:
                self._record, self._version, self._valid_until = new, got, self._fence_at(t0)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.renew_seconds):
            try:
                self.renew()
            except LeaseLost as e:
                self._mark_lost(str(e))
                return
            except Exception as e:  # noqa: BLE001 - storage trouble: retry at the next beat until fenced
                left = self._valid_until - time.monotonic()
                log.warning("lease on %s: renewal failed (%s: %s); this writer stops in %.0f s unless one succeeds",
                            self.store.uri(), type(e).__name__, str(e)[:300], max(0.0, left))
            if not self.held:
                log.error("lease on %s: fenced (%s); this writer stops writing", self.store.uri(), self._lost)
                return

    def _mark_lost(self, reason: str) -> None:
        with self._mutex:
            if self._lost is None:
                self._lost = reason
        log.error("lease on %s lost: %s", self.store.uri(), reason)

    # ------------------------------------------------------------------ release

    def release(self) -> None:
        """Stop renewing and mark the record released (best effort: otherwise it expires)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl_seconds)
        with self._mutex:
            mine = self._lost is None and time.monotonic() < self._valid_until
            rec, version, self._lost = self._record, self._version, "released"
        if not mine:
            return
        now = time.time()
        released = dataclasses.replace(rec.renewed(now), expires_at=now, released=True)
        try:
            if self._settle(self.obj.replace(released.to_bytes(), version), released) is not None:
                log.info("lease on %s released by %s", self.store.uri(), self.holder)
        except Exception as e:  # noqa: BLE001 - the lease then expires on its own
            log.warning("lease on %s: release failed (%s); it expires in %.0f s", self.store.uri(),
                        type(e).__name__, self.ttl_seconds)
