"""When the producer may start a new prompt group: the submission budget and staleness admission.

Two independent gates, both pure bookkeeping (no I/O, no clock), owned by the producer:

- `SubmissionBudget` (docs/fully-async.md) bounds work on the engines. Under `group` granularity it is
  a count of group tasks pending (a slot per group, held until the group task ends); under
  `sample` granularity it is a credit counter of samples in flight (+n per group, -1 per sample
  that finishes, fails or is cancelled), so one straggler does not hold a whole group's slots.
  Every acquisition returns a `Ticket`; the ticket gives back exactly what it took, once, however
  the group ends (`release()` is idempotent), so credits are conserved across exceptions and
  cancellation.
- `StalenessAdmission` (docs/fully-async.md, AReaL-style) bounds how far generation runs ahead of
  training: with `--max-weight-staleness S`, a new group may start only while
  `started_groups + 1 <= (S + v + 1) * B`, where v is the number of weight versions published
  since the run's first version and B the groups consumed per version. `started_groups` counts
  groups admitted and not rejected since the run began, across resumes, so it is part of the
  checkpointed rollout state.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class SubmissionBudget:
    """Credits (sample granularity) or group slots (group granularity); see the module docstring.

    `acquire()` waits until a new group fits and returns its Ticket; `try_acquire()` returns None
    instead of waiting. `listeners` are called (no arguments) whenever capacity is given back, so
    a caller that waits on several gates at once can re-check them.
    """

    def __init__(self, budget_groups: int, n_samples_per_prompt: int, granularity: str):
        if granularity not in ("group", "sample"):
            raise ValueError(f"submission granularity {granularity!r}: expected 'group' or 'sample'")
        if budget_groups < 1 or n_samples_per_prompt < 1:
            raise ValueError(f"budget_groups={budget_groups} and n={n_samples_per_prompt} must be >= 1")
        self.budget_groups = budget_groups
        self.n = n_samples_per_prompt
        self.granularity = granularity
        self.in_flight_samples = 0  # sample granularity: credits taken and not given back
        self.pending_groups = 0  # group granularity: group slots taken and not given back
        self.listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()  # binds to a loop on first wait (Python >= 3.10)

    # ------------------------------------------------------------------ queries
    @property
    def capacity(self) -> int:
        return self.budget_groups * self.n if self.granularity == "sample" else self.budget_groups

    @property
    def used(self) -> int:
        return self.in_flight_samples if self.granularity == "sample" else self.pending_groups

    def can_acquire(self) -> bool:
        if self.granularity == "sample":
            return self.in_flight_samples + self.n <= self.budget_groups * self.n
        return self.pending_groups < self.budget_groups

    # ------------------------------------------------------------------ acquire / release
    def try_acquire(self) -> "Ticket | None":
        if not self.can_acquire():
            return None
        if self.granularity == "sample":
            self.in_flight_samples += self.n
            return Ticket(self, samples=self.n, slot=False)
        self.pending_groups += 1
        return Ticket(self, samples=0, slot=True)

    async def acquire(self) -> "Ticket":
        while True:
            ticket = self.try_acquire()
            if ticket is not None:
                return ticket
            self._changed.clear()
            await self._changed.wait()

    def _give_back(self, samples: int, slot: bool) -> None:
        self.in_flight_samples -= samples
        if slot:
            self.pending_groups -= 1
        assert self.in_flight_samples >= 0 and self.pending_groups >= 0, "budget over-released"
        self._changed.set()
        for listener in list(self.listeners):
            listener()


class Ticket:
    """What one group took from the budget. `sample_done()` gives back one sample's credit (sample
    granularity; a no-op under group granularity); `release()` gives back whatever is left."""

    def __init__(self, budget: SubmissionBudget, samples: int, slot: bool):
        self._budget = budget
        self.samples_held = samples
        self.slot_held = slot

    def sample_done(self) -> None:
        if self.samples_held > 0:
            self.samples_held -= 1
            self._budget._give_back(1, False)

    def release(self) -> None:
        samples, slot = self.samples_held, self.slot_held
        self.samples_held, self.slot_held = 0, False
        if samples or slot:
            self._budget._give_back(samples, slot)

    @property
    def released(self) -> bool:
        return self.samples_held == 0 and not self.slot_held


class StalenessAdmission:
    """The AReaL admission rule of docs/fully-async.md.

    `groups_per_version` is B = rollout_batch_size x update_weights_interval: the groups the
    trainer consumes between two weight versions (with the default interval of 1 this is exactly
    `rollout_batch_size`). `first_version` is the version the engines carry when the run starts
    (1 after the first push); v in the rule is `published_version - first_version`, clamped at 0.
    With `max_staleness=None` every group is admitted; `started_groups` is counted anyway so the
    checkpointed state stays meaningful if a later segment turns the limit on.
    """

    def __init__(self, max_staleness: int | None, groups_per_version: int, *, first_version: int = 1,
                 started_groups: int = 0, version: int | None = None):
        if groups_per_version < 1:
            raise ValueError(f"groups_per_version={groups_per_version} must be >= 1")
        self.max_staleness = max_staleness
        self.groups_per_version = groups_per_version
        self.first_version = first_version
        self.started_groups = started_groups
        self.version = first_version if version is None else version

    @property
    def limit(self) -> int | None:
        """Most groups that may have been started at the current version (None: no limit)."""
        if self.max_staleness is None:
            return None
        v = max(0, self.version - self.first_version)
        return (self.max_staleness + v + 1) * self.groups_per_version

    def can_admit(self) -> bool:
        limit = self.limit
        return limit is None or self.started_groups + 1 <= limit

    def admit(self) -> None:
        self.started_groups += 1

    def rejected(self, count: int = 1) -> None:
        """A started group was dropped or recycled: it leaves the count (and frees its place)."""
        self.started_groups = max(0, self.started_groups - count)

    def set_version(self, version: int) -> None:
        self.version = max(self.version, version)

