"""Stopping a `pyflyte run` launched by a test or a bench together with everything it started.

    kill_everything_under(ray_tmp, proc)                     # SIGKILL at once
    kill_everything_under(ray_tmp, proc, grace_seconds=15)   # SIGTERM, then SIGKILL what is left

The run's process and its descendants, and every process of its private Ray instance (whose command
line names `ray_tmp`, its RAY_TMPDIR) with their descendants: Ray's agents rename themselves and no
longer name the directory, but they are children of its raylet. The tree is collected before any
signal: a child whose parent died is no longer found under it.
"""

from __future__ import annotations

import signal
import subprocess

import psutil


def _tree(ray_tmp: str, proc: subprocess.Popen) -> list:
    found = [p for p in psutil.process_iter(["cmdline"]) if ray_tmp in " ".join(p.info["cmdline"] or [])]
    try:
        found.append(psutil.Process(proc.pid))
    except psutil.NoSuchProcess:
        pass
    for p in list(found):
        try:
            found += p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return found


def kill_everything_under(ray_tmp: str, proc: subprocess.Popen, grace_seconds: float = 0.0) -> None:
    victims = _tree(ray_tmp, proc)
    signals = (signal.SIGTERM, signal.SIGKILL) if grace_seconds > 0 else (signal.SIGKILL,)
    for sig in signals:
        for p in victims:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        try:
            proc.wait(grace_seconds if sig == signal.SIGTERM else 30)
        except subprocess.TimeoutExpired:
            if sig == signal.SIGKILL:
                raise
