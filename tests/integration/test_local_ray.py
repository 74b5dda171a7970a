"""Starting a local Ray instance on a loaded machine (miles_core.driver.local_ray): Ray's node has a fixed 30 s
to register, and a start that ran out of it is cleaned up and tried again; any other failure is raised.

`ray.init` is replaced by a stand-in that, like a real start that timed out, leaves a child process (a
stand-in "raylet") behind and raises Ray's own message.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import ray

from miles_core.driver import local_ray

TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed "
           "to startup or the GCS has become overloaded.")


class FlakyInit:
    def __init__(self, failures: int, error: str = TIMEOUT):
        self.failures, self.error = failures, error
        self.calls: list[dict] = []
        self.left: list[subprocess.Popen] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            self.left.append(subprocess.Popen(["sleep", "120"]))  # what the timed-out start left running
            raise Exception(self.error)


@pytest.fixture
def init(monkeypatch):
    def use(fake: FlakyInit) -> FlakyInit:
        monkeypatch.setattr(ray, "init", fake)
        monkeypatch.setattr(ray, "shutdown", lambda: None)
        return fake

    yield use


def alive(p: subprocess.Popen) -> bool:
    return p.poll() is None and os.path.exists(f"/proc/{p.pid}")


def test_a_start_that_timed_out_is_cleaned_up_and_tried_again(init):
    fake = init(FlakyInit(failures=1))
    bystander = subprocess.Popen(["sleep", "120"])  # this process's child from before: not Ray's to kill
    try:
        local_ray.start_local_ray(include_dashboard=False, num_cpus=2)
        assert fake.calls == [{"include_dashboard": False, "num_cpus": 2}] * 2
        assert not alive(fake.left[0])  # the first start's leftovers were killed
        assert alive(bystander)
    finally:
        bystander.kill()
        bystander.wait()


def test_a_start_that_keeps_timing_out_raises_after_the_last_attempt(init):
    fake = init(FlakyInit(failures=5))
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.start_local_ray(attempts=3)
    assert len(fake.calls) == 3
    try:
        assert not any(alive(p) for p in fake.left[:2])  # cleaned up before each new attempt
    finally:
        for p in fake.left:
            p.kill()
            p.wait()


def test_any_other_failure_is_raised_at_once(init):
    fake = init(FlakyInit(failures=1, error="Invalid address"))
    with pytest.raises(Exception, match="Invalid address"):
        local_ray.start_local_ray()
    assert len(fake.calls) == 1
    fake.left[0].kill()
    fake.left[0].wait()
