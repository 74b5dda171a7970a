"""Prompt claims in the run root (miles_core.rollout.claims) and the data source's claim mode.

Pins: two holders never hold the same block (interleaved, and threads racing on one store); a holder
that stops renewing is fenced, then loses its block a TTL later to a taker that learns its writer;
a renewed block is never taken; a finished block is never claimed again; release gives blocks back
at once; a restarted holder adopts its own unfinished blocks (not those taken over); an unreadable
record is taken over with a warning; writers that disagree on the geometry are refused. Claim mode:
two data sources together serve every position of two epochs exactly once, with and without
shuffle; a killed source's block is finished by the other minus what it committed; group ids differ
across holders; a restarted source serves its unsettled positions again and nothing twice.
The racing test fails if create were a plain put (two threads then both "create" an index).
Time is the claims module's clock, moved by each test (`clock`, `elapse`): fences and expiries then
depend on the test's steps alone, never on how late a loaded machine runs it. A holder's renewals are
its renew() calls at the renewer's cadence; one test runs the ClaimRenewer thread against that clock.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time

import pytest

from miles_core.buffer.objects import committed_positions, group_key
from miles_core.rollout import claims as claims_module
from miles_core.rollout.claims import ClaimError, ClaimRenewer, PromptClaims
from miles_core.rollout.data_source import DataSource, DataSourceError, position_of
from miles_core.samples import SampleStatus, groups_to_ipc
from miles_core.storage import Store

TTL = 0.5  # fenced 3/8 s after the last renewal, taken over a TTL after a watcher first saw the record


class Clock:
    """The claims module's `time`, moved only by the test (binary fractions, so sums are exact)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(claims_module, "time", c)
    return c


def elapse(clock: Clock, seconds: float, *renewing: PromptClaims) -> None:
    """`seconds` pass; each holder in `renewing` renews every TTL/4 meanwhile, as its ClaimRenewer would."""
    end = clock.now + seconds
    while clock.now < end:
        clock.advance(min(TTL / 4, end - clock.now))
        for h in renewing:
            h.renew()


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    if request.param == "memory":
        return Store(f"memory://claims-{time.time_ns()}/run")
    return Store(f"file://{tmp_path}/run")


def claims(store, holder="trainer", writer=None, *, rows=10, block=4, ttl=TTL) -> PromptClaims:
    return PromptClaims(store, holder, writer=writer or f"w-{holder}", num_rows=rows, block_size=block,
                        ttl_seconds=ttl)


def record(store, index) -> dict:
    return json.loads(store.get_bytes(PromptClaims.PREFIX + f"{index:010d}.json"))


# ---------------------------------------------------------------------------------------------- claims
def test_blocks_follow_epochs_and_two_holders_never_share_one(store):
    a, b = claims(store, "trainer", ttl=60), claims(store, "p1", ttl=60)
    got = [(h, h.claim_next()) for h in (a, b, b, a, b, a, a)]
    indices = [blk.index for _, blk in got]
    assert sorted(indices) == list(range(7))
    assert not set(a.held) & set(b.held) and sorted(a.held + b.held) == list(range(7))
    geometry = {blk.index: (blk.epoch, blk.start, blk.end) for _, blk in got}
    assert geometry[0] == (0, 0, 4) and geometry[2] == (0, 8, 10) and geometry[3] == (1, 0, 4)  # 3 blocks per epoch
    assert all(blk.previous_writer is None for _, blk in got)
    assert record(store, 1)["holder"] == "p1" and record(store, 1)["writer"] == "w-p1"


def test_threads_racing_on_one_store_claim_distinct_blocks(store):
    """Four holders claim 8 blocks each at once: 32 distinct indices, no gap (a plain put would let two
    threads take the same index)."""
    holders = [claims(store, f"p{i}", ttl=60) for i in range(4)]
    got: dict[str, list[int]] = {}
    barrier = threading.Barrier(4)

    def run(h):
        barrier.wait()
        got[h.holder] = [h.claim_next().index for _ in range(8)]

    threads = [threading.Thread(target=run, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for v in got.values() for i in v]
    assert sorted(every) == list(range(32))
    assert all(record(store, i)["holder"] == h for h, v in got.items() for i in v)


def test_a_holder_that_stops_renewing_is_fenced_then_taken_over_after_ttl(store, clock, caplog):
    a, b = claims(store, "trainer", "w-old"), claims(store, "p1")
    assert a.claim_next().index == 0
    assert b.claim_next().index == 1  # b first sees block 0 here
    clock.advance(TTL / 2)
    assert a.holds(0)
    clock.advance(TTL / 4)
    assert not a.holds(0) and a.held == []  # fenced at 3/4 TTL: a no longer serves it
    assert b.claim_next().index == 2  # b watched 0 for less than a TTL: not expired yet
    clock.advance(TTL / 4)
    with caplog.at_level(logging.WARNING):
        taken = b.claim_next()
    assert (taken.index, taken.previous_writer, taken.previous_writers) == (0, "w-old", ("w-old",))
    assert record(store, 0)["previous"] == [{"holder": "trainer", "writer": "w-old"}]
    assert "took over block 0 from trainer" in caplog.text
    assert a.renew() == [0]  # reported once ...
    assert a.renew() == []  # ... and a does not renew b's claim
    assert record(store, 0)["holder"] == "p1"


def test_expiry_never_reads_the_holders_wall_clock(store, clock):
    """A record stamped by a host whose clock is an hour behind is still watched a whole TTL (on the
    watcher's monotonic clock) before it is taken over."""
    claims(store, "trainer").claim_next()
    stale = dict(record(store, 0), claimed_at=time.time() - 3600, renewed_at=time.time() - 3600)
    store.put_bytes(PromptClaims.PREFIX + "0000000000.json", json.dumps(stale).encode())
    b = claims(store, "p1")
    assert b.claim_next().index == 1
    clock.advance(TTL * 7 / 8)
    assert b.claim_next().index == 2  # watched for less than a TTL
    clock.advance(TTL / 8)
    assert b.claim_next().index == 0


def test_renewals_that_fail_fence_the_holder_before_anyone_can_take_over(store, clock, monkeypatch):
    a, b = claims(store), claims(store, "p1")
    a.claim_next()
    assert b.claim_next().index == 1  # b starts watching block 0
    monkeypatch.setattr(a, "_put", lambda *args: (_ for _ in ()).throw(OSError("storage down")))
    for _ in range(2):
        clock.advance(TTL / 4)
        assert a.renew() == [] and a.holds(0)  # a failed renewal keeps the block until the fence
    clock.advance(TTL / 4)
    assert a.renew() == [0] and not a.holds(0)  # fenced at 3/4 of the TTL ...
    assert b.claim_next().index == 2  # ... while b may not take it over yet
    clock.advance(TTL / 4)
    assert b.claim_next().index == 0


def test_a_renewed_block_is_never_taken(store, clock):
    a, b = claims(store, "trainer"), claims(store, "p1")
    a.claim_next()
    seen = [b.claim_next().index]
    for _ in range(8):  # b watches it two TTLs: it would have expired by then
        elapse(clock, TTL / 4, a)
        seen.append(b.claim_next().index)
        assert a.holds(0)
    assert 0 not in seen and a.held == [0] and record(store, 0)["holder"] == "trainer"


def test_a_claim_renewer_renews_on_its_own_thread(store, clock):
    """The renewer's thread runs on real time; the fence on the claims' clock. Each step waits until two
    renewals have started after the clock moved, so none is judged by a renewal from before."""
    a = claims(store)
    a.claim_next()
    tokens = []

    def renewed_twice():
        deadline = time.monotonic() + 60
        while len(set(tokens)) < 3 and time.monotonic() < deadline:
            tokens.append(record(store, 0)["token"])
            time.sleep(0.01)
        assert len(set(tokens)) >= 3, "the renewer did not renew within 60 s"
        tokens.clear()

    with ClaimRenewer(a, interval_seconds=0.02):
        for _ in range(4):  # 4 x 3/16 s: twice the fence
            clock.advance(TTL * 3 / 8)
            renewed_twice()
            assert a.holds(0)
    assert a.held == [0]


def test_a_finished_block_is_never_claimed_again(store, clock):
    a, b = claims(store, "trainer"), claims(store, "p1")
    a.claim_next()
    a.finish(0)
    assert a.held == [] and record(store, 0)["done"] is True
    assert b.claim_next().index == 1
    clock.advance(TTL)
    assert b.claim_next().index == 2 and a.renew() == []
    with pytest.raises(ClaimError, match="does not hold"):
        a.finish(0)


def test_a_finish_that_fails_for_storage_trouble_is_written_by_the_next_renewal(store, monkeypatch):
    a = claims(store, ttl=60)
    a.claim_next()
    real = a._put
    monkeypatch.setattr(a, "_put", lambda *args: (_ for _ in ()).throw(OSError("storage down")))
    a.finish(0)  # logged, not raised: the producer loop keeps going
    assert record(store, 0)["done"] is False
    monkeypatch.setattr(a, "_put", real)
    assert a.renew() == [] and record(store, 0)["done"] is True and a.held == []


def test_release_gives_blocks_back_at_once(store):
    a, b = claims(store, "trainer", ttl=60), claims(store, "p1", ttl=60)
    a.claim_next(), a.claim_next()
    a.release()
    assert a.held == []
    first, second = b.claim_next(), b.claim_next()
    assert (first.index, second.index) == (0, 1) and first.previous_writer == "w-trainer"


def test_a_restarted_holder_adopts_its_own_unfinished_blocks(store, clock):
    old, other = claims(store, "trainer", "w1"), claims(store, "p1")
    for _ in range(3):
        old.claim_next()
    old.finish(0)
    other.claim_next()  # 3; other starts watching 1 and 2
    clock.advance(TTL)
    assert other.claim_next().index == 1  # taken over from the dead trainer
    new = claims(store, "trainer", "w2")  # the trainer's next segment
    adopted = new.adopt_own()
    assert [(b.index, b.previous_writers) for b in adopted] == [(2, ("w1",))]
    assert new.held == [2] and record(store, 2)["writer"] == "w2"
    elapse(clock, TTL, new)
    assert other.claim_next().index == 4  # the adopted block is live again
    assert new.held == [2]


def test_an_unreadable_record_is_taken_over_with_a_warning(store, caplog):
    store.put_bytes(PromptClaims.PREFIX + "0000000000.json", b"{not json")
    b = claims(store, "p1")
    with caplog.at_level(logging.WARNING):
        blk = b.claim_next()
    assert (blk.index, blk.previous_writer) == (0, None) and "unreadable record" in caplog.text
    assert record(store, 0)["holder"] == "p1"


def test_writers_that_disagree_on_the_block_size_are_refused(store):
    claims(store, "trainer", block=4, ttl=60).claim_next()
    with pytest.raises(ClaimError, match="--prompt-claim-block-size"):
        claims(store, "p1", block=5, ttl=60).claim_next()


def test_claims_is_listed_at_most_every_quarter_ttl(store, monkeypatch):
    h = claims(store, "p1", ttl=60)
    calls = []
    real = store.list
    monkeypatch.setattr(store, "list", lambda prefix="": calls.append(prefix) or real(prefix))
    for _ in range(5):
        h.claim_next()
    assert calls == ["claims/"] and h.held == [0, 1, 2, 3, 4]


def test_bad_arguments_are_named():
    s = Store(f"memory://claims-bad-{time.time_ns()}/run")
    with pytest.raises(ClaimError, match="--prompt-claim-block-size=0"):
        claims(s, block=0)
    with pytest.raises(ClaimError, match="--prompt-claim-ttl-seconds"):
        claims(s, ttl=0)
    with pytest.raises(ClaimError, match="TTL/3"):
        ClaimRenewer(claims(s), interval_seconds=TTL)


# ---------------------------------------------------------------------------------------------- claim mode
def rows(k=10):
    return [{"prompt": [i, 7], "label": str(i), "task": "t", "metadata": "{}"} for i in range(k)]


def source(store, holder, *, writer=None, block=3, ttl=60, shuffle=True, committed=None, k=10) -> DataSource:
    c = claims(store, holder, writer, rows=k, block=block, ttl=ttl)
    committed_by = None if committed is None else (lambda w: set(committed.get(w, ())))
    return DataSource(rows(k), 2, seed=5, shuffle=shuffle, claims=c, committed_by=committed_by)


@pytest.mark.parametrize("shuffle", [True, False])
def test_two_sources_serve_every_position_of_two_epochs_once(store, shuffle):
    a, b = source(store, "trainer", shuffle=shuffle), source(store, "p1", shuffle=shuffle)
    rng, served = random.Random(0), []
    while not all((e, p) in {x[:2] for x in served} for e in (0, 1) for p in range(10)):
        ds = rng.choice([a, b])
        g = ds.next_group()
        e, p, att = position_of(g)
        assert g.group_id == f"e{e}-p{p}-a{att}-{ds.claims.holder}"
        assert json.loads(g.samples[0].metadata)["writer"] == ds.claims.holder
        assert g.prompt_index == ds.order(e)[p] and all(s.prompt_index == g.prompt_index for s in g.samples)
        served.append((e, p, g.prompt_index, ds.claims.holder))
        ds.settled(g)
    keys = [x[:2] for x in served]
    assert len(keys) == len(set(keys))  # nothing twice
    for e in (0, 1):
        assert sorted(x[2] for x in served if x[0] == e) == list(range(10))  # every row once per epoch
    assert {x[3] for x in served} == {"trainer", "p1"}
    assert a.order(0) == b.order(0) and (a.order(0) != list(range(10))) == shuffle
    for i in range(6):  # two epochs of blocks [0,3) [3,6) [6,9) [9,10): all finished
        assert record(store, i)["done"] is True


def test_a_killed_sources_block_is_finished_by_another_minus_what_it_committed(store, clock):
    committed: dict[str, set] = {"w-dead": set()}
    dead = source(store, "p0", writer="w-dead", block=4, ttl=TTL, committed=committed)
    live = source(store, "p1", writer="w-live", block=4, ttl=TTL, committed=committed)
    g = [dead.next_group() for _ in range(3)]  # positions 0, 1, 2 of block 0
    for x in g[:2]:
        committed["w-dead"].add(position_of(x)[:2])
        dead.settled(x)  # position 2 stays in flight: the process is killed here
    del dead
    first = [position_of(live.next_group())[:2] for _ in range(4)]  # block 1: [4, 8)
    elapse(clock, TTL, live.claims)
    later = []
    for _ in range(4):
        h = live.next_group()
        later.append(position_of(h)[:2])
        live.settled(h)
    assert first == [(0, 4), (0, 5), (0, 6), (0, 7)]
    assert later[:2] == [(0, 2), (0, 3)]  # the dead writer's unfinished rest, not its committed 0 and 1
    assert later[2:] == [(0, 8), (0, 9)]
    assert record(store, 0)["done"] is True and record(store, 0)["previous"][0]["writer"] == "w-dead"
    assert h.group_id.endswith("-p1")


def test_a_recycled_position_keeps_its_block_open_until_the_retry_settles(store):
    ds = source(store, "trainer", block=2)
    g0, g1 = ds.next_group(), ds.next_group()
    ds.settled(g1)
    ds.recycle(g0)  # rejected at put
    assert record(store, 0)["done"] is False
    again = ds.next_group()
    assert position_of(again) == (0, 0, 1) and again.group_id == "e0-p0-a1-trainer"
    ds.settled(again)
    assert record(store, 0)["done"] is True


def test_a_retry_of_a_committed_group_is_served_even_after_its_block_finished(store):
    """A committed group rejected later as stale comes back through recycle: no other writer would
    generate it (its position is committed), so this source retries it."""
    ds = source(store, "trainer", block=2)
    g0, g1 = ds.next_group(), ds.next_group()
    ds.settled(g0), ds.settled(g1)
    assert record(store, 0)["done"] is True
    ds.recycle(g0)
    assert ds.next_group().group_id == "e0-p0-a1-trainer"


def test_a_put_rejected_retry_of_a_lost_block_is_left_to_its_taker(store, clock):
    committed: dict[str, set] = {}
    a = source(store, "trainer", writer="w-a", block=4, ttl=TTL, committed=committed)
    b = source(store, "p1", writer="w-b", block=4, ttl=TTL, committed=committed)
    g0, g1 = a.next_group(), a.next_group()
    committed["w-a"] = {(0, 1)}
    a.settled(g1)
    a.recycle(g0)  # rejected at put; a stops renewing (stalled)
    assert position_of(b.next_group())[:2] == (0, 4)  # b starts watching block 0
    elapse(clock, TTL, b.claims)
    assert position_of(a.next_group()) == (0, 8, 0)  # fenced: not the retry of 0, and block 0 is left
    got = [position_of(b.next_group())[:2] for _ in range(6)]
    assert got == [(0, 5), (0, 6), (0, 7), (0, 0), (0, 2), (0, 3)]  # b took block 0 over: 0, not the committed 1


def test_a_restarted_source_serves_its_unsettled_positions_again_and_nothing_twice(store):
    """Positions 0..2 served before the checkpoint (0 committed and since consumed, so not in the
    buffer's committed set; 1 and 2 in flight); after it 2 commits, 3 and 4 are served and 4 commits;
    then the process dies. The next segment serves 1, 3, then 5.. and never 0, 2 or 4."""
    committed: dict[str, set] = {"w1": set()}
    a = source(store, "trainer", writer="w1", block=4, shuffle=False, committed=committed)
    g = [a.next_group() for _ in range(3)]
    committed["w1"].add((0, 0))
    a.settled(g[0])
    checkpoint = json.loads(json.dumps(a.state()))
    committed["w1"].add((0, 2))
    a.settled(g[2])
    a.next_group()
    g4 = a.next_group()
    committed["w1"].add((0, 4))
    a.settled(g4)
    committed["w1"].discard((0, 0))  # consumed and deleted (--buffer-delete-consumed-objects)

    b = source(store, "trainer", writer="w2", block=4, shuffle=False, committed=committed)
    report = b.restore(checkpoint, committed={(0, 2, 0), (0, 4, 0)})
    assert (report.committed_outstanding, report.reserved_outstanding, report.committed_beyond_checkpoint) == (1, 1, 1)
    served = []
    for _ in range(6):
        x = b.next_group()
        served.append(position_of(x)[:2])
        b.settled(x)
    assert served == [(0, 1), (0, 3), (0, 5), (0, 6), (0, 7), (0, 8)]
    assert record(store, 0)["done"] and record(store, 1)["done"] and record(store, 0)["writer"] == "w2"


def test_a_checkpoint_resumes_only_in_its_own_mode(store):
    plain = DataSource(rows(), 2)
    with pytest.raises(DataSourceError, match="saved without --allow-rollout-producers"):
        source(store, "trainer").restore(plain.state())
    with pytest.raises(DataSourceError, match="without the flag is not supported"):
        plain.restore(source(store, "p1").state())
    assert "claims" not in plain.state()
    with pytest.raises(DataSourceError, match="only used with prompt claims"):
        DataSource(rows(), 2, committed_by=lambda w: set())


def test_committed_positions_reads_a_writers_objects_and_skips_undecodable_ones(store, caplog):
    ds = DataSource(rows(), 2, shuffle=False)
    groups = [ds.next_group() for _ in range(3)]
    for s in (s for g in groups for s in g.samples):  # as generated and scored
        s.response_ids, s.response_logprobs, s.loss_mask, s.token_versions = [3], [-0.1], [1], [1]
        s.reward, s.status, s.finish_reason = 1.0, SampleStatus.COMPLETED, "stop"
    store.put_bytes(group_key("w1", 1), groups_to_ipc(groups[:2]))
    store.put_bytes(group_key("w1", 2), b"garbage")
    store.put_bytes(group_key("w2", 1), groups_to_ipc(groups[2:]))
    with caplog.at_level(logging.WARNING):
        assert committed_positions(store, "w1") == {(0, 0), (0, 1)}
    assert "skipping buffer/groups/w1/000000000002.arrow" in caplog.text
    assert committed_positions(store, "nobody") == set()
