"""A role whose commit methods first check that this writer still holds the run root's lease.

    weights = Fenced(WeightPusher(...), lease.check, "push")
    checkpoints = Fenced(Checkpointer(...), lease.check, "save")

The loop calls `weights.push` and then `checkpoints.save` every step, before anything else of the
step is committed (snapshot, consumption record, checkpoint, STATUS, evals, metrics), so wrapping
them puts the lease check (miles_core.storage.lease, docs/training.md) in front of every step's commits without
a line in the loop. A fenced writer gets LeaseLost there and the segment ends.
"""

from __future__ import annotations

from typing import Any, Callable


class Fenced:
    def __init__(self, role: Any, check: Callable[[], None], *methods: str):
        self._role, self._check, self._methods = role, check, frozenset(methods)

    def __getattr__(self, name: str):
        attr = getattr(self._role, name)
        if name not in self._methods:
            return attr

        def fenced(*args, **kwargs):
            self._check()
            return attr(*args, **kwargs)

        return fenced
