"""The submission budget and staleness admission as pure bookkeeping (docs/fully-async.md)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.rollout.admission import StalenessAdmission, SubmissionBudget


def test_sample_granularity_counts_credits_and_admits_after_n_finish():
    """Pins §5.2 sample granularity: +n per group, -1 per finished sample, and a new group fits
    once n credits are back (not when whole groups finish)."""
    b = SubmissionBudget(budget_groups=2, n_samples_per_prompt=3, granularity="sample")
    t1, t2 = b.try_acquire(), b.try_acquire()
    assert b.used == 6 and b.try_acquire() is None
    t1.sample_done()
    t2.sample_done()
    assert not b.can_acquire()  # 4 in flight + 3 > 6
    t2.sample_done()
    assert b.can_acquire()  # 3 in flight: one more group fits although no group has finished
    t3 = b.try_acquire()
    assert b.used == 6
    for t in (t1, t2, t3):
        t.release()
    assert b.used == 0


def test_group_granularity_holds_a_slot_per_group_until_release():
    """Pins §5.2 group granularity: finished samples free nothing; the slot comes back at release."""
    b = SubmissionBudget(budget_groups=2, n_samples_per_prompt=3, granularity="group")
    t1, t2 = b.try_acquire(), b.try_acquire()
    for _ in range(3):
        t1.sample_done()
    assert not b.can_acquire()
    t1.release()
    assert b.can_acquire() and b.used == 1
    t2.release()


def test_release_is_idempotent_and_never_over_releases():
    """Guards double release (an exception path after a normal release) inflating the budget."""
    b = SubmissionBudget(1, 2, "sample")
    t = b.try_acquire()
    t.sample_done()
    t.release()
    t.release()
    t.sample_done()
    assert b.used == 0 and t.released
    assert b.try_acquire() is not None and b.used == 2


def test_acquire_waits_until_capacity_comes_back():
    """Pins the async acquire: it blocks while full and wakes on release (and tells listeners)."""

    async def main():
        b = SubmissionBudget(1, 1, "group")
        woken = []
        b.listeners.append(lambda: woken.append(1))
        t1 = await b.acquire()
        waiter = asyncio.ensure_future(b.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        t1.release()
        t2 = await asyncio.wait_for(waiter, 1)
        assert woken and b.used == 1
        t2.release()

    asyncio.run(main())


def test_bad_budget_arguments_are_refused():
    with pytest.raises(ValueError, match="granularity"):
        SubmissionBudget(1, 1, "batch")
    with pytest.raises(ValueError):
        SubmissionBudget(0, 1, "group")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["group", "sample"]), st.integers(1, 3), st.integers(1, 4),
       st.lists(st.tuples(st.sampled_from(["acquire", "done", "release"]), st.integers(0, 9)), max_size=60))
def test_credits_are_conserved_under_any_interleaving(granularity, budget_groups, n, ops):
    """Property: whatever order groups acquire, finish samples and end (normally, by exception or
    cancellation: all end in release), the budget's usage equals what live tickets hold, never
    exceeds capacity, and returns to 0 when every ticket is released."""
    b = SubmissionBudget(budget_groups, n, granularity)
    tickets = []
    for op, i in ops:
        if op == "acquire":
            t = b.try_acquire()
            if t is not None:
                tickets.append(t)
        elif tickets:
            t = tickets[i % len(tickets)]
            t.sample_done() if op == "done" else t.release()
        held = sum(t.samples_held if granularity == "sample" else int(t.slot_held) for t in tickets)
        assert b.used == held <= b.capacity
    for t in tickets:
        t.release()
    assert b.used == 0


def test_admission_rule_started_plus_one_within_s_plus_v_plus_one_batches():
    """Pins §5.3: a group may start only while started + 1 <= (S + v + 1) * B, v counted from the
    run's first version; rejected groups leave the count."""
    a = StalenessAdmission(max_staleness=1, groups_per_version=4, first_version=1)
    assert a.limit == 8
    for _ in range(8):
        assert a.can_admit()
        a.admit()
    assert not a.can_admit()
    a.rejected()
    assert a.can_admit()
    a.admit()
    a.set_version(2)
    assert a.limit == 12 and a.can_admit()
    a.set_version(1)  # versions never go back
    assert a.limit == 12


def test_admission_without_limit_still_counts():
    a = StalenessAdmission(None, 4, started_groups=10)
    assert a.limit is None and a.can_admit()
    a.admit()
    assert a.started_groups == 11
