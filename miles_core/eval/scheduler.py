"""EvalScheduler: the one eval component the training driver talks to (docs/evaluation.md).

    evals = build_eval_scheduler(cfg, exporter=..., metrics=MetricsSink(run_uri, "eval"), ...)
    for step in ...:
        ...
        evals.on_step(step, version, last=last)   # decides itself whether this step evaluates
    evals.close()                                  # waits for pending in-process evals, retires

It owns the cadence (every --eval-interval steps, and always the last step of a segment), the
snapshot policy (export at the cadence, or reuse --save-hf checkpoints), the in-flight limit
(--eval-max-in-flight with --eval-overflow-policy backpressure|skip; the last step is never
skipped for being busy; in Mode 3 the limit applies only while an eval follower's heartbeat is
fresh, since with no follower running nothing would ever free a slot), and ring retirement of
exported snapshots after evals settle. The mode
(shared / dedicated / tasks) is picked once, at construction. Every failure is a metric
`eval/skipped_{reason}` at the step concerned; nothing here raises into the training loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable, Sequence

from miles_core.config.sections import EngineSection
from miles_core.engines.launcher import EngineFleet, EngineLaunchSpec, custom_resource
from miles_core.eval.datasets import EvalDataset, EvalSampling, load_eval_datasets, sampling_from_config
from miles_core.eval.modes import (
    DedicatedEngines,
    EvalContext,
    EvalJob,
    EventLoopThread,
    Outcome,
    SharedEngines,
    SnapshotTasks,
)
from miles_core.eval.results import follower_alive, record_skip, request_key, requests, settled_steps, step_dir
from miles_core.eval.snapshots import MARKERS, SnapshotLayout, on_cadence, retire_snapshots
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.prepare.initial_model import ensure_model
from miles_core.storage import Store

log = logging.getLogger(__name__)

# exporter(step, dest_uri): write the trainer's current weights as an HF directory at dest_uri,
# `.complete` last (miles_core.weights). Raising means the export failed.
Exporter = Callable[[int, str], None]


class EvalScheduler:
    def __init__(self, *, store: Store, layout: SnapshotLayout, datasets: list[EvalDataset],
                 sampling: EvalSampling, eval_interval: int | None, max_in_flight: int, overflow_policy: str,
                 keep_snapshots: int, backpressure_timeout_seconds: float, mode, exporter: Exporter | None,
                 metrics: Any = None, protected_uris: Sequence[str] = (), loop: EventLoopThread | None = None,
                 poll_seconds: float = 0.5, follower_max_age_seconds: float = 60.0,
                 on_close: Sequence[Callable[[], Any]] = (), follower_runs_after: bool = False):
        self.store, self.layout, self.datasets, self.sampling = store, layout, datasets, sampling
        self.eval_interval, self.max_in_flight, self.overflow_policy = eval_interval, max_in_flight, overflow_policy
        self.keep_snapshots = keep_snapshots
        self.backpressure_timeout_seconds = backpressure_timeout_seconds
        self.mode, self.exporter, self.metrics = mode, exporter, metrics
        self.protected_uris = tuple(protected_uris)
        self.poll_seconds = poll_seconds
        self.follower_max_age_seconds = follower_max_age_seconds
        self._warned_no_follower = False
        self.follower_runs_after = follower_runs_after  # a local workflow: the follower runs after training
        self._on_close = list(on_close)
        self._loop = loop
        self._latest_step = -1
        self._pending: dict[int, concurrent.futures.Future | None] = {}
        self._done_steps: set[int] = set()
        self.outcomes: list[Outcome] = []  # settled in-process evals, in settle order

    # ------------------------------------------------------------------ the driver's interface

    def latest_step(self) -> int:
        return self._latest_step

    def on_step(self, step: int, version: int | None, last: bool = False) -> None:
        """Called after every training step (after the weight push and the checkpoint save)."""
        self._latest_step = max(self._latest_step, step)
        if self._settle():
            self.retire()
        if step in self._done_steps or not (last or on_cadence(step, self.eval_interval)):
            return
        self._done_steps.add(step)
        if not self._make_room(step, last):
            return
        snapshot_uri = self._snapshot(step)
        if snapshot_uri is None:
            return
        try:
            fut = self.mode.start(EvalJob(step, version, snapshot_uri))
        except Exception as e:  # noqa: BLE001 - e.g. storage down while writing a Mode 3 request
            log.warning("eval of step %d could not start: %s", step, e)
            record_skip(None, step, "crashed", str(e), self.metrics)
            return
        self._pending[step] = fut
        trace_eval(fut, step)
        if self._settle():
            self.retire()

    def retire(self) -> list[int]:
        """Ring-retire exported snapshots whose evals have settled; returns the steps deleted."""
        try:
            pending = set(self._pending)
            if isinstance(self.mode, SnapshotTasks):  # requests of earlier segments the follower still owes
                pending |= set(requests(self.store)) - settled_steps(self.store, [d.name for d in self.datasets])
            return retire_snapshots(self.layout, self.keep_snapshots, pending, protected_uris=self.protected_uris)
        except Exception as e:  # noqa: BLE001 - housekeeping never fails training
            log.warning("snapshot retirement failed: %s", e)
            return []

    def wait(self, timeout_seconds: float | None = None) -> bool:
        """Wait until no in-process eval is pending (Mode 3 requests are the follower's); True when none is."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        while True:
            self._settle()
            waiting = [f for f in self._pending.values() if f is not None]
            if not waiting:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            concurrent.futures.wait(waiting, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self, timeout_seconds: float | None = 3600.0) -> None:
        """Let in-process evals finish, retire settled snapshots, stop the eval thread."""
        try:
            self.wait(timeout_seconds)
            self._settle()
            self.retire()
        finally:
            if self._loop is not None:
                self._loop.close()
            for fn in self._on_close:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001
                    log.warning("eval shutdown step failed: %s", e)

    def __enter__(self) -> "EvalScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pending_steps(self) -> list[int]:
        return sorted(self._pending)

    # ------------------------------------------------------------------ internals

    def _settle(self) -> bool:
        """Drop settled evals from the pending set; True when any settled."""
        if not self._pending:
            return False
        settled = []
        for step, fut in self._pending.items():
            if fut is not None and fut.done():
                settled.append(step)
                try:
                    self.outcomes.append(fut.result())
                except Exception as e:  # noqa: BLE001 - modes record their own failures; belt and braces
                    self.outcomes.append(Outcome(step, record_skip(self.store, step, "crashed", str(e), self.metrics),
                                                 "crashed", str(e)))
        if any(f is None for f in self._pending.values()):  # Mode 3: settled when the follower wrote results
            try:
                done = settled_steps(self.store, [d.name for d in self.datasets])
            except Exception as e:  # noqa: BLE001
                log.warning("could not list eval results: %s", e)
                done = set()
            settled += [s for s, f in self._pending.items() if f is None and s in done]
        for step in settled:
            self._pending.pop(step, None)
        return bool(settled)

    def _make_room(self, step: int, last: bool) -> bool:
        if len(self._pending) < self.max_in_flight or last:  # the last step is always evaluated
            return True
        if not self._evaluator_alive():
            return True
        if self.overflow_policy == "skip":
            record_skip(self.store, step, "busy", f"{len(self._pending)} evals pending", self.metrics)
            return False
        deadline = time.monotonic() + self.backpressure_timeout_seconds
        while time.monotonic() < deadline:
            waiting = [f for f in self._pending.values() if f is not None]
            if waiting:
                concurrent.futures.wait(waiting, timeout=self.poll_seconds, return_when=concurrent.futures.FIRST_COMPLETED)
            else:
                time.sleep(self.poll_seconds)
            if self._settle():
                self.retire()
            if len(self._pending) < self.max_in_flight or not self._evaluator_alive():
                return True
        record_skip(self.store, step, "busy",
                    f"no eval slot within {self.backpressure_timeout_seconds:.0f} s (--eval-backpressure-timeout-seconds)",
                    self.metrics)
        return False

    def _snapshot(self, step: int) -> str | None:
        """Export (or find the reused checkpoint of) `step`; its URI, or None after counting a skip."""
        uri = self.layout.uri(step)
        self._forget_lost_segment(step)
        if self.layout.exports:
            if self.exporter is None:
                return "" if isinstance(self.mode, SharedEngines) else self._skip(step, "export_failed", "no exporter")
            t0 = time.monotonic()
            try:
                self.exporter(step, uri)
            except Exception as e:  # noqa: BLE001 - an export failure is a metric, not a crash
                log.warning("snapshot export of step %d to %s failed: %s", step, uri, e)
                if isinstance(self.mode, SharedEngines):  # Mode 1 evaluates the engines, not the snapshot
                    record_skip(None, step, "export_failed", str(e), self.metrics)
                    return ""
                return self._skip(step, "export_failed", f"{type(e).__name__}: {e}")
            if self.metrics is not None:
                self.metrics.log(step, {N.EVAL_EXPORT_SECONDS: time.monotonic() - t0})
        try:
            complete = self.layout.is_complete(step)
        except Exception as e:  # noqa: BLE001
            return self._skip(step, "ckpt_missing", f"could not check {uri}: {e}")
        if not complete:
            if isinstance(self.mode, SharedEngines):
                record_skip(None, step, "ckpt_missing", uri, self.metrics)
                return ""
            return self._skip(step, "ckpt_missing", f"{uri} has no completion marker")
        return uri

    def _evaluator_alive(self) -> bool:
        """Mode 3 only: is an eval follower running? Without one (a local workflow runs train and
        eval_follower one after the other; or the follower died), waiting for a slot would stall
        training for nothing: the pending snapshots are kept and evaluated when a follower runs."""
        if not isinstance(self.mode, SnapshotTasks):
            return True
        alive = follower_alive(self.store, self.follower_max_age_seconds)
        if not alive and not self._warned_no_follower and self.follower_runs_after:
            self._warned_no_follower = True
            print(f"[miles] evals: step {self._latest_step}'s snapshot waits in {self.store.uri('eval')} for the "
                  "eval follower, which a local workflow runs after training", flush=True)
        elif not alive and not self._warned_no_follower:
            self._warned_no_follower = True
            log.warning("no eval follower heartbeat in %s: Mode 3 evals pile up as pending requests "
                        "(no backpressure) until an eval_follower runs", self.store.uri("eval"))
        return alive

    def _forget_lost_segment(self, step: int) -> None:
        """Results (or an exported snapshot) for `step` that exist before this segment evaluated it
        came from a segment that crashed after that step and was resumed from an earlier
        checkpoint: other weights. Remove the stale results, and in export mode the snapshot
        (marker first, so no reader takes half of it), so the step is evaluated afresh. Reused
        --save-hf checkpoints are the checkpointer's: it rewrites them itself."""
        try:
            name = self.layout.dirname(step)
            store = self.layout.store()
            if self.layout.exports and store.list(name):
                log.warning("replacing snapshot %s left by a lost segment", self.layout.uri(step))
                for marker in MARKERS:
                    store.delete(f"{name}/{marker}")
                store.delete_prefix(name)
            if self.store.list(step_dir(step)) or self.store.exists(request_key(step)):
                self.store.delete_prefix(step_dir(step))
                self.store.delete(request_key(step))
        except Exception as e:  # noqa: BLE001 - the export below overwrites; the check after it decides
            log.warning("could not clear the lost segment's snapshot of step %d: %s", step, e)

    def _skip(self, step: int, reason: str, detail: str) -> None:
        record_skip(self.store, step, reason, detail, self.metrics)
        return None


class NoEvals:
    """The scheduler when no eval datasets are configured: every call does nothing."""

    def on_step(self, step: int, version: int | None, last: bool = False) -> None:
        return None

    def retire(self) -> list[int]:
        return []

    def wait(self, timeout_seconds: float | None = None) -> bool:
        return True

    def close(self, timeout_seconds: float | None = None) -> None:
        return None

    def __enter__(self) -> "NoEvals":
        return self

    def __exit__(self, *exc) -> None:
        return None

    pending_steps: list[int] = []


def trace_eval(fut, step: int) -> None:
    """The eval of `step` in the run's trace: from its start until its future settles."""
    start = trace.now()
    if hasattr(fut, "add_done_callback"):
        fut.add_done_callback(lambda _: trace.tracer().complete("eval", start, trace.now(), lane="eval", step=step))


def build_eval_scheduler(cfg, *, exporter: Exporter | None = None, metrics: Any = None,
                         shared_engine_urls: Sequence[str] | Callable[[], Sequence[str]] = (),
                         pause_submission: Callable[[], Any] | None = None,
                         resume_submission: Callable[[], Any] | None = None,
                         dedicated_engine_urls: Sequence[str] = (), initial_model: str | None = None,
                         run_uri: str | None = None, datasets: list[EvalDataset] | None = None,
                         follower_runs_after: bool = False) -> EvalScheduler | NoEvals:
    """The eval scheduler for `cfg`, its mode decided here once (cfg.eval.eval_mode).

    shared: needs shared_engine_urls (the rollout engines, or a callable giving those serving now) and the
    producer's pause/resume submission hooks (sync callables, or returning awaitables such as Ray object refs).
    dedicated: uses dedicated_engine_urls when given, else starts --eval-num-gpus worth of engines
    (Ray actors) on `initial_model` and stops them at close(). tasks: nothing more; an
    eval_follower task must run beside training, or after it (`follower_runs_after`: a local workflow,
    where waiting snapshots are expected and announced once instead of warned about). `exporter` writes a
    snapshot (export mode).
    """
    e = cfg.eval
    if not e.eval_prompt_data:
        return NoEvals()
    run_uri = run_uri or cfg.run_uri
    store = Store(run_uri)
    ds = datasets if datasets is not None else load_eval_datasets(cfg, run_uri=run_uri)
    sampling = sampling_from_config(cfg)
    owned: list[Callable[[], Any]] = []
    needs_loop = e.eval_mode in ("shared", "dedicated")
    loop = EventLoopThread() if needs_loop else None
    sched_box: list[EvalScheduler] = []
    ctx = EvalContext(store=store, datasets=ds, sampling=sampling, metrics=metrics,
                      latest_step=lambda: sched_box[0].latest_step() if sched_box else -1,
                      request_timeout_seconds=cfg.rollout.engine_request_timeout_seconds)
    if e.eval_mode == "shared":
        if not (callable(shared_engine_urls) or shared_engine_urls) or pause_submission is None \
                or resume_submission is None:
            raise ValueError("--eval-mode=shared needs the rollout engine URLs and the producer's "
                             "pause/resume submission hooks")
        mode = SharedEngines(ctx, loop, shared_engine_urls, pause_submission, resume_submission)
    elif e.eval_mode == "dedicated":
        if not dedicated_engine_urls:  # start the fleet here; the scheduler owns it and stops it at close()
            if initial_model is None:
                initial_model = ensure_model(cfg)
            fleet = start_dedicated_engines(cfg, initial_model)
            owned.append(fleet.shutdown)
            # each engine copies the snapshot to its own node (they may not share the driver's disk)
            mode = DedicatedEngines(ctx, loop, fleet.urls(), load=fleet.load_weights)
        else:
            mode = DedicatedEngines(ctx, loop, dedicated_engine_urls)
    else:
        mode = SnapshotTasks(ctx)
    sched = EvalScheduler(
        store=store, layout=SnapshotLayout.from_config(cfg, run_uri), datasets=ds, sampling=sampling,
        eval_interval=e.eval_interval, max_in_flight=e.eval_max_in_flight, overflow_policy=e.eval_overflow_policy,
        keep_snapshots=e.eval_keep_snapshots, backpressure_timeout_seconds=e.eval_backpressure_timeout_seconds,
        mode=mode, exporter=exporter, metrics=metrics, protected_uris=(cfg.model.hf_checkpoint,), loop=loop,
        on_close=owned, follower_runs_after=follower_runs_after)
    sched_box.append(sched)
    return sched


def start_dedicated_engines(cfg, initial_model_path: str):
    """Mode 2: start --eval-num-gpus worth of eval engines (Ray actors) on `initial_model_path`.

    Returns a started EngineFleet (call .urls(); .shutdown() at the end). They never join the
    training weight push: every eval pins them to its snapshot.
    """
    spec = launch_spec(cfg.engine, initial_model_path)
    per_engine = max(1, cfg.engine.rollout_num_gpus_per_engine) if cfg.engine.engine_backend == "sglang" else 1
    n = max(1, cfg.eval.eval_num_gpus // per_engine)
    return EngineFleet(spec, n, num_cpus_per_engine=cfg.run.num_cpus_per_engine, name_prefix="eval-engine",
                       resources=custom_resource(cfg.engine.engine_custom_resource)).start()


def launch_spec(engine: EngineSection, model_path: str, weight_version: int = 0):
    try:
        return EngineLaunchSpec.from_config(engine, model_path, weight_version)
    except AttributeError:  # an engine section without the launcher's newer fields
        return EngineLaunchSpec(backend=engine.engine_backend, model_path=model_path, weight_version=weight_version,
                                max_running_requests=engine.engine_max_running_requests)
