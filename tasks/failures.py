"""Infrastructure failures leave a task as FlyteRecoverableException, so its `retries` fire (docs/training.md).

    with recoverable_infrastructure():
        run_training(cfg)

miles_core.failures decides what is infrastructure (a lost Ray actor or node, storage unavailable,
an engine lost beyond its restarts, a lost lease); this is the one place that knows flytekit's
type. Configuration and data errors, and a run root leased by another writer, pass through
unchanged: flytekit reports them as non-recoverable user errors and does not retry.

    with one_line_on_the_command_line():
        cfg = run_config(flags, ...)

A local `pyflyte run` prints a failed task's exception with a traceback of every frame that led to
it, 30-60 lines before the one that matters. On that command line (and only there: a task on a
cluster, or a workflow called from Python, raises as before) the error becomes a ClickException,
which pyflyte prints as the error alone: `Error: ConfigError: invalid configuration: ...`. A
training segment keeps its whole traceback in the run root (errors/segment_{n}.txt).
"""

from __future__ import annotations

import contextlib

import click
from flytekit import FlyteContextManager
from flytekit.exceptions.user import FlyteRecoverableException

from miles_core.failures import is_infrastructure


@contextlib.contextmanager
def recoverable_infrastructure():
    try:
        yield
    except Exception as e:
        if is_infrastructure(e):
            raise FlyteRecoverableException(
                f"infrastructure failure, retrying resumes from the latest checkpoint: {type(e).__name__}: {e}"[:4000]
            ) from e
        raise


class CommandLineError(click.ClickException):
    """A task's failure as the `pyflyte run` command line shows it: the error's class and message."""


@contextlib.contextmanager
def one_line_on_the_command_line():
    try:
        yield
    except Exception as e:
        if isinstance(e, click.ClickException) or not _local_command_line():
            raise
        raise CommandLineError(f"{type(e).__name__}: {e}") from e


def _local_command_line() -> bool:
    """A local execution started by a command line (`pyflyte run` without --remote)."""
    state = FlyteContextManager.current_context().execution_state
    local = state is not None and state.is_local_execution()
    return local and click.get_current_context(silent=True) is not None

