"""Evaluate stored snapshots on one engine this process starts (the eval follower and backfill).

`SnapshotEvaluator` starts one engine server (CPU engine or SGLang, per --engine-backend) on the
first snapshot it needs, then re-pins that same engine to each next snapshot with
update_weights_from_disk and reads the version back, instead of paying a process start per
snapshot. Each evaluation writes eval/step_{k:08d}/{ds}.json and logs its metrics at the
snapshot's own step; a failure is written as a skip (eval/skipped_{reason}), never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import EngineServer, EngineStartError
from miles_core.eval.datasets import EvalDataset, EvalSampling
from miles_core.eval.evaluate import evaluate_all
from miles_core.eval.modes import EvalJob, Outcome, record_failure, skip_reason
from miles_core.eval.pinning import EvalSkip, check_health, pin, verify_versions
from miles_core.eval.results import record_evals
from miles_core.eval.scheduler import launch_spec
from miles_core.eval.snapshots import SnapshotLayout
from miles_core.storage import Store
from miles_core.storage.node_local import localize

log = logging.getLogger(__name__)


class SnapshotEvaluator:
    """One engine process re-pinned per snapshot. Use as a context manager (it owns the process)."""

    def __init__(self, cfg, *, store: Store, layout: SnapshotLayout, datasets: list[EvalDataset],
                 sampling: EvalSampling, metrics: Any = None, mode: str = "tasks"):
        self.cfg, self.store, self.layout = cfg, store, layout
        self.datasets, self.sampling, self.metrics, self.mode = datasets, sampling, metrics, mode
        self.server = None

    def __enter__(self) -> "SnapshotEvaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def evaluate(self, step: int, version: int | None, *, latest_step: int | None = None,
                 datasets: list[EvalDataset] | None = None) -> Outcome:
        """Evaluate the complete snapshot of `step` on `datasets` (default: all); record and return it."""
        datasets = self.datasets if datasets is None else datasets
        job = EvalJob(step, version, self.layout.uri(step))
        version = version if version is not None else step + 1
        t0 = time.monotonic()
        ctx = _Ctx(self.store, datasets, self.sampling, self.metrics, lambda: step if latest_step is None else latest_step)
        try:
            if not self.layout.is_complete(step):
                raise EvalSkip(f"{job.snapshot_uri} has no completion marker", "ckpt_missing")
            path = self._fetch(step)
            fresh = self._ensure_engine(path, version)
            evals = asyncio.run(self._run(path, version, datasets, fresh))
        except Exception as e:  # noqa: BLE001 - recorded as a skip
            reason, _ = skip_reason(e)
            if reason in ("unhealthy", "crashed") and self.server is not None:
                self.server.stop()  # start afresh on the next snapshot
                self.server = None
            return record_failure(ctx, job, e)
        lag = None if latest_step is None else max(0, latest_step - step)
        metrics = record_evals(self.store, evals, step=step, version=version, snapshot_uri=job.snapshot_uri,
                               datasets=datasets, sampling=self.sampling, mode=self.mode, lag_steps=lag,
                               duration_seconds=time.monotonic() - t0, metrics=self.metrics)
        return Outcome(step, metrics)

    def _fetch(self, step: int) -> str:
        """A local directory of the snapshot on this node (the node cache keeps the last few)."""
        return localize(self.layout.uri(step), "snapshots")  # the layout saw its marker already

    def _ensure_engine(self, path: str, version: int) -> bool:
        """Start the engine on this snapshot unless one runs; True when it was just started."""
        if self.server is not None:
            return False

        server = EngineServer(launch_spec(self.cfg.engine, path, version), name="eval-engine")
        try:
            server.start()
        except EngineStartError as e:
            server.stop()
            raise EvalSkip(f"the eval engine did not start: {e}", "unhealthy") from e
        self.server = server
        return True

    async def _run(self, path: str, version: int, datasets: list[EvalDataset], fresh: bool):
        async with EngineClient([self.server.url],
                                request_timeout_seconds=self.cfg.rollout.engine_request_timeout_seconds) as client:
            if fresh:  # started on this very snapshot and version: loading it again would only cost time
                await check_health(client)
                verify_versions(await client.get_weight_version(), version)
            else:
                await pin(client, path, version)
                self.server.note_weights(path, version)  # a restarted engine comes back on these weights
            evals = await evaluate_all(client, datasets, self.sampling)
        for ev in evals:
            verify_versions({f"responses of {ev.dataset} #{i}": v for i, v in enumerate(ev.weight_versions)}, version)
        return evals


class _Ctx:
    """The slice of modes.EvalContext that failure recording reads."""

    def __init__(self, store, datasets, sampling, metrics, latest_step):
        self.store, self.datasets, self.sampling, self.metrics, self.latest_step = (
            store, datasets, sampling, metrics, latest_step)
