"""The run lease against other processes and a real S3 server (SeaweedFS): a SIGKILLed holder,
conditional writes (tests/unit is one process with no servers).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from miles_core.storage import Store, conditional
from miles_core.storage.conditional import ReadBackObject, S3Object, conditional_object
from miles_core.storage.lease import LEASE_KEY, Lease, LeaseHeld
from tests.unit.test_lease import FAST, HOLDER_SCRIPT, ROOT, _record


@pytest.mark.s3
def test_a_sigkilled_holder_process_is_taken_over_once_its_lease_expires(storage_root):
    uri = storage_root + "/runs/r"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, uri], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("HELD"), line
        with pytest.raises(LeaseHeld, match=f"pid{proc.pid}/"):
            Lease.acquire(Store(uri), ttl_seconds=3.0, renew_seconds=0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    t0 = time.monotonic()
    with Lease.acquire(Store(uri), ttl_seconds=3.0, renew_seconds=0.5) as heir:
        waited = time.monotonic() - t0
        assert 0.5 < waited < 3.0 + 2.0, waited  # at the killed holder's expiry
        assert _record(Store(uri)).holder == heir.holder


@pytest.mark.s3
def test_seaweedfs_honours_if_none_match_and_if_match(s3_bucket):
    store = Store(f"s3://{s3_bucket}/cond-{time.time_ns()}")
    obj = conditional_object(store, "k.json")
    assert isinstance(obj, S3Object)  # the probe found conditional writes honoured
    v1 = obj.create(b"one")
    assert v1 and obj.create(b"again") is None
    v2 = obj.replace(b"two", v1)
    assert v2 and v2 != v1
    assert obj.replace(b"stale", v1) is None
    assert obj.read() == (b"two", v2)


@pytest.mark.s3
def test_an_s3_server_that_ignores_conditions_gets_the_read_back_fallback(s3_bucket, monkeypatch, caplog):
    real = S3Object.put_once
    monkeypatch.setattr(S3Object, "put_once", lambda self, data, **condition: real(self, data))
    monkeypatch.setattr(conditional, "_S3_PROBED", {})
    store = Store(f"s3://{s3_bucket}/ignoring-{time.time_ns()}")
    obj = conditional_object(store, LEASE_KEY)
    assert isinstance(obj, ReadBackObject) and "ignores conditional writes" in caplog.text
    obj.settle_seconds = 0.05
    with Lease.acquire(store, obj=obj, **FAST) as holder:
        with pytest.raises(LeaseHeld, match=holder.holder.split()[0]):
            Lease.acquire(store, obj=obj, **FAST)
