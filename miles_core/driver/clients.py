"""How the driver reaches its roles: typed clients whose every method is a call in flight (`Pending`).

    rollout = RolloutClient.of_actor(actor)           # the rollout manager's Ray actor
    batch = board.wait(rollout.next_train_batch(version))   # miles_core.driver.switchboard: the driver's one wait

A method of a client names the method it calls (no method is ever named by a string) and returns a
`Pending[T]`: Ray refs (one per trainer rank, or the one actor's) or, for an object in this process
(`RolloutClient.in_process`: benchmarks and tests), a future of its event-loop thread. The trainer's
ranks are `miles_core.driver.placement.TrainerGroup`, a client of the same kind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

from miles_core.rank_batches import TrainBatch

T = TypeVar("T")


class Pending(Generic[T]):
    """A call in flight. `refs`: Ray object refs (all must finish; `result()` is the first one's value, or
    `combine` of all of them, and a ref that failed raises at once, whatever the others do); or `future`, a
    concurrent future."""

    def __init__(self, refs: Sequence[Any] = (), future: concurrent.futures.Future | None = None,
                 combine: Callable[[list], T] | None = None):
        self.refs, self.future, self.combine = list(refs), future, combine

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs) or any(_failed(r) for r in ready)

    def result(self, timeout: float | None = None) -> T:
        if self.future is not None:
            return self.future.result(timeout)
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in ready:  # one rank failed: its error, not a wait for the peers it leaves in a collective
            if _failed(ref):
                ray.get(ref)
        values = ray.get(self.refs, timeout=timeout)
        return values[0] if self.combine is None else self.combine(values)

    def unfinished(self) -> list:
        """What a wait on this call waits for."""
        if self.future is not None:
            return [] if self.future.done() else [self.future]
        import ray

        _, not_ready = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return not_ready


def _failed(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:  # noqa: BLE001 - any failure of a finished call
        return True


def wait_any(pendings: Sequence[Pending], timeout: float | None) -> None:
    """Until one of `pendings` finishes or `timeout` passes (None: no limit)."""
    refs: list = []
    futures: list[concurrent.futures.Future] = []
    for p in {id(p): p for p in pendings}.values():  # a call may be both waited for and tracked
        for w in p.unfinished():
            (futures if isinstance(w, concurrent.futures.Future) else refs).append(w)
    # After collecting, not before: a call that finished (or failed) before its look above is seen here; one
    # that finishes later is among what is waited for. Looked at first, one finishing in between was lost,
    # and the wait slept on the others (a rank's `alive` call: for ever).
    if any(p.done() for p in pendings):
        return
    if refs and not futures:
        import ray

        ray.wait(refs, num_returns=1, timeout=timeout)
    elif futures and not refs:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    elif refs:  # both kinds: only benchmarks mixing an in-process rollout side with Ray actors
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            if ray.wait(refs, num_returns=1, timeout=MIXED_WAIT_SLICE)[0] or any(f.done() for f in futures):
                return
    elif timeout:
        time.sleep(timeout)  # nothing to wait for but the time


MIXED_WAIT_SLICE = 0.05  # seconds per look at each kind when a wait holds Ray refs and local futures


class RolloutClient:
    """The rollout side (miles_core.rollout.manager.RolloutManager): its Ray actor, or one in this process."""

    def __init__(self, target: Any, submit: Callable[..., Pending], loop: asyncio.AbstractEventLoop | None = None,
                 thread: threading.Thread | None = None):
        self.target, self._submit, self._loop, self._thread = target, submit, loop, thread

    @classmethod
    def of_actor(cls, actor: Any) -> "RolloutClient":
        return cls(actor, lambda method, *args: Pending([method.remote(*args)]))

    @classmethod
    def in_process(cls, manager: Any) -> "RolloutClient":
        """A manager in this process, its calls on one event-loop thread of their own (`close()` stops it)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="rollout-loop", daemon=True)
        thread.start()

        def submit(method, *args) -> Pending:
            async def run():
                out = method(*args)
                return await out if asyncio.iscoroutine(out) else out

            return Pending(future=asyncio.run_coroutine_threadsafe(run(), loop))

        return cls(manager, submit, loop, thread)

    def close(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    # ---- the calls -------------------------------------------------------------------------------
    def start(self) -> Pending[None]:
        return self._submit(self.target.start)

    def stop(self, grace_seconds: float = 30.0) -> Pending[None]:
        return self._submit(self.target.stop, grace_seconds)

    def next_train_batch(self, version: int) -> Pending[TrainBatch | None]:
        """B groups for a step trained under `version`, as the trainer's DP parts by reference (None once the
        manager stops)."""
        return self._submit(self.target.next_train_batch, version)

    def set_version(self, version: int) -> Pending[None]:
        return self._submit(self.target.set_version, version)

    def deliver_weights(self, uri: str, version: int, engines: list[tuple[str, Any]]) -> Pending[dict[str, float]]:
        return self._submit(self.target.deliver_weights, uri, version, engines)

    def record_consumed(self, step: int, group_ids: list[str]) -> Pending[None]:
        return self._submit(self.target.record_consumed, step, group_ids)

    def state(self) -> Pending[dict]:
        return self._submit(self.target.state)

    def compact_buffer(self, step: int) -> Pending[None]:
        return self._submit(self.target.compact_buffer, step)

    def feed_state(self, version: int) -> Pending[dict]:
        return self._submit(self.target.feed_state, version)

    def set_engine_urls(self, urls: list[str]) -> Pending[None]:
        return self._submit(self.target.set_engine_urls, urls)

    def engine_in_flight(self) -> Pending[dict[str, int]]:
        return self._submit(self.target.engine_in_flight)

    def engine_served_versions(self) -> Pending[dict[str, dict[str, int]]]:
        return self._submit(self.target.engine_served_versions)

    def pause(self) -> Pending[None]:
        return self._submit(self.target.pause)

    def resume(self) -> Pending[None]:
        return self._submit(self.target.resume)
