"""Real Ray failures are classified as miles_core.failures says (a local Ray instance, tiny actors).

Pins: a call on an actor killed with `ray.kill` raises ActorDiedError, which is infrastructure and
leaves a Flyte task as FlyteRecoverableException; an actor method raising StorageUnavailable reaches
the driver as a Ray task error that is still infrastructure, and one raising ConfigError is not; an
actor whose constructor raised is not (the same error would recur on every retry).
"""

from __future__ import annotations

import time

import pytest
import ray
from flytekit.exceptions.user import FlyteRecoverableException

from miles_core.config import ConfigError
from miles_core.failures import is_infrastructure
from miles_core.storage import StorageUnavailable
from tasks.failures import recoverable_infrastructure

from tests.support.timeouts import RAY_CALL_SECONDS


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, fail: bool = False):
        if fail:
            raise RuntimeError("bad model path")

    def ping(self) -> str:
        return "pong"

    def fail(self, kind: str) -> None:
        if kind == "storage":
            raise StorageUnavailable("storage at s3://b/runs/r unreachable: put failed 7 times")
        raise ConfigError("invalid configuration: --lr=0 must be > 0.")


def _error(ref) -> BaseException:
    try:
        ray.get(ref, timeout=RAY_CALL_SECONDS)
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("the call succeeded")


def _error_once_dead(actor) -> BaseException:
    """`ray.kill` returns before the actor is dead: a call made in between may still answer."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=RAY_CALL_SECONDS)
        except Exception as e:  # noqa: BLE001
            return e
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers after 60 s")


def test_a_killed_actor_is_an_infrastructure_failure(ray_local):
    actor = Worker.remote()
    assert ray.get(actor.ping.remote(), timeout=RAY_CALL_SECONDS) == "pong"
    ray.kill(actor)
    err = _error_once_dead(actor)
    assert isinstance(err, ray.exceptions.ActorDiedError) and is_infrastructure(err)
    with pytest.raises(FlyteRecoverableException, match="ActorDiedError"):
        with recoverable_infrastructure():
            raise err


def test_remote_exceptions_keep_their_class(ray_local):
    actor = Worker.remote()
    storage = _error(actor.fail.remote("storage"))
    assert isinstance(storage, ray.exceptions.RayTaskError) and is_infrastructure(storage)
    config = _error(actor.fail.remote("config"))
    assert isinstance(config, ConfigError) and not is_infrastructure(config)
    ray.kill(actor)


def test_an_actor_whose_constructor_raised_is_not_retried(ray_local):
    err = _error(Worker.remote(fail=True).ping.remote())
    assert isinstance(err, ray.exceptions.ActorDiedError) and err.actor_init_failed
    assert not is_infrastructure(err)
