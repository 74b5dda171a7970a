"""The producer and the rollout manager while the engine fleet changes (a fleet of 0 engines included).

Pins: with no engine the producer starts no group (no request waits on an engine that is not there)
and starts as soon as one joins; when the last engine leaves it stops starting groups again, and the
groups in flight finish. A rollout manager built without URLs is such a producer, and
`set_engine_urls` is what lets it go.
"""

from __future__ import annotations

import asyncio

from miles_core.config import parse_flags
from miles_core.rollout.manager import RolloutManager
from tests.unit.test_producer import MemoryBuffer, ScriptedEngine, rig, rows, run, settle, until


def test_no_engine_no_group_until_one_joins():
    async def main():
        eng = ScriptedEngine()
        r = rig(eng)
        r.producer.set_engines_available(False)
        r.producer.start()
        await settle(0.1)
        assert eng.calls == [] and r.producer.in_flight_groups == 0 and r.admission.started_groups == 0
        r.producer.set_engines_available(True)
        await eng.wait_calls(4)  # budget 2 groups x n=2
        r.producer.set_engines_available(False)  # the last engine leaves
        for c in list(eng.calls):
            eng.finish(c)
        await until(lambda: r.producer.in_flight_groups == 0 and len(r.buffer.queue) == 2)  # rewards run on threads
        await settle(0.1)  # a group started after the fleet emptied would have called by now
        assert len(eng.calls) == 4 and r.producer.in_flight_groups == 0 and len(r.buffer.queue) == 2
        await r.producer.stop(grace_seconds=1)

    run(main())


def test_a_manager_without_urls_waits_for_set_engine_urls(tmp_path):
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", str(tmp_path), "--rollout-num-engines", "0", "--allow-rollout-producers"])

    async def main():
        mgr = RolloutManager(cfg, engine_urls=[], rows=rows(), buffer_factory=lambda handler: MemoryBuffer(),
                             consumed_through_step=-1)
        assert mgr.producer.engines_available is False and mgr.engine_in_flight() == {}
        await mgr.set_engine_urls(["http://127.0.0.1:9"])
        assert mgr.producer.engines_available is True and mgr.engine.urls == ["http://127.0.0.1:9"]
        assert mgr.engine_in_flight() == {"http://127.0.0.1:9": 0} and mgr.engine_served_versions() == {}
        await mgr.set_engine_urls([])
        assert mgr.producer.engines_available is False
        await asyncio.wait_for(mgr.engine.close(), 5)

    run(main())
