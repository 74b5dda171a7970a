"""Run one training segment of a run: build the roles on Ray, run the loop, leave a clean state.

    result = run_training(cfg)      # the Flyte `train` task calls exactly this

Resumes from the latest complete checkpoint when there is one (trainer, data-source cursor,
started-groups count, buffer consumption, weight version), so a retry after a lost node and the
next scheduled segment continue the same lineage with no group trained twice or lost.

Before anything is written or started (docs/training.md):
- finished is final: when STATUS.json says `finished` at step >= --num-rollout - 1 the segment
  returns that outcome at once: no write, no Ray, no actor (raise --num-rollout to continue);
- one writer: the run root's lease (miles_core.storage.lease) is acquired, or LeaseHeld names the holder.
  Every step's commits check it (the loop's `roles.fence`) and it is released on exit, failed or not, so a
  retry takes over at once; a killed writer's lease is taken over when it expires.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import sys
import traceback
from dataclasses import dataclass

from miles_core.config import RunConfig
from miles_core.config.sections import RunSection
from miles_core.driver.feed_publisher import feed_publisher
from miles_core.driver.fleet_reconciler import FleetReconciler
from miles_core.driver.loop import LoopResult, run_loop
from miles_core.driver.placement import Cluster, TrainerGroup, check_fits, ensure_ray, start_cluster
from miles_core.driver.plan import PREFIX, is_finished
from miles_core.driver.prometheus import PrometheusExporter
from miles_core.driver.pushes import WeightPusher, WeightVersion
from miles_core.driver.roles import (
    Checkpointer,
    Deadline,
    MetricsLog,
    Progress,
    Roles,
    TrainerRole,
    batch_source,
)
from miles_core.driver.switchboard import Switchboard
from miles_core.driver.timeline import start_timeline
from miles_core.eval.scheduler import build_eval_scheduler
from miles_core.metrics.mirrors import mirror_feed
from miles_core.metrics.names import RANDOM_POLICY_REWARD
from miles_core.metrics.sink import MetricsSink
from miles_core.models.source import tokenizer_source
from miles_core.prepare.checks import check_disk, check_memory, validate
from miles_core.prepare.dataset import prepare_dataset
from miles_core.prepare.initial_model import ensure_model
from miles_core.rollout.builtin_tasks import random_policy_reward
from miles_core.rollout.failures import FailureBudget
from miles_core.rollout.prompts import stored_dataset_info
from miles_core.storage import Store, run_root
from miles_core.storage.lease import Lease
from miles_core.weights.snapshot import seal_uri

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_uri: str
    state: str  # finished | segment_done
    first_step: int
    last_step: int | None
    steps_run: int
    weight_version: int  # -1 when nothing ran (a finished run)
    seconds: float


def run_training(cfg: RunConfig, *, eval_follower_after: bool = False) -> TrainResult:
    """`eval_follower_after`: the eval follower runs after this segment (a local workflow), not beside it."""
    validate(cfg)
    store = Store(cfg.run_uri)
    done = _finished(cfg, store)
    if done is not None:
        return done
    lease = Lease.acquire(store, ttl_seconds=cfg.run.lease_ttl_seconds, renew_seconds=cfg.run.lease_renew_seconds)
    with lease:
        done = _finished(cfg, store)  # another writer may have finished it while we waited for the lease
        return done if done is not None else _train(cfg, store, lease, eval_follower_after)


def _finished(cfg: RunConfig, store) -> TrainResult | None:
    """The outcome of a run that already reached --num-rollout, else None."""
    status = run_root.read_status(store)
    if status is None or not is_finished(cfg.run, status):  # the same rule the plan's first lines state
        return None
    log.info("run %s finished at step %d: nothing to train (raise --num-rollout to continue it)", cfg.run_uri,
             status.last_step)
    return TrainResult(cfg.run_uri, run_root.FINISHED, status.last_step + 1, status.last_step, 0, -1, 0.0)


def _train(cfg: RunConfig, store, lease, eval_follower_after: bool = False) -> TrainResult:
    run_root.require_first_config(store)
    segment = run_root.next_segment(store)
    run_root.write_config(store, cfg, segment)
    run_root.write_status(store, run_root.RUNNING, last_step=-1, segment=segment)
    try:
        result, version = _run_segment(cfg, store, segment, lease, eval_follower_after)
    except BaseException as e:
        if lease.held:  # a writer that lost the lease writes nothing more
            status = run_root.read_status(store)
            run_root.write_status(store, run_root.FAILED, last_step=status.last_step if status else -1,
                                  segment=segment, message=f"{type(e).__name__}: {e}"[:2000])
            _keep_traceback(store, segment)
        raise
    lease.check()
    state = run_root.FINISHED if result.last_step == cfg.run.total_steps - 1 else run_root.SEGMENT_DONE
    run_root.write_status(store, state, last_step=-1 if result.last_step is None else result.last_step,
                          segment=segment)
    return TrainResult(cfg.run_uri, state, result.first_step, result.last_step, result.steps_run,
                       version, result.seconds)


def _keep_traceback(store, segment: int) -> None:
    """The failure's whole traceback into the run root, and one line saying where: the console ends with
    the error itself, not with the frames that led to it."""
    try:
        where = run_root.write_error(store, segment, traceback.format_exc())
    except Exception as e:  # noqa: BLE001 - the failure being raised matters more than its record
        log.warning("could not keep the traceback in the run root: %s", e)
        return
    print(f"{PREFIX} the traceback of this failure: {where}", file=sys.stderr, flush=True)


def _export_snapshot(board: Switchboard, trainer: TrainerGroup, step: int, uri: str) -> None:
    """An eval snapshot of the trainer's weights at `uri`: every writer rank writes its part; sealed here once
    all answered (miles_core.weights.snapshot)."""
    if not board.wait(trainer.export_hf(step, uri)):
        seal_uri(uri)


def _run_segment(cfg: RunConfig, store, segment: int, lease, eval_follower_after: bool = False,
                 ) -> tuple[LoopResult, int]:
    ensure_ray()
    check_fits(cfg)  # before any actor starts: a run that cannot be placed is refused, never left waiting
    if stored_dataset_info(store) is None:
        prepare_dataset(cfg.data, store, tokenizer_source=tokenizer_source(cfg))
    initial_model = ensure_model(cfg)
    check_memory(cfg, initial_model)
    check_disk(cfg, initial_model)  # in a pod of the tasks' templates: its node-local volume
    with contextlib.ExitStack() as stack:
        timeline = start_timeline(cfg.metrics, store, stack)  # closed last: every role's spans are flushed by then
        stack.enter_context(mirror_feed(cfg, store))  # closed last: its final sweep sees every sink's last part
        cluster = start_cluster(cfg, initial_model, stack)
        trainer, rollout, start_step = cluster.trainer, cluster.rollout, cluster.start_step
        board = Switchboard(watched=[trainer.alive()])
        version = WeightVersion()
        fleet = _fleet_role(cfg, store, lease, stack, cluster, version)
        # Evals on the rollout engines read the version the step published: they need it delivered.
        overlap = cfg.driver == "fully-async" and cfg.eval.eval_mode != "shared"
        pusher = WeightPusher(trainer, rollout, fleet, board, version, interval=cfg.rollout.update_weights_interval,
                              overlap=overlap)
        pusher.first_push(start_step - 1, cluster.restored_version)
        rollout.start().result()
        fleet.reconcile(start_step - 1)  # a target asked for before this segment applies before its first step
        board.every(2.0, fleet.tick)
        sink = stack.enter_context(MetricsSink(store, "trainer"))
        evals = build_eval_scheduler(
            cfg, exporter=functools.partial(_export_snapshot, board, trainer),
            metrics=stack.enter_context(MetricsSink(store, "eval")), shared_engine_urls=cluster.fleet.urls,
            pause_submission=lambda: board.wait(rollout.pause()),
            resume_submission=lambda: board.wait(rollout.resume()), initial_model=initial_model,
            follower_runs_after=eval_follower_after)
        stack.callback(evals.close)
        end_step, end_reason = _end_step(cfg.run, start_step)
        progress = Progress(cfg.run.total_steps, start_step, cfg.run.progress)
        stack.callback(progress.close)
        if start_step == 0:
            sink.log(0, {RANDOM_POLICY_REWARD: _random_policy_level(cfg)})
        feed = feed_publisher(cfg, store, rollout, version, segment, lease.check)
        feed.publish(start_step - 1)  # producers may start before the first step ends
        board.every(cfg.buffer.producer_poll_seconds, feed.refresh)
        roles = Roles(
            driver=cfg.driver, start_step=start_step, end_step=end_step, end_reason=end_reason,
            batches=batch_source(cfg.driver, rollout, board, version, cfg.rollout.update_weights_interval),
            trainer=TrainerRole(trainer, board),
            weights=pusher, fence=lease.check,
            checkpoints=Checkpointer(
                trainer, rollout, board, cfg.train.save_interval, enabled=bool(cfg.train.save),
                on_saved=lambda step: run_root.write_status(store, run_root.RUNNING, last_step=step, segment=segment)),
            evals=evals, metrics=MetricsLog(sink, live_exporters(cfg, stack)), progress=progress,
            deadline=Deadline(cfg.run.deadline_seconds), feed=feed, timeline=timeline, fleet=fleet,
            failures=FailureBudget(cfg.rollout.max_failed_sample_fraction, cfg.rollout.failed_sample_window_steps))
        log.info("%s driver: steps %d..%d, weights v%d", cfg.driver, start_step, end_step - 1, version.exported)
        result = run_loop(roles) if start_step < end_step else LoopResult(start_step, None, 0, "num_rollout", 0.0)
        pusher.settle()
        return result, version.exported


def _fleet_role(cfg: RunConfig, store, lease, stack: contextlib.ExitStack, cluster: Cluster,
                version: WeightVersion) -> FleetReconciler:
    """The engine fleet's role: toward engines/target.json while the run goes on; its last record at the end."""
    role = FleetReconciler(cluster.fleet, cluster.trainer, cluster.rollout, store, version,
                           target=cfg.engine.rollout_num_engines,
                           min_engines=0 if cfg.buffer.allow_rollout_producers else 1, fence=lease.check)
    stack.callback(role.close)  # before the rollout manager stops (registered earlier)
    return role


def live_exporters(cfg: RunConfig, stack: contextlib.ExitStack) -> list:
    """The Prometheus endpoint with --prometheus-port (stopped when the segment ends)."""
    if cfg.metrics.prometheus_port is None:
        return []
    exporter = PrometheusExporter.start(cfg.metrics.prometheus_port, run_id=cfg.run.run_id)
    stack.callback(exporter.close)
    print(f"[miles] live metrics for Prometheus: http://{socket.gethostname()}:{exporter.port}/metrics", flush=True)
    return [exporter]


def _random_policy_level(cfg: RunConfig) -> float:
    """The reward level learning must beat; NaN unless a builtin model runs a builtin task."""
    if not cfg.data.prompt_data.startswith("builtin:") or not cfg.model.hf_checkpoint.startswith("builtin:"):
        return float("nan")
    # no --rollout-max-response-len: answers run to the position limit; random tokens end at EOS long before
    return random_policy_reward(cfg.data.prompt_data, cfg.rollout.rollout_max_response_len or 64)


def _end_step(run: RunSection, start_step: int) -> tuple[int, str]:
    end, reason = run.total_steps, "num_rollout"
    if run.segment_steps is not None and start_step + run.segment_steps < end:
        end, reason = start_step + run.segment_steps, "segment_steps"
    return end, reason
