"""How long the tests wait, by name, and the one way they wait for a condition.

A test waits on a condition, never on a fixed sleep: `wait_until(condition, timeout, what)` polls the
condition and fails with `what` when the bound passes (`await_until` in a coroutine). A fixed sleep is
left only where the sleep is the behaviour under test (a service that never answers, a slow reward) or
where a negative check has no condition to wait on (its comment says why).

Every bound a test passes as `timeout`/`timeout_s`/`timeout_seconds` is a named constant, here when
several modules share its meaning, or in the module with a comment when it is specific to that test
(tests/unit/test_test_waits.py holds that). The values are what the tests used when they were named.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

# ---- whole runs in a subprocess ---------------------------------------------------------------
RUN_SECONDS = 600  # a whole tiny-preset run (one segment, CPU engine) in a subprocess, start to finish
SLOW_RUN_SECONDS = 900  # a whole run that does more: a resumed lineage, a workflow of segments, an elastic bench
LONG_RUN_SECONDS = 1200  # a whole run over several ranks, or a build and run of the GPU pins
MULTI_NODE_RUN_SECONDS = 1500  # a whole run over two nodes or on a real model

# ---- shorter subprocesses --------------------------------------------------------------------
COMMAND_SECONDS = 120  # a short subprocess: a `miles` CLI command, a probe interpreter, a node command
SLOW_COMMAND_SECONDS = 300  # a subprocess that imports the whole stack first: a fresh interpreter, a quick bench
RANKS_SECONDS = 300  # forked ranks of a multi-process (gloo) test, all of them to their end

# ---- services and actors ---------------------------------------------------------------------
ENGINE_START_SECONDS = 120  # a CPU engine server's start: spawn, load the checkpoint, answer /health
RAY_CALL_SECONDS = 120  # one Ray actor call (`ray.get` of its reply)
HTTP_SECONDS = 5  # one HTTP call to a local server that is up
PROBE_SECONDS = 2  # one HTTP probe of a server that may not be up yet (the caller retries)

# ---- conditions inside a test ----------------------------------------------------------------
WAIT_SECONDS = 60  # a condition the test just caused: a restart, a queue item, a thread's end
POLL_SECONDS = 0.2  # how often `wait_until` looks at its condition


def wait_until(condition: Callable[[], Any], timeout: float, what: str, *, interval: float = POLL_SECONDS,
               check: Callable[[], None] | None = None, details: Callable[[], str] | None = None) -> Any:
    """Poll `condition` until it returns something true, and return that. Fail (AssertionError naming
    `what`, with `details()` appended) if `timeout` seconds pass first. `check`, called before each
    look, raises to end the wait early (e.g. the process that should get there has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        got = condition()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {what} within {timeout} s" + (f":\n{details()}" if details else ""))
        time.sleep(interval)


async def await_until(condition: Callable[[], Any], timeout: float, what: str, *,
                      interval: float = POLL_SECONDS) -> Any:
    """`wait_until` in a coroutine: `condition` may be a plain function or return an awaitable, and the
    event loop runs between looks."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        await asyncio.sleep(interval)
