"""One segment of a real run as the chaos and fault tests drive it: `run_training` in a subprocess.

Like tests/e2e/test_crash_resume.py (no pyflyte: the driver, its private local Ray under its own
short RAY_TMPDIR, the actors and the CPU engine server), with what a fault test needs on top: wait
for a condition, find the run's own processes (by its RAY_TMPDIR or as the driver's descendants,
never anyone else's), SIGKILL them all, and report what is left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil

from tests.support.processes import kill_everything_under
from tests.support.timeouts import wait_until

ROOT = Path(__file__).resolve().parents[2]
# The segment as a Flyte task runs it, minus flytekit: an infrastructure failure exits 75 ("retry me").
SCRIPT = """import sys
from miles_core.config import parse_flags
from miles_core.driver.segment import run_training
from miles_core.failures import is_infrastructure
try:
    run_training(parse_flags(["--preset", "tiny-reverse4", *sys.argv[1:]]))
except Exception as e:
    import traceback
    traceback.print_exc()
    print(f"SEGMENT FAILED recoverable={is_infrastructure(e)}: {type(e).__name__}", flush=True)
    sys.exit(75 if is_infrastructure(e) else 1)
"""
RECOVERABLE = 75
KILLED_GONE_SECONDS = 0.5  # SIGKILLed processes leave the process table within this; what is left after it survived


class Segment:
    """A running segment: `wait_for`, `descendants`, `kill`, `finish`; always `close` it (kills what is left)."""

    def __init__(self, flags: list[str], log: Path, env: dict | None = None):
        self.ray_tmp = tempfile.mkdtemp(prefix="mc", dir="/tmp")  # short: Ray's unix sockets live under it
        self.log = log
        env = dict(os.environ if env is None else env, RAY_TMPDIR=self.ray_tmp, PYTHONUNBUFFERED="1")
        self.started = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *flags], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll `condition` until true (returns the seconds since start); fail if the segment ends first."""
        def running() -> None:
            assert self.proc.poll() is None, f"segment ended ({self.proc.returncode}) before {what}:\n{self.text()[-4000:]}"

        wait_until(condition, timeout, what, check=running, details=lambda: self.text()[-4000:])
        return time.monotonic() - self.started

    def descendants(self, cmdline_has: str) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            try:
                if cmdline_has in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill(self) -> None:
        kill_everything_under(self.ray_tmp, self.proc)

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"segment still running after {timeout} s:\n{self.text()[-4000:]}")

    def close(self) -> list[str]:
        """Kill whatever of this segment is still running; the command lines of processes that survived."""
        if self.proc.poll() is None:
            self.kill()
        try:
            wait_until(lambda: not orphans(self.ray_tmp), KILLED_GONE_SECONDS, "end of the killed processes")
        except AssertionError:
            pass  # the survivors are the answer: returned below
        left = orphans(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return left


def orphans(*marks: str) -> list[str]:
    """Command lines of live processes (not this one) that name any of `marks` (a run's RAY_TMPDIR, its root)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE and any(m in cmd for m in marks):
            left.append(cmd[:200])
    return left
