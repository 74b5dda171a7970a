"""How the driver reaches the rollout side: one interface, a Ray actor or an in-process manager.

Every method returns a `concurrent.futures.Future`-like object with `.result()`; the driver
blocks on it where the loop needs the value and keeps it where it prefetches (the next batch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any


class RayFuture:
    def __init__(self, ref):
        self.ref = ref

    def result(self, timeout: float | None = None):
        import ray

        return ray.get(self.ref, timeout=timeout)

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)


class RayActorHandle:
    """A Ray actor (the rollout manager, the trainer worker)."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, method: str, *args) -> RayFuture:
        return RayFuture(getattr(self.actor, method).remote(*args))


class LocalHandle:
    """An object in this process (a RolloutManager, a trainer stand-in), its calls on one
    event-loop thread (benchmarks, tests)."""

    def __init__(self, manager: Any):
        self.manager = manager
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self.thread.start()

    def call(self, method: str, *args) -> concurrent.futures.Future:
        fn = getattr(self.manager, method)

        async def run():
            out = fn(*args)
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
