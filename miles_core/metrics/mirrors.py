"""Mirrors: the run's metric events forwarded to TensorBoard and W&B (docs/metrics.md).

    with mirror_feed(cfg, store):      # nothing to do unless --use-tensorboard / --use-wandb
        ...                            # a thread forwards new metrics/ parts every interval
    # on exit: a last sweep, then the mirrors close

A mirror is fed from the run root's metric parts, the source of truth, not from one sink: it sees
every component (the trainer and eval in the driver, the rollout manager and buffer in their
actors) exactly as the report does. The driver runs the feed for a segment; parts already in the
run root when it starts (earlier segments) are not sent again, and eval results that Flyte eval
tasks write after the segment ended are in the report, not in the mirrors.

- TensorBoard (`--use-tensorboard`): scalars under their metric names at their step, wall time
  kept. Event files go to `--tensorboard-dir`, or to `{run root}/tensorboard/`: in place on a
  file:// run root, else written on the driver's node and copied there whenever they grew.
- W&B (`--use-wandb`): one W&B run per run root (its id derives from the run URI, resumed by
  later segments), config = the resolved run config. Metrics are logged against a `step` metric
  (`define_metric("*", step_metric="step")`), so the rollout's events, which reach storage after
  the trainer's of later steps, are not dropped as out of order. The API key is W&B's own
  WANDB_API_KEY; no flag takes it and nothing here reads or logs it.
A mirror that fails while the run trains is logged and the run goes on; one that cannot start
fails the segment at once with MirrorError naming the flag.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections import defaultdict
from typing import Iterator, Mapping, Protocol

from miles_core.config import config_to_dict
from miles_core.metrics.sink import METRICS_PREFIX, part_events
from miles_core.storage import Store

log = logging.getLogger(__name__)

TENSORBOARD_PREFIX = "tensorboard"


class MirrorError(RuntimeError):
    """A mirror asked for by a flag could not start; the message names the flag and the cause."""


class Mirror(Protocol):
    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardMirror:
    """Scalars into TensorBoard event files in `logdir`; with `copy_to`, each grown file is copied there."""

    def __init__(self, logdir: str, copy_to: Store | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir, self.copy_to = logdir, copy_to
        self._writer = SummaryWriter(logdir)
        self._copied: dict[str, int] = {}

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)

    def flush(self) -> None:
        self._writer.flush()
        if self.copy_to is not None:
            self._copy_grown()

    def _copy_grown(self) -> None:
        for name in sorted(os.listdir(self.logdir)):
            path = os.path.join(self.logdir, name)
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size is not None and self._copied.get(name) != size:
                with open(path, "rb") as f:
                    self.copy_to.put_bytes(f"{TENSORBOARD_PREFIX}/{name}", f.read())
                self._copied[name] = size

    def close(self) -> None:
        self._writer.close()
        if self.copy_to is not None:
            self._copy_grown()


class WandbMirror:
    """One W&B run per run root, metrics logged against the `step` metric."""

    def __init__(self, cfg, run_uri: str):
        import wandb

        m, self._wandb = cfg.metrics, wandb
        try:
            self._run = wandb.init(project=m.wandb_project or None, group=m.wandb_group or None, name=cfg.run.run_id,
                                   id=wandb_run_id(cfg.run.run_id, run_uri), resume="allow", mode=m.wandb_mode,
                                   dir=m.wandb_dir or None, config=config_to_dict(cfg))
        except Exception as e:  # noqa: BLE001 - re-raised naming the flag; W&B's message never holds the key
            raise MirrorError(f"--use-wandb: wandb.init failed ({type(e).__name__}: {e}). --wandb-mode online "
                              "needs WANDB_API_KEY in the environment (or a Flyte secret); --wandb-mode offline "
                              "needs none.") from e
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self._run.log({"step": step, **metrics})

    def flush(self) -> None:
        pass  # W&B's own process streams what was logged

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()  # waits for W&B's service to write everything out (finish may return first)


def wandb_run_id(run_id: str, run_uri: str) -> str:
    """A W&B run id (letters, digits, `-`, `_`) for this run root: the run id and a hash of its URI."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:40]
    return f"{safe}-{hashlib.sha256(run_uri.encode()).hexdigest()[:12]}"


class MirrorFeed:
    """Forwards the run root's new metric parts to `mirrors`, from a thread and at close."""

    def __init__(self, store: Store, mirrors: list[Mirror], interval_seconds: float):
        self.store, self.mirrors, self.interval = store, mirrors, interval_seconds
        self._seen = set(self._parts())  # earlier segments' parts: already mirrored then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-mirrors", daemon=True)
        self._thread.start()

    def _parts(self) -> list[str]:
        return [k for k in self.store.list(METRICS_PREFIX) if k.endswith(".jsonl")]

    def sweep(self) -> int:
        """Send every part not sent yet; returns the number of events sent."""
        new = [k for k in self._parts() if k not in self._seen]
        sent = 0
        for key in new:
            for step, (metrics, wall_time) in sorted(_by_step(part_events(self.store, key)).items()):
                for mirror in self.mirrors:
                    mirror.log(step, metrics, wall_time)
                sent += len(metrics)
            self._seen.add(key)
        for mirror in self.mirrors:
            mirror.flush()
        return sent

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._quietly(self.sweep)

    def close(self) -> None:
        """The last sweep, then every mirror closed; failures are logged (the run's outcome stands)."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 30)
        self._quietly(self.sweep)
        for mirror in self.mirrors:
            self._quietly(mirror.close)

    @staticmethod
    def _quietly(fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a mirror must never fail training; the next sweep retries
            log.warning("metrics mirrors: %s: %s", type(e).__name__, e)


def _by_step(events: list[dict]) -> dict[int, tuple[dict[str, float], float]]:
    """step -> ({name: value}, latest wall time) of the finite values."""
    metrics: dict[int, dict[str, float]] = defaultdict(dict)
    times: dict[int, float] = defaultdict(float)
    for e in events:
        if e["value"] is not None:
            metrics[e["step"]][e["name"]] = e["value"]
            times[e["step"]] = max(times[e["step"]], e["time"])
    return {step: (metrics[step], times[step]) for step in metrics}


def build_mirrors(cfg, store: Store) -> list[Mirror]:
    """The mirrors the flags ask for; if one cannot start, those already started are closed."""
    makers = [lambda: _tensorboard(cfg.metrics.tensorboard_dir, store)] if cfg.metrics.use_tensorboard else []
    makers += [lambda: WandbMirror(cfg, store.root_uri)] if cfg.metrics.use_wandb else []
    mirrors: list[Mirror] = []
    try:
        for make in makers:
            mirrors.append(make())
    except BaseException:
        for mirror in mirrors:
            mirror.close()
        raise
    return mirrors


def _tensorboard(tensorboard_dir: str, store: Store) -> TensorBoardMirror:
    local = tensorboard_dir or store.local_path(TENSORBOARD_PREFIX)  # None on object storage
    if local:
        return TensorBoardMirror(local)
    return TensorBoardMirror(tempfile.mkdtemp(prefix="miles-tensorboard-"), copy_to=store)


@contextlib.contextmanager
def mirror_feed(cfg, store: Store) -> Iterator[MirrorFeed | None]:
    """The segment's feed (None when no mirror is asked for), closed with a last sweep."""
    mirrors = build_mirrors(cfg, store)
    if not mirrors:
        yield None
        return
    feed = MirrorFeed(store, mirrors, cfg.metrics.metrics_mirror_interval_seconds)
    try:
        yield feed
    finally:
        feed.close()
