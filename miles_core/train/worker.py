"""One trainer rank as a Ray actor body: its Megatron model and optimizer, checkpoints, weight pushes.

`miles_core.driver.placement.TrainerGroup` creates one `TrainerWorker` per rank and calls every method on
every rank (collectives need all of them). Roles inside a call:
- every rank trains on its data-parallel shard and takes part in checkpoint saves (barriers);
- exporting weights (engine pushes, eval snapshots, --save-hf) is sourced by global rank 0; the
  other ranks of DP rank 0 (rank 0's TP peers) take part in gathering the TP shards;
- only rank 0 talks to the engines: `--weight-transport store` (a snapshot in the run root that each
  engine's actor copies to its own node and loads) or `distributed` (SGLang's weight-update group,
  NCCL on GPU and gloo on CPU).
Inputs arrive as URIs and are copied to this node (miles_core.storage.node_local); nothing handed out is a
local path.
Methods block until done. Weight pushes talk to the engines over HTTP from a private event loop
kept for the actor's lifetime (the engine client's connections belong to that loop).
"""

from __future__ import annotations

import asyncio
import logging
import os

from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import free_port
from miles_core.metrics import names as N
from miles_core.storage import Store
from miles_core.storage.node_local import localize, require_uri
from miles_core.train.checkpoint import CheckpointManager
from miles_core.train.initial_weights import apply_load, apply_ref_load
from miles_core.train.trainer import Trainer
from miles_core.weights.distributed import DistributedWeightTransport
from miles_core.weights.snapshot import export_snapshot
from miles_core.weights.sync import StoreWeightTransport, WeightSync

log = logging.getLogger(__name__)


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port on it: rank 0's MASTER_ADDR / MASTER_PORT."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")


class TrainerWorker:
    def __init__(self, cfg, hf_uri: str, rank: int, world_size: int, master: tuple[str, int],
                 engine_urls: list[str], engine_actors: list | None = None):
        import torch

        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank % cfg.train.actor_num_gpus_per_node)})
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(cfg.run.num_cpus_trainer)))

        self.cfg, self.rank = cfg, rank
        self.trainer = Trainer(cfg.train, localize(require_uri(hf_uri, "--hf-checkpoint"), "models"),
                               seed=cfg.run.seed, optimizer_steps=cfg.optimizer_steps_per_rollout)
        apply_ref_load(self.trainer, cfg.train.ref_load)
        self.run_store = Store(cfg.run_uri)
        self.checkpoints = CheckpointManager.from_config(cfg.train, self.run_store)
        self.loop = self.engines = self.sync = self.transport = None
        if rank == 0 and engine_urls:  # a trainer without engines (tests, export-only) pushes nothing
            self._connect_engines(engine_urls, engine_actors or [])

    def _connect_engines(self, engine_urls: list[str], engine_actors: list) -> None:
        self.loop = asyncio.new_event_loop()
        # An engine that dies mid-run is restarted by its actor; the push waits for it (control calls
        # retried 0.5 s doubling: ~30 s) instead of failing the segment over a CPU engine's restart.
        self.engines = EngineClient(list(engine_urls), control_retries=6)
        self.transport = self._transport(engine_urls, engine_actors)
        self.sync = WeightSync(engines=[self.engines], transport=self.transport, publish=lambda v: None,
                               pause_mode=self.cfg.rollout.pause_generation_mode)

    def _transport(self, engine_urls: list[str], engine_actors: list):
        e = self.cfg.engine
        if e.weight_transport == "distributed":
            import ray

            return DistributedWeightTransport(
                self.trainer.hf_state_dict, list(engine_urls), master_address=ray.util.get_node_ip_address(),
                backend="nccl" if self.trainer.cuda else "gloo", bucket_bytes=e.update_weight_buffer_size,
                engine_tp_size=e.rollout_num_gpus_per_engine if e.engine_backend == "sglang" else 1,
                engine_generations=lambda: ray.get([a.restart_count.remote() for a in engine_actors]),
                restart_engine=lambda i: ray.get(engine_actors[i].restart.remote()))
        import ray

        # Weights staged for the engines live under weights/ (only the newest is kept); eval
        # snapshots under snapshots/ are exported at the eval cadence by the eval scheduler.
        return StoreWeightTransport(self.trainer, self.run_store, prefix="weights",
                                    loaders=[_loader(ray, a) for a in engine_actors] or None)

    def train_step(self, step: int, groups: list) -> dict:
        return self.trainer.train_step(step, groups)

    def push_weights(self, step: int) -> dict:
        """§5.4: version += 1, pause, flush unless in_place, load the weights, resume (rank 0)."""
        if self.rank != 0:
            self.trainer.join_export()
            return {}
        result = self.loop.run_until_complete(self.sync.push(step))
        if self.transport.key is not None:
            self._drop_staged_except(self.transport.key)

        return {"version": result.version, N.WEIGHT_UPDATE_SECONDS: result.total_seconds,
                N.WEIGHT_EXPORT_SECONDS: result.export_seconds, N.ENGINE_PAUSE_SECONDS: result.pause_seconds}

    def set_version(self, version: int) -> None:
        if self.sync is not None:
            self.sync.version = version

    def save_checkpoint(self, step: int, extras: dict) -> str | None:
        """Trainer state (and, with --save-hf, an HF checkpoint that reuse-mode evals read). The
        driver's Checkpointer owns the cadence, so this always saves."""
        return self.checkpoints.maybe_save(step, self.trainer, extras, last=True)

    def restore_latest(self) -> tuple[int, dict] | None:
        """(step, extras) of this run's latest checkpoint, restored; else --load from elsewhere
        (weights and optimizer only) and None: the run starts at step 0."""
        restored = None if self.checkpoints.store is None else self.checkpoints.load_latest(self.trainer)
        if restored is None:
            apply_load(self.trainer, self.cfg.train.load, self.checkpoints.store)
        return restored

    def export_hf(self, step: int, dest_uri: str) -> None:
        """Write the current weights as an HF directory at dest_uri (`.complete` last)."""
        if self.rank != 0:
            self.trainer.join_export()
            return
        export_snapshot(self.trainer, Store(dest_uri), step, key="")

    def logprobs(self, samples: list) -> list[list[float]]:
        return self.trainer.logprobs(samples)

    def close(self) -> None:
        try:
            if self.loop is not None:
                if hasattr(self.transport, "close"):
                    self.loop.run_until_complete(self.transport.close())
                self.loop.run_until_complete(self.engines.close())
                self.loop.close()
        finally:
            self.trainer.close()

    def _drop_staged_except(self, keep_key: str | None) -> None:
        for key in {k.split("/")[1] for k in self.run_store.list("weights") if "/" in k}:
            if keep_key and keep_key.endswith(key):
                continue
            try:
                self.run_store.delete_prefix(f"weights/{key}")
            except Exception as e:  # noqa: BLE001 - staging cleanup never fails a step
                log.warning("could not delete staged weights %s: %s", key, e)


def _loader(ray, engine_actor):
    """Engine i's loading, done by its actor on its node (`EngineActor.load_weights`)."""
    return lambda uri, version: ray.get(engine_actor.load_weights.remote(uri, version))
