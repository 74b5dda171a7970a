"""Ray roles of a training run: the trainer worker, the engine fleet and the rollout manager.

Convention: the driver holds Ray actor handles; every `*.remote(...)` call returns a Ray ref and
the driver-side wrappers in `miles_core.driver.roles` block on it (`ray.get`) at once, so the loop
reads sequentially. This module never calls `ray.init` (the Flyte Ray plugin does; local runs
and tests call `ensure_ray`).
"""

from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)


def ensure_ray(num_cpus: int | None = None) -> None:
    """Start a local Ray instance unless one is connected (the Flyte Ray task connects its own)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True,
             configure_logging=False, namespace="miles")


class TrainerWorker:
    """The trainer role (a Ray actor): Megatron model and optimizer, checkpoints, weight pushes.

    Methods block until done. Weight pushes talk to the engines over HTTP from a private event
    loop kept for the actor's lifetime (the engine client's connections belong to that loop).
    """

    def __init__(self, cfg, hf_dir: str, engine_urls: list[str]):
        import torch

        from miles_core.engines.client import EngineClient
        from miles_core.storage import Store
        from miles_core.train.checkpoint import CheckpointManager
        from miles_core.train.trainer import Trainer
        from miles_core.weights.sync import DiskWeightTransport, WeightSync

        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(cfg.run.num_cpus_trainer)))
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.trainer = Trainer(cfg.train, hf_dir, seed=cfg.run.seed)
        self.run_store = Store(cfg.run_uri)
        self.checkpoints = CheckpointManager.from_config(cfg.train, self.run_store)
        self.engines = EngineClient(list(engine_urls))
        # Weights staged for the engines live under weights/ (only the newest is kept); eval
        # snapshots under snapshots/ are exported at the eval cadence by the eval scheduler.
        transport = DiskWeightTransport(self.trainer, self.run_store, prefix="weights",
                                        cache_dir=os.path.join(_local_cache(cfg), "weights"))
        self.sync = WeightSync(engines=[self.engines], transport=transport, publish=lambda v: None,
                               pause_mode=cfg.rollout.pause_generation_mode)
        self.transport = transport

    def train_step(self, step: int, groups: list) -> dict:
        return self.trainer.train_step(step, groups)

    def push_weights(self, step: int) -> dict:
        """§5.4: version += 1, pause, flush unless in_place, load the snapshot, resume."""
        result = self.loop.run_until_complete(self.sync.push(step))
        self._drop_staged_except(self.transport.key)
        from miles_core.metrics import names as N

        return {"version": result.version, "model_path": self.transport.local_path,
                N.WEIGHT_UPDATE_SECONDS: result.total_seconds, N.WEIGHT_EXPORT_SECONDS: result.export_seconds,
                N.ENGINE_PAUSE_SECONDS: result.pause_seconds}

    def set_version(self, version: int) -> None:
        self.sync.version = version

    def save_checkpoint(self, step: int, extras: dict) -> str | None:
        """Trainer state (and, with --save-hf, an HF checkpoint that reuse-mode evals read). The
        driver's Checkpointer owns the cadence, so this always saves."""
        return self.checkpoints.maybe_save(step, self.trainer, extras, last=True)

    def restore_latest(self) -> tuple[int, dict] | None:
        return None if self.checkpoints.store is None else self.checkpoints.load_latest(self.trainer)

    def export_hf(self, step: int, dest_uri: str) -> None:
        """Write the current weights as an HF directory at dest_uri (`.complete` last)."""
        from miles_core.storage import Store
        from miles_core.weights.snapshot import export_snapshot

        export_snapshot(self.trainer, Store(dest_uri), step, key="")

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.engines.close())
        finally:
            self.loop.close()
            self.trainer.close()

    def _drop_staged_except(self, keep_key: str | None) -> None:
        for key in {k.split("/")[1] for k in self.run_store.list("weights") if "/" in k}:
            if keep_key and keep_key.endswith(key):
                continue
            try:
                self.run_store.delete_prefix(f"weights/{key}")
            except Exception as e:  # noqa: BLE001 - staging cleanup never fails a step
                log.warning("could not delete staged weights %s: %s", key, e)


def _local_cache(cfg) -> str:
    from miles_core.storage import Store

    local = Store(cfg.run_uri).local_path("")
    if local:
        return os.path.join(local, ".local")
    return os.path.join(os.path.expanduser("~/.cache/miles"), cfg.run.run_id)


def materialize_initial_model(cfg) -> str:
    """A local HF directory holding the run's initial weights (builtin models are created once)."""
    from miles_core.models.builtin import materialize_checkpoint

    m = cfg.model
    if not m.hf_checkpoint.startswith("builtin:"):
        return m.hf_checkpoint
    out = os.path.join(_local_cache(cfg), "initial_model")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        tmp = out + ".partial"
        materialize_checkpoint(m.hf_checkpoint, cfg.run.seed, tmp, num_layers=m.tiny_num_layers,
                               hidden_size=m.tiny_hidden_size, num_heads=m.tiny_num_heads)
        os.replace(tmp, out)
    return out


def trainer_actor(cfg):
    import ray

    gpus = 1 if cfg.engine.engine_backend == "sglang" else 0
    return ray.remote(num_cpus=cfg.run.num_cpus_trainer, num_gpus=gpus, max_concurrency=1)(TrainerWorker)
