"""Infrastructure failures leave a task as FlyteRecoverableException, so its `retries` fire (docs/training.md).

    with recoverable_infrastructure():
        run_training(cfg)

miles_core.failures decides what is infrastructure (a lost Ray actor or node, storage unavailable,
an engine lost beyond its restarts, a lost lease); this is the one place that knows flytekit's
type. Configuration and data errors, and a run root leased by another writer, pass through
unchanged: flytekit reports them as non-recoverable user errors and does not retry.
"""

from __future__ import annotations

import contextlib

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
