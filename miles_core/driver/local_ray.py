"""A local Ray instance that starts on a loaded machine.

    start_local_ray(include_dashboard=False, ...)   # ray.init's arguments

Ray gives a new local node 30 s to register with its GCS (a constant in ray._private.node, not a
setting) and raises "The current node timed out during startup" when it takes longer, which happens
when several runs start at once on a machine with few cores. Then the processes that start left
behind (its GCS, raylet and their helpers, children of this process) are killed and the start is
tried again, up to `attempts` times. Any other failure is raised at once.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = "timed out during startup"
# Ray 2.60 turns token authentication on for every new local instance and says so on every run's
# console ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt
# out"): the default, nothing to act on. Setting RAY_AUTH_MODE=token here instead would not do: this
# process's Ray config is read before, and it would then refuse its own instance's token.
TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_DEFAULT_NOTICE = "Token authentication is enabled for this Ray cluster"


def _token_default_notice(record: logging.LogRecord) -> bool:
    return TOKEN_DEFAULT_NOTICE not in record.getMessage()


def start_local_ray(attempts: int = 3, **init_kwargs) -> None:
    import ray

    logging.getLogger(TOKEN_LOGGER).addFilter(_token_default_notice)
    for attempt in range(1, attempts + 1):
        before = _descendants(os.getpid())
        try:
            ray.init(**init_kwargs)
            return
        except Exception as e:  # noqa: BLE001 - only Ray's startup timeout is tried again
            if STARTUP_TIMEOUT not in str(e) or attempt == attempts:
                raise
            left = _descendants(os.getpid()) - before
            log.warning("local Ray did not start in time (attempt %d of %d: %s); stopping the %d process(es) "
                        "it left and starting again", attempt, attempts, e, len(left))
            ray.shutdown()
            _kill(left)


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc: the children of each, recursively)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _kill(pids: set[int], wait_seconds: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_seconds
    for pid in pids:  # reap our own children; others go to init
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] != 0:
                    break
            except ChildProcessError:
                break
            time.sleep(0.05)
