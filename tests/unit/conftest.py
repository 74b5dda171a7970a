"""The unit tier's rule, enforced: one process, no servers, no Ray, no subprocess.

Every test under tests/unit runs with these entry points refused: starting a process
(subprocess, multiprocessing, os.fork/spawn), starting or joining Ray, and listening on a socket.
A test that needs one of them belongs in tests/integration (or tests/e2e); the refusal names the rule
so the move is obvious. Storage on S3 is integration too: here `storage_root` is file:// only, and
tests/integration/test_unit_on_s3.py runs the same tests against the SeaweedFS server.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess

import pytest

# croniter (flytekit imports it) runs `file` on the interpreter at import (platform.architecture):
# a library's one-off probe, not the test's doing; imported here, before the rule applies.
import croniter  # noqa: E402,F401

RULE = "tests/unit is one process with no servers, no Ray and no subprocess (move this test to tests/integration)"


class UnitTierViolation(AssertionError):
    pass


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierViolation(f"{what}: {RULE}")

    return refused


def _patches(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(subprocess.Popen, "__init__", _refuse("subprocess.Popen"))
    mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing Process.start"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve"):
        if hasattr(os, name):
            mp.setattr(os, name, _refuse(f"os.{name}"))
    mp.setattr(socket.socket, "listen", _refuse("socket.listen (a server)"))
    import ray

    mp.setattr(ray, "init", _refuse("ray.init"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """The rule holds through setup, so module- and session-scoped fixtures a unit test uses are
    covered too (they are set up inside the first test that needs them)."""
    with pytest.MonkeyPatch.context() as mp:
        _patches(mp)
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with pytest.MonkeyPatch.context() as mp:
        _patches(mp)
        return (yield)


@pytest.fixture(params=["file"])
def storage_root(request, tmp_path):
    """A fresh storage root URI: file:// in the unit tier (the S3 runs are in tests/integration)."""
    return f"file://{tmp_path}/store"


@pytest.fixture(scope="session")
def seaweed():
    raise UnitTierViolation(f"the S3 server fixture: {RULE}")


@pytest.fixture(scope="session")
def s3_bucket():
    raise UnitTierViolation(f"the S3 bucket fixture: {RULE}")


@pytest.fixture(scope="module")
def ray_local():
    raise UnitTierViolation(f"a local Ray instance: {RULE}")
