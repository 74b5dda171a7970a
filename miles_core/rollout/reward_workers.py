"""Where reward code runs: never on the caller's event loop.

The rollout actor's loop submits new groups and commits finished ones; a reward function (user
code) or a tokenizer decode that blocks it would stall both. So `RewardWorkers.call(fn, make_args)`
runs `make_args()` (decoding) and a sync `fn` on a bounded thread pool, and the coroutine of an
`async def` fn on an event-loop thread of its own.

Async rewards share one loop thread while it is responsive (so a client a reward keeps across
calls stays on one loop). A coroutine that blocks (time.sleep, sync I/O) stalls only its loop:
its heartbeat stops, and calls it has not started yet, and new ones, go to another loop thread
(started on demand, at most `max_loops`), so other groups keep being scored and committed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.05
STALLED_SECONDS = 0.25  # a loop whose heartbeat is older than this is blocked: skip it


class RewardWorkers:
    """A thread pool for sync code and event-loop threads for coroutines; see the module docstring."""

    def __init__(self, threads: int = 8, max_loops: int = 4):
        if threads < 1 or max_loops < 1:
            raise ValueError(f"threads={threads} and max_loops={max_loops} must be >= 1")
        self._threads, self._max_loops = threads, max_loops
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._loops: list[LoopThread] = []
        self._pending: collections.deque[_Call] = collections.deque()  # async calls no loop has taken
        self._lock = threading.Lock()
        self._closed = False

    async def call(self, fn: Callable, make_args: Callable[[], tuple]) -> Any:
        """`fn(*make_args())`, awaited without blocking the caller's loop."""
        submitted = self._executor().submit(lambda: fn(*make_args()))
        try:
            result = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:  # an async fn's coroutine, made meanwhile, is never run
            submitted.add_done_callback(_close_result)
            raise
        if inspect.isawaitable(result):
            result = await self._run_async(result)
        return result

    async def _run_async(self, awaitable) -> Any:
        c = _Call(awaitable)
        with self._lock:
            self._check_open()
            self._pending.append(c)
        self._dispatch()
        fut = asyncio.wrap_future(c.future)
        try:
            while not (await asyncio.wait({fut}, timeout=STALLED_SECONDS))[0]:
                if not c.taken:  # its loop is blocked: hand the queue to a responsive one
                    self._dispatch()
        except asyncio.CancelledError:
            fut.cancel()  # nobody will read its outcome
            c.cancel()
            raise
        return fut.result()

    def _dispatch(self) -> None:
        with self._lock:
            if self._closed:
                return
            lt = next((lt for lt in self._loops if lt.responsive()), None)
            if lt is None and len(self._loops) < self._max_loops:
                if self._loops:
                    log.warning("async reward loop blocked for > %.2f s (a coroutine calling blocking code?); "
                                "starting reward loop %d of at most %d", STALLED_SECONDS, len(self._loops) + 1,
                                self._max_loops)
                lt = LoopThread(f"reward-loop-{len(self._loops)}", self._take)
                self._loops.append(lt)
        if lt is not None:
            lt.poke()

    def _take(self) -> "_Call | None":
        """The oldest pending call, for the loop thread that pulls it (called on that thread)."""
        with self._lock:
            c = self._pending.popleft() if self._pending else None
        if c is not None:
            c.taken = True
        return c

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="reward")
            return self._pool

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the reward workers are closed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the pool and the loop threads (a running reward is abandoned after `timeout`,
        seconds for all loops together). Idempotent; `call` raises afterwards."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            loops, self._loops = self._loops, []
            pending = list(self._pending)
            self._pending.clear()
        for c in pending:
            c.abandon(RuntimeError("the reward workers were closed before this async reward started"))
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for lt in loops:
            lt.stop(max(0.0, deadline - time.monotonic()))


class _Call:
    """One async reward call: the awaitable, the (thread-safe) future of its result, and the task
    running it once a loop thread has taken it."""

    def __init__(self, awaitable):
        self.awaitable = awaitable
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.taken = False
        self.task: asyncio.Task | None = None
        self.cancel_requested = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`'s thread: run the awaitable as a task of it."""
        if self.cancel_requested or not self.future.set_running_or_notify_cancel():
            _close(self.awaitable)
            return
        self.task = loop.create_task(_awaited(self.awaitable))
        self.task.add_done_callback(self._settle)
        if self.cancel_requested:  # the caller gave up while the task was being created
            self.task.cancel()

    def _settle(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.future.set_exception(RuntimeError("the async reward was cancelled (the reward workers closed)"))
        elif task.exception() is not None:
            self.future.set_exception(task.exception())
        else:
            self.future.set_result(task.result())

    def cancel(self) -> None:
        """From the caller's thread: the caller no longer waits; stop the call wherever it is."""
        self.cancel_requested = True
        task = self.task
        if task is not None:
            try:
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is closed: the task is gone already
                pass

    def abandon(self, error: BaseException) -> None:
        """A call no loop will start: fail it."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)
        _close(self.awaitable)


class LoopThread:
    """An event loop running forever on a daemon thread. `poke()` makes it start the pending calls
    (`take()`, one at a time); a heartbeat tells whether it is blocked."""

    def __init__(self, name: str, take: Callable[[], "_Call | None"]):
        self.loop = asyncio.new_event_loop()
        self.last_tick = time.monotonic()
        self._take = take
        self._pulling = False  # a _start_pending chain is scheduled (touched on the loop thread only)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._tick)
        try:
            self.loop.run_forever()
        finally:
            self._cancel_all()
            self.loop.close()

    def _tick(self) -> None:
        self.last_tick = time.monotonic()
        self.loop.call_later(HEARTBEAT_SECONDS, self._tick)

    def responsive(self) -> bool:
        return time.monotonic() - self.last_tick < STALLED_SECONDS

    def poke(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._on_poke)
        except RuntimeError:  # closed: the next dispatch picks another loop
            pass

    def _on_poke(self) -> None:
        if not self._pulling:
            self._pulling = True
            self._start_pending()

    def _start_pending(self) -> None:
        """Start one pending call, then look again after its first step (one chain per loop): a
        call is taken only when this loop is free to run it, so none waits behind a blocking one."""
        c = self._take()
        if c is None:
            self._pulling = False
            return
        c.start(self.loop)
        self.loop.call_soon(self._start_pending)

    def _cancel_all(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for t in tasks:
            t.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def stop(self, timeout: float) -> None:
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            return
        if threading.current_thread() is not self._thread:  # a finalizer may run on any thread
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s still busy after close (a blocking async reward?); abandoned", self._thread.name)


def _close_result(f: concurrent.futures.Future) -> None:
    if not f.cancelled() and f.exception() is None:
        _close(f.result())


def _close(awaitable) -> None:
    if inspect.iscoroutine(awaitable):
        awaitable.close()  # a coroutine never started: no "never awaited" warning


async def _awaited(awaitable):
    return await awaitable
