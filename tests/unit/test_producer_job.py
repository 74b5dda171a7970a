"""When a producer job may join a run and when it stops by itself (miles_core.elastic.job), without Ray.

Guards: a producer joining a run that does not allow producers (it would generate into a buffer nobody
reads), a producer that never stops after its run finished, failed or dropped producers, two live
producers under one id (they would take each other's prompt claims)."""

from __future__ import annotations

import pytest

from miles_core.config import parse_flags
from miles_core.elastic import heartbeat as H
from miles_core.elastic.job import ProducerError, joined_config, run_ended, run_producer
from miles_core.storage import Store
from miles_core.storage.run_root import FAILED, FINISHED, RUNNING, write_config, write_status


@pytest.fixture
def run(tmp_path):
    store = Store(f"file://{tmp_path}/runs/r")
    write_config(store, parse_flags(["--preset", "tiny-reverse4", "--allow-rollout-producers"]), 0)
    write_status(store, RUNNING, last_step=3, segment=0)
    return store


def test_a_run_without_producers_is_refused_by_name(tmp_path):
    store = Store(f"file://{tmp_path}/runs/r")
    with pytest.raises(ValueError, match="no run at"):
        run_producer(store.uri())
    write_config(store, parse_flags(["--preset", "tiny-reverse4"]), 0)
    with pytest.raises(ProducerError, match="--allow-rollout-producers"):
        joined_config(store)


def test_the_producer_stops_when_the_run_ends_or_drops_producers(run):
    assert joined_config(run).buffer.allow_rollout_producers and run_ended(run) == ""
    write_status(run, FINISHED, last_step=9, segment=0)
    assert run_ended(run) == "the run finished"
    write_status(run, FAILED, last_step=9, segment=0)
    assert run_ended(run) == "the run failed"
    write_status(run, RUNNING, last_step=9, segment=1)
    write_config(run, parse_flags(["--preset", "tiny-reverse4"]), 1)  # the next segment continues without producers
    assert "does not allow producers" in run_ended(run)


def test_a_live_producer_id_is_not_taken_twice(run):
    import threading

    from miles_core.elastic.job import ProducerJob

    job = ProducerJob(joined_config(run), run, 1, "spot-a", 1800.0, threading.Event())
    live = threading.Event()

    def beat():  # another producer under this id, alive: its heartbeat keeps changing
        while not live.wait(0.05):
            H.write_heartbeat(run, H.Heartbeat.start("spot-a", "w-other"))

    H.write_heartbeat(run, H.Heartbeat.start("spot-a", "w-old"))
    job._check_id_free(wait_seconds=0.3)  # a killed producer's id (its heartbeat does not move) is free
    threading.Thread(target=beat, daemon=True).start()
    try:
        with pytest.raises(ProducerError, match="'spot-a' is in use by a live producer"):
            job._check_id_free(wait_seconds=0.3)
    finally:
        live.set()
    H.write_heartbeat(run, H.Heartbeat.start("spot-a", "w-old").update(state=H.STOPPED))
    job._check_id_free(wait_seconds=0.3)  # a stopped producer's id may be used again
    with pytest.raises(ProducerError, match="run's own rollout"):
        run_producer(run.uri(), producer_id="trainer")


def test_lost_engines_end_the_job_with_a_retried_failure_and_release_its_claims(run, monkeypatch):
    """Pins: when the fleet reports an engine whose actor is gone (a spot node preempted while the head
    survives), the job stops with EnginesLost (an infrastructure failure: Flyte retries the task), its
    claims are released and its engines shut down. Guards: a zombie producer renewing heartbeats and
    claims for ever while nothing generates its claimed prompts."""
    import asyncio
    import threading

    from miles_core.elastic import job as J
    from miles_core.engines.launcher import EnginesLost
    from miles_core.failures import is_infrastructure

    calls = []

    class Fleet:
        members = ["engine-0", "engine-1"]

        def __init__(self):
            self.checks = 0

        def lost(self):
            self.checks += 1
            return [] if self.checks < 2 else [type("M", (), {"name": "spot-a-engine-1"})()]

        def shutdown(self):
            calls.append("fleet shutdown")

    class Producer:
        error, in_flight_groups, tokens_total = None, 0, 0

        def start(self):
            calls.append("producer start")

        def wake(self):
            pass

        async def stop(self, grace_seconds):
            calls.append("producer stop")

    class Claims:
        def release(self):
            calls.append("claims released")

    class Renewer:
        def __init__(self, claims):
            pass

        def start(self):
            return self

        def stop(self):
            calls.append("renewer stop")

    job = J.ProducerJob(joined_config(run), run, 2, "spot-a", 1800.0, threading.Event())

    async def joined():
        job.fleet, job.producer, job.claims = Fleet(), Producer(), Claims()
        return ""

    async def nothing():
        return ""

    monkeypatch.setattr(job, "_join", joined)
    monkeypatch.setattr(job, "_poll", nothing)
    monkeypatch.setattr(job, "_follow_weights", lambda: asyncio.sleep(0))
    monkeypatch.setattr(J, "ClaimRenewer", Renewer)
    monkeypatch.setattr(J, "HEARTBEAT_SECONDS", 0.0)
    with pytest.raises(EnginesLost, match="1 of 2 engine.*spot-a-engine-1") as lost:
        asyncio.run(job.run())
    assert is_infrastructure(lost.value)
    assert calls == ["producer start", "producer stop", "renewer stop", "claims released", "fleet shutdown"]
    assert H.read_heartbeat(run, "spot-a").state == H.STOPPED


def test_sigterm_stops_the_job_with_a_short_grace_and_releases_its_claims(run, monkeypatch):
    """Pins: SIGTERM (an eviction, a spot preemption notice) sets the job's stop with SIGTERM_GRACE_SECONDS
    for its in-flight groups; the job then stops its producer with that grace and releases its claims;
    the previous SIGTERM handler is back afterwards. Guards: a preempted producer whose claimed prompts
    wait a whole claim TTL before another writer may generate them."""
    import asyncio
    import os
    import signal
    import threading
    import time

    from miles_core.elastic import job as J

    stopped = threading.Event()
    job = J.ProducerJob(joined_config(run), run, 1, "spot-b", 1800.0, stopped)
    before = signal.getsignal(signal.SIGTERM)
    with J.stop_on_sigterm(stopped, job):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.wait(5)
    assert signal.getsignal(signal.SIGTERM) is before
    assert job.stop_grace_seconds == J.SIGTERM_GRACE_SECONDS < J.STOP_GRACE_SECONDS

    calls = []

    class Producer:
        error, in_flight_groups, tokens_total = None, 0, 0

        def start(self):
            pass

        async def stop(self, grace_seconds):
            calls.append(("producer stop", grace_seconds))

    class Claims:
        def release(self):
            calls.append(("claims released", round(time.monotonic() - t0)))

    async def joined():
        job.producer, job.claims = Producer(), Claims()
        return ""

    monkeypatch.setattr(job, "_join", joined)
    monkeypatch.setattr(J, "ClaimRenewer", lambda claims: type("R", (), {"start": lambda s: s, "stop": lambda s: None})())
    t0 = time.monotonic()
    result = asyncio.run(job.run())
    assert result.stop_reason == "asked to stop"
    assert calls == [("producer stop", J.SIGTERM_GRACE_SECONDS), ("claims released", 0)]


def test_new_weights_are_downloaded_and_staged_before_the_engines_pause(run):
    """Pins: a producer following the feed has every engine stage the new version (its download and the
    server's read) while generating, then pauses, loads (a swap) and resumes. Guards: engines paused for
    a whole download of the model from object storage at every version."""
    import asyncio
    import threading

    from miles_core.elastic import job as J
    from miles_core.rollout.feed_record import Feed

    calls = []

    class Fleet:
        def stage_weights(self, uri):
            calls.append(("stage", uri))

        def load_weights(self, uri, version):
            calls.append(("load", uri, version))

    class Engine:
        async def pause_generation(self, mode):
            calls.append(("pause",))

        async def continue_generation(self):
            calls.append(("resume",))

    class Producer:
        def set_version(self, v):
            calls.append(("version", v))

    job = J.ProducerJob(joined_config(run), run, 1, "spot-c", 1800.0, threading.Event())
    job.fleet, job.engine, job.producer, job.version = Fleet(), Engine(), Producer(), 3
    job.feed = Feed(version=4, weights="file:///w/v4", step=3, segment=0, queue_size=0, capacity=8, consumed_groups=0,
                    groups_per_version=1, max_weight_staleness=None, first_version=0, written_at=0.0)
    asyncio.run(job._follow_weights())
    assert calls == [("stage", "file:///w/v4"), ("pause",), ("load", "file:///w/v4", 4), ("resume",), ("version", 4)]


def test_engines_that_do_not_fit_or_would_be_exposed_without_a_token_are_refused_before_they_start(run, monkeypatch):
    """Pins: the producer checks its engines against its cluster before starting any (too many for its
    GPUs: refused naming both) and applies the trainer's API token rule (engines bound beyond loopback on
    a multi-node cluster need MILES_ENGINE_API_KEY). Guards: a producer waiting for ever for room, or
    serving unauthenticated engines on the pod network."""
    import threading

    from miles_core.config import ConfigError
    from miles_core.driver import placement
    from miles_core.elastic import job as J
    from miles_core.prepare.resources import ClusterShape, Node

    started = []

    class Fleet:
        def __init__(self, spec, n, **kwargs):
            self.n = n

        def start(self):
            started.append(self.n)
            return self

    monkeypatch.setattr(J, "EngineFleet", Fleet)
    monkeypatch.delenv("MILES_ENGINE_API_KEY", raising=False)
    job = J.ProducerJob(joined_config(run), run, 3, "spot-d", 1800.0, threading.Event())
    feed = type("F", (), {"weights": "file:///w/v0", "version": 0})()
    monkeypatch.setattr(placement, "cluster_shape", lambda: ClusterShape((Node("this machine", 2, 0),), "its Ray instance"))
    with pytest.raises(ConfigError, match="the producer's engines do not fit its Ray instance"):
        job._start_fleet(feed)
    two = ClusterShape((Node("head", 8, 0), Node("worker", 8, 0)), "its Ray cluster")
    monkeypatch.setattr(placement, "cluster_shape", lambda: two)
    with pytest.raises(ConfigError, match="MILES_ENGINE_API_KEY"):
        job._start_fleet(feed)
    assert started == []
    monkeypatch.setenv("MILES_ENGINE_API_KEY", "k" * 32)
    job._start_fleet(feed)
    assert started == [3]
