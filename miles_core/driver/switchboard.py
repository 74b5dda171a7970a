"""The driver's one wait: every call the loop waits for goes through `Switchboard.wait`.

    board = Switchboard(watched=[trainer.alive()])          # calls that end only when a rank dies
    board.every(cfg.buffer.producer_poll_seconds, feed.refresh)   # duties, run from the wait
    board.track(delivery, on_done=weights.delivered)        # a weight delivery in flight (a handle)
    batch = board.wait(rollout.next_train_batch(version))

While the driver waits for one call (the next batch, a training step, a checkpoint), the same wait
covers the weight delivery in flight (its end runs `on_done` at once: the version is announced, or its
failure raised right there), the trainer's ranks (`watched`: a rank that dies ends its `alive` call, and
the wait raises) and the periodic duties (the producer feed's refresh, the engine fleet's look while no
engine serves), run between two looks when due. There is no thread and no polling loop: the wait
sleeps in Ray's (or a future's) wait until something finishes or the next duty is due.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from miles_core.driver.clients import Pending, wait_any

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankEnded(RuntimeError):
    """A trainer rank's `alive()` call answered: the rank closed while the run still needed it (a rank
    that dies raises Ray's ActorDiedError instead). Infrastructure: a retried segment resumes."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class Duty:
    every_seconds: float
    run: Callable[[], None]
    due: float = 0.0


class Switchboard:
    def __init__(self, watched: Sequence[Pending] = (), clock: Callable[[], float] = time.monotonic):
        self.watched, self.clock = list(watched), clock
        self.duties: list[Duty] = []
        self.in_flight: list[tuple[Pending, Callable[[Pending], None]]] = []

    def every(self, seconds: float, run: Callable[[], None]) -> None:
        """Run `run()` from the waits, at most every `seconds` (a failure is logged: the duty's next turn
        tries again, and the loop's own calls raise what matters)."""
        self.duties.append(Duty(seconds, run, self.clock() + seconds))

    def track(self, pending: Pending, on_done: Callable[[Pending], None]) -> None:
        """`on_done(pending)` runs in the first wait that sees `pending` finished (it reads the result, so
        a failure raises there), or in `settle(pending)`."""
        self.in_flight.append((pending, on_done))

    def settle(self, pending: Pending) -> None:
        """Wait for a tracked call and run its `on_done` (which reads its result: a failure raises there)."""
        self._until_done(pending)
        self._finish_tracked()

    def wait(self, pending: Pending[T]) -> T:
        """`pending`'s result; meanwhile tracked calls finish, watched ranks are checked and duties run."""
        self._until_done(pending)
        return pending.result()

    def _until_done(self, pending: Pending) -> None:
        while True:
            self._finish_tracked()
            self._check_watched()
            if pending.done():
                return
            now = self.clock()
            due = min((d.due for d in self.duties), default=None)
            wait_any([pending, *(p for p, _ in self.in_flight), *self.watched],
                     None if due is None else max(0.0, due - now))
            self._run_duties()

    def _finish_tracked(self) -> None:
        for item in list(self.in_flight):
            pending, on_done = item
            if pending.done():
                self.in_flight.remove(item)
                on_done(pending)

    def _check_watched(self) -> None:
        for w in self.watched:
            if w.done():
                w.result()  # raises the rank's death (Ray's ActorDiedError)
                raise RankEnded("a trainer rank ended while the run went on")

    def _run_duties(self) -> None:
        now = self.clock()
        for d in self.duties:
            if now >= d.due:
                d.due = now + d.every_seconds
                try:
                    d.run()
                except Exception as e:  # noqa: BLE001 - see `every`
                    log.warning("%s failed: %s", getattr(d.run, "__qualname__", "a duty"), e)
