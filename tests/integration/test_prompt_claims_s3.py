"""Prompt claims on a real S3 server (SeaweedFS; tests/unit runs no servers).
"""

from __future__ import annotations

import threading
import time

import pytest

from miles_core.rollout.claims import ClaimRenewer
from miles_core.storage import Store
from tests.unit.test_prompt_claims import claims


# ---------------------------------------------------------------------------------------------- real S3
@pytest.mark.slow
@pytest.mark.s3
def test_claims_on_a_real_s3_server(s3_bucket):
    """Three holders race for 12 blocks over If-None-Match; one dies, a fourth takes exactly its blocks
    over (If-Match) a TTL later while the others keep theirs."""
    ttl = 3.0
    store = Store(f"s3://{s3_bucket}/claims-{time.time_ns()}")
    holders = [claims(store, f"p{i}", ttl=ttl) for i in range(3)]
    renewers = [ClaimRenewer(h).start() for h in holders]
    got: dict[str, list[int]] = {}

    def run(h):
        got[h.holder] = [h.claim_next().index for _ in range(4)]

    threads = [threading.Thread(target=run, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for v in got.values() for i in v) == list(range(12))
    renewers[0].stop()  # p0 dies
    taker = claims(store, "p9", ttl=ttl)
    try:
        assert taker.claim_next().index == 12  # and starts watching every unfinished block
        time.sleep(ttl + 0.3)
        taken = [taker.claim_next() for _ in range(4)]
    finally:
        for r in renewers[1:]:
            r.stop()
    assert sorted(b.index for b in taken) == sorted(got["p0"])
    assert {b.previous_writer for b in taken} == {"w-p0"}
    assert sorted(holders[1].held + holders[2].held) == sorted(got["p1"] + got["p2"])
