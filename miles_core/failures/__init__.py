"""Which failures are the infrastructure's (a retry resumes the run) and which are the user's (docs/training.md).

    is_infrastructure(exc) -> bool      # tasks/train.py turns True into FlyteRecoverableException

Infrastructure (a retried segment resumes from the latest checkpoint and can succeed):
- a Ray actor, worker, node or object lost: RayActorError (ActorDiedError, ActorUnavailableError),
  NodeDiedError, WorkerCrashedError, LocalRayletDiedError, ObjectLostError and its subclasses;
- storage unreachable through every retry: StorageUnavailable;
- an engine lost beyond its restarts: EngineStartError, EngineUnavailableError, WeightPushError;
- a producer job's engines lost with their node: EnginesLost;
- a trainer rank closed while the run needed it: RankEnded;
- this writer's lease lost (LeaseLost): its renewals failed, so storage was unreachable.
The user's (retrying cannot help): configuration and data errors (ConfigError, DatasetError,
SchemaError, InvalidName and every other ValueError or TypeError), LeaseHeld (another writer runs
on the run root), an unreadable checkpoint (CheckpointError), and an actor whose constructor raised
(Ray reports it as ActorDiedError with `actor_init_failed`). Anything else is not retried.

The exception and everything it chains (`__cause__`, `__context__`, a Ray task error's `.cause`) is
examined; one user error anywhere in the chain makes the failure the user's. Classes are matched by
qualified name along each class's MRO, so this module imports neither Ray, torch nor flytekit, and a
Ray task error (which subclasses the remote exception's class) matches like the original.
"""

from __future__ import annotations

INFRASTRUCTURE = frozenset({
    "ray.exceptions.RayActorError",
    "ray.exceptions.NodeDiedError",
    "ray.exceptions.WorkerCrashedError",
    "ray.exceptions.LocalRayletDiedError",
    "ray.exceptions.ObjectLostError",
    "miles_core.storage.StorageUnavailable",
    "miles_core.engines.launcher.EngineStartError",
    "miles_core.engines.launcher.EnginesLost",
    "miles_core.engines.client.EngineUnavailableError",
    "miles_core.weights.distributed.WeightPushError",
    "miles_core.driver.switchboard.RankEnded",
    "miles_core.storage.lease.LeaseLost",
})

USER = frozenset({
    "builtins.ValueError",  # ConfigError, DatasetError, SchemaError, InvalidName, PluginError, ...
    "builtins.TypeError",
    "miles_core.storage.lease.LeaseHeld",
    "miles_core.train.checkpoint.CheckpointError",
})


def _names(exc: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}


def _chain(exc: BaseException) -> list[BaseException]:
    seen, todo, out = set(), [exc], []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        out.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return out


def _is_user(e: BaseException) -> bool:
    return bool(_names(e) & USER) or bool(getattr(e, "actor_init_failed", False))


def is_infrastructure(exc: BaseException) -> bool:
    """True when `exc` (or what it chains) is an infrastructure failure and nothing in it is the user's."""
    chain = _chain(exc)
    if any(_is_user(e) for e in chain):
        return False
    return any(_names(e) & INFRASTRUCTURE for e in chain)
