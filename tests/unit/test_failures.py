"""Which failures a retry can fix (miles_core.failures) and how the Flyte tasks report them (tasks.failures).

Pins: a lost Ray actor / worker / node / object, storage unavailable past its retries, an engine
lost beyond its restarts and a lost lease are infrastructure, also when wrapped (a Ray task error
carrying the remote exception, a chained cause or context); configuration and data errors, a run
root leased by another writer, an unreadable checkpoint and an actor whose constructor raised are
not, even when an infrastructure error is in the same chain. The `train` task raises
FlyteRecoverableException (the kind flytekit's entrypoint marks RECOVERABLE, so `retries` fire)
for the first group and lets the second through unchanged.
"""

from __future__ import annotations

import contextlib

import pytest
import ray.exceptions as rx
from flytekit.exceptions.base import FlyteRecoverableException as AnyRecoverable
from flytekit.exceptions.user import FlyteRecoverableException

from miles_core.config import ConfigError
from miles_core.driver.switchboard import RankEnded
from miles_core.engines.client import EngineUnavailableError
from miles_core.engines.launcher import EngineStartError
from miles_core.failures import is_infrastructure
from miles_core.rollout.prompts import DatasetError
from miles_core.samples import SchemaError
from miles_core.storage import InvalidName, ObjectNotFound, StorageUnavailable
from miles_core.storage.lease import LeaseHeld, LeaseLost
from miles_core.weights.distributed import WeightPushError
from tasks.failures import recoverable_infrastructure

INFRASTRUCTURE = [
    rx.ActorDiedError(),
    rx.ActorUnavailableError("actor unreachable", None),
    rx.RayActorError(),
    rx.NodeDiedError("node 10.0.0.7 died"),
    rx.WorkerCrashedError(),
    rx.LocalRayletDiedError(),
    rx.ObjectLostError("ab" * 14, None, ""),
    rx.OwnerDiedError("ab" * 14, None, ""),
    StorageUnavailable("storage at s3://b/runs/r unreachable: put failed 7 times"),
    EngineStartError("engine 1 did not answer /health within 900 s"),
    EngineUnavailableError("engine http://10.0.0.8:30000 gave no answer"),
    WeightPushError("the distributed push failed twice"),
    LeaseLost("lost the write lease on s3://b/runs/r"),
    RankEnded("a trainer rank ended while the run went on"),
]

USER = [
    ConfigError("invalid configuration: --lr=0 must be > 0."),
    DatasetError("prompts.jsonl row 3: field 'prompt' is missing"),
    SchemaError("unknown schema major version 9"),
    InvalidName("--run-id='a/b': '/' is not allowed"),
    LeaseHeld("run root s3://b/runs/r is being written by host/pid1/abcd", holder="host/pid1/abcd"),
    ObjectNotFound("no object s3://b/runs/r/x"),
    RuntimeError("a bug"),
    KeyError("k"),
]


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("exc", INFRASTRUCTURE, ids=lambda e: type(e).__name__)
def test_infrastructure_failures(exc):
    assert is_infrastructure(exc)
    assert is_infrastructure(_raised(RuntimeError("segment failed"), exc))  # chained as the cause
    try:
        try:
            raise exc
        except BaseException:
            raise RuntimeError("while handling it")  # noqa: B904 - the implicit context is the point
    except RuntimeError as e:
        assert is_infrastructure(e)  # chained as the context


@pytest.mark.parametrize("exc", USER, ids=lambda e: type(e).__name__)
def test_user_errors_and_the_unknown_are_not_retried(exc):
    assert not is_infrastructure(exc)


def test_a_user_error_anywhere_in_the_chain_wins():
    assert not is_infrastructure(_raised(StorageUnavailable("storage down"), ConfigError("bad flag")))
    assert not is_infrastructure(_raised(rx.ActorDiedError(), DatasetError("bad row")))


def test_ray_task_errors_are_classified_by_the_remote_exception():
    remote_storage = rx.RayTaskError("save_checkpoint", "tb", StorageUnavailable("storage down")).as_instanceof_cause()
    assert isinstance(remote_storage, StorageUnavailable) and is_infrastructure(remote_storage)
    remote_config = rx.RayTaskError("train_step", "tb", ConfigError("bad")).as_instanceof_cause()
    assert not is_infrastructure(remote_config)
    init_failed = rx.ActorDiedError(rx.RayTaskError("__init__", "tb", RuntimeError("bad model path")))
    assert init_failed.actor_init_failed and not is_infrastructure(init_failed)


@pytest.mark.parametrize("exc", INFRASTRUCTURE[:3] + INFRASTRUCTURE[8:], ids=lambda e: type(e).__name__)
def test_tasks_raise_infrastructure_failures_as_recoverable(exc):
    with pytest.raises(FlyteRecoverableException) as e:
        with recoverable_infrastructure():
            raise exc
    assert isinstance(e.value, AnyRecoverable) and e.value.__cause__ is exc
    assert type(exc).__name__ in str(e.value)


@pytest.mark.parametrize("exc", USER[:5], ids=lambda e: type(e).__name__)
def test_tasks_let_user_errors_through_unchanged(exc):
    with pytest.raises(type(exc)) as e:
        with recoverable_infrastructure():
            raise exc
    assert e.value is exc


def test_the_train_task_maps_a_lost_node(monkeypatch, tmp_path):
    import miles_core.driver.segment
    from tasks.train import train

    def lost(cfg, **kwargs):
        raise rx.NodeDiedError("node died")

    monkeypatch.setattr(miles_core.driver.segment, "run_training", lost)
    with pytest.raises(FlyteRecoverableException, match="NodeDiedError"):
        train.task_function(flags="--preset tiny-reverse4", run_id="t", storage_root=str(tmp_path), segment_steps=0)

    def held(cfg, **kwargs):
        raise LeaseHeld("held by someone", holder="someone")

    monkeypatch.setattr(miles_core.driver.segment, "run_training", held)
    with pytest.raises(LeaseHeld):
        train.task_function(flags="--preset tiny-reverse4", run_id="t", storage_root=str(tmp_path), segment_steps=0)


def test_on_the_local_command_line_an_error_is_the_error_alone_and_elsewhere_unchanged():
    """`pyflyte run` (local) prints a ClickException as its message alone, any other exception with every
    frame: there the task's error becomes one; a workflow called from Python, or a task on a cluster
    (pyflyte-execute is a click command too), raises it unchanged."""
    import click
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState

    from tasks.failures import CommandLineError, one_line_on_the_command_line

    def raised(mode, under_click: bool) -> BaseException:
        ctx = FlyteContextManager.current_context()
        state = ctx.with_execution_state(ctx.execution_state.with_params(mode=mode))
        with FlyteContextManager.with_context(state), \
                (click.Context(click.Command("pyflyte")) if under_click else contextlib.nullcontext()):
            try:
                with one_line_on_the_command_line():
                    raise ValueError("bad row 3")
            except BaseException as e:  # noqa: BLE001
                return e
        raise AssertionError("nothing raised")

    local = ExecutionState.Mode.LOCAL_WORKFLOW_EXECUTION
    e = raised(local, under_click=True)
    assert isinstance(e, CommandLineError) and e.format_message() == "ValueError: bad row 3"
    assert isinstance(e.__cause__, ValueError)
    assert type(raised(local, under_click=False)) is ValueError
    assert type(raised(ExecutionState.Mode.TASK_EXECUTION, under_click=True)) is ValueError
