"""One trainer rank as a Ray actor body: its Megatron model and optimizer, checkpoints, weight pushes.

`miles_core.driver.placement.TrainerGroup` creates one `TrainerWorker` per rank and calls every method on
every rank (collectives need all of them). Roles inside a call:
- every rank trains on its data-parallel shard and takes part in checkpoint saves (barriers);
- exporting weights (engine pushes, eval snapshots, --save-hf) is sourced by global rank 0; the
  other ranks of DP rank 0 (rank 0's TP peers) take part in gathering the TP shards, and under
  expert parallelism the ranks holding the other experts (expert-DP rank 0) in gathering those;
- only rank 0 talks to the engines: `--weight-transport store` (a snapshot in the run root that each
  engine's actor copies to its own node and loads) or `distributed` (SGLang's weight-update group,
  NCCL on GPU and gloo on CPU).
Inputs arrive as URIs and are copied to this node (miles_core.storage.node_local); nothing handed out is a
local path.
Methods block until done, but for a push asked not to wait (`push_weights(step, wait=False)`): with the
store transport its delivery to the engines goes on on a thread of the actor while the next step
trains. Weight pushes talk to the engines over HTTP from a private event loop kept for the actor's
lifetime (the engine client's connections belong to that loop); one thread at a time runs it (every
method that touches the engines waits for the delivery in flight first).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import free_port, lost_actors
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.storage import Store
from miles_core.storage.node_local import localize, require_uri
from miles_core.train.checkpoint import CheckpointManager
from miles_core.train.initial_weights import apply_load, apply_ref_load
from miles_core.weights.distributed import DistributedWeightTransport
from miles_core.weights.snapshot import export_snapshot
from miles_core.weights.sync import Exported, StoreWeightTransport, WeightSync

log = logging.getLogger(__name__)

PRODUCER_GRACE_SECONDS = 120.0  # superseded weights kept for producer jobs still copying them


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port on it: rank 0's MASTER_ADDR / MASTER_PORT."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")


class TrainerWorker:
    def __init__(self, cfg, hf_uri: str, rank: int, world_size: int, master: tuple[str, int],
                 engine_urls: list[str], engine_actors: list | None = None,
                 preflight: Callable[..., None] | None = None):
        """`preflight(cfg, model_uri, warn=...)` runs first, before the model is built: the driver passes
        the device-memory check (miles_core.prepare.checks.check_device_memory, a layer above this one)."""
        import torch

        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank % cfg.train.actor_num_gpus_per_node)})
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(cfg.run.num_cpus_trainer)))

        self.cfg, self.rank = cfg, rank
        # Before anything is allocated: a trainer that cannot fit this rank's GPU is refused on every rank
        # (a rank left building its model would wait at the rendezvous for one that refused); rank 0 warns.
        if preflight is not None:
            preflight(cfg, require_uri(hf_uri, "--hf-checkpoint"), warn=rank == 0)
        # Here, not at the top: the driver imports this module to define the actor class, and Megatron (seconds
        # of CPU to import) belongs in the rank's process only.
        from miles_core.train.trainer import Trainer

        self.trainer = Trainer(cfg.train, localize(hf_uri, "models"),
                               seed=cfg.run.seed, optimizer_steps=cfg.optimizer_steps_per_rollout)
        apply_ref_load(self.trainer, cfg.train.ref_load)
        self.run_store = Store(cfg.run_uri)
        trace.join(cfg, self.run_store, f"trainer-rank{rank}")
        self.checkpoints = CheckpointManager.from_config(cfg.train, self.run_store)
        self.loop = self.engines = self.sync = self.transport = None
        self.engine_urls, self.engine_actors = [], []
        self.version = 0  # the weight version of the last push (the engines' sync keeps it when there are engines)
        self.publish = cfg.buffer.allow_rollout_producers  # every version in the run root, for producer jobs
        self.snapshot: str | None = None
        self._superseded: dict[str, float] = {}  # staged weights -> when a newer version replaced them
        self.publish_version: Callable[[int], None] | None = None  # tells the rollout side (`set_rollout`)
        self._deliveries = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-delivery")
        self._delivering: Future | None = None  # a push's delivery to the engines, in flight
        self._unreported: dict = {}  # a settled delivery's metrics, for the next push's answer
        if rank == 0 and engine_urls:  # a trainer without engines (tests, export-only) pushes nothing
            self._connect_engines(engine_urls, engine_actors or [])

    def _connect_engines(self, engine_urls: list[str], engine_actors: list) -> None:
        self.loop = self.loop or asyncio.new_event_loop()
        self.engine_urls, self.engine_actors = list(engine_urls), list(engine_actors)
        # An engine that dies mid-run is restarted by its actor; the push waits for it (control calls
        # retried 0.5 s doubling: ~30 s) instead of failing the segment over a CPU engine's restart.
        self.engines = EngineClient(list(engine_urls), control_retries=6)
        self.transport = self._transport(engine_urls, engine_actors)
        self.sync = WeightSync(engines=[self.engines], transport=self.transport, publish=self._publish,
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
                                    loaders=[_loader(ray, a) for a in engine_actors] or None,
                                    stagers=[_stager(ray, a) for a in engine_actors] or None)

    def set_engines(self, engine_urls: list[str], engine_actors: list) -> int | None:
        """The fleet changed (rank 0; the other ranks have nothing to do): every later push reaches exactly
        these engines (the distributed transport forms its group again, with them, at the next push).
        Returns the version of the last push: an engine that holds it is as current as the others."""
        if self.rank != 0:
            return None
        self._settle()
        return self._set_engines(engine_urls, engine_actors)

    def _set_engines(self, engine_urls: list[str], engine_actors: list) -> int:
        staged = self.transport if isinstance(self.transport, StoreWeightTransport) else None
        self._disconnect_engines()
        if engine_urls:
            self._connect_engines(engine_urls, engine_actors)
            self.sync.version = self.version
            if staged is not None and isinstance(self.transport, StoreWeightTransport):
                self.transport.key, self.transport.uri = staged.key, staged.uri  # still what the engines hold
        return self.version

    def staged_weights(self) -> dict | None:
        """{"uri", "version"} of the last pushed weights when they are in the run root (the store transport's
        staged snapshot, or the weights published for producer jobs): what a joining engine loads before
        it serves. None otherwise (rank 0 only): a joining engine then gets them at the next push."""
        self._settle()
        staged = self.transport.uri if isinstance(self.transport, StoreWeightTransport) else None
        uri = staged or self.snapshot
        return {"uri": uri, "version": self.version} if self.rank == 0 and uri else None

    def _disconnect_engines(self) -> None:
        if self.sync is not None:
            if hasattr(self.transport, "close"):
                self.loop.run_until_complete(self.transport.close())
            self.loop.run_until_complete(self.engines.close())
        self.engines = self.sync = self.transport = None
        self.engine_urls, self.engine_actors = [], []

    def _deliver_surviving(self, exported: Exported):
        """The delivery to the engines still there: one whose actor is gone (its node lost, its process
        killed) is dropped after a delivery that failed, which is then made once more without it (under
        the same version). None when no engine is left."""
        try:
            return self.loop.run_until_complete(self.sync.deliver(exported))
        except Exception:
            if not self._drop_lost_engines():
                raise
        log.warning("weights: engines were lost during the push; pushing again to the %d left", len(self.engine_urls))
        if self.sync is None:
            return None
        if isinstance(self.transport, StoreWeightTransport):  # the new transport holds the same snapshot
            return self.loop.run_until_complete(self.sync.deliver(exported))
        return self.loop.run_until_complete(self.sync.push(exported.step))  # gathered again for the new group

    def _drop_lost_engines(self) -> bool:
        gone = set(lost_actors(self.engine_actors))
        if not gone:
            return False
        log.warning("engines %s are gone (their actors died): later pushes leave them out",
                    [self.engine_urls[i] for i in sorted(gone)])
        keep = [i for i in range(len(self.engine_urls)) if i not in gone]
        self._set_engines([self.engine_urls[i] for i in keep], [self.engine_actors[i] for i in keep])
        return True

    def train_step(self, step: int, groups: list) -> dict:
        return self.trainer.train_step(step, groups)

    def push_weights(self, step: int, wait: bool = True) -> dict:
        """version += 1, then the engines load it (pause, load, resume: rank 0) and the rollout side is
        told (once the driver gave it: `set_rollout`; "published" then says so); with producers allowed the
        version's weights are in the run root too ("snapshot": their URI), whatever the transport. Without
        engines (all generation by producer jobs) the push is that export alone.

        `wait=False` returns once the store transport exported the version: its delivery (stage, pause,
        load, resume, tell the rollout side) reads only that snapshot and goes on on a thread of this
        actor while the trainer trains the next step. The next push, and every call that touches the
        engines, waits for it first and raises its failure; its timings come with the next push's metrics.
        Other transports read the trainer's tensors while the engines are paused: they always wait."""
        if self.rank != 0:
            for _ in range(self._exports_per_push()):
                self.trainer.join_export()
            return {}
        self._settle()
        settled, self._unreported = self._unreported, {}
        out = self._push_to_engines(step, wait) if self.sync is not None else None
        exported = out is not None
        out = out or {"version": self.version + 1}
        staged = out.pop("staged", None)
        self.version = out["version"]
        published = self._published(step, staged)
        self._gather_as_peers_do(int(exported) + int(published is not None and staged is None))
        self.snapshot = published or self.snapshot
        return settled | out | ({"snapshot": self.snapshot} if self.snapshot else {})

    def set_rollout(self, rollout_actor) -> None:
        """The rollout manager's actor: each delivered version is published to it as soon as the engines
        serve it (a push that does not wait could not leave that to the driver)."""
        import ray

        self.publish_version = lambda version: ray.get(rollout_actor.set_version.remote(version))

    def _publish(self, version: int) -> None:
        if self.publish_version is not None:
            self.publish_version(version)

    def delivered(self) -> int:
        """The version of the last push, once every engine of the trainer's set holds it: waits for the
        delivery in flight (raising its failure). The fleet asks before an engine serves or leaves."""
        self._settle()
        return self.version

    def check_delivery(self) -> None:
        """Raise the failure of a delivery that ended in one; one still in flight is not waited for. The
        driver asks while it waits for a batch: the groups of a version come only once it was delivered."""
        if self._delivering is not None and self._delivering.done():
            self._settle()

    def _settle(self) -> None:
        """Wait for the delivery in flight, raising its failure; its metrics, with how long this waited,
        go with the next push's answer."""
        pending, self._delivering = self._delivering, None
        if pending is None:
            return
        t0 = time.perf_counter()
        with trace.span("weights.wait", lane="weights"):
            out = pending.result()
        self._unreported = {k: v for k, v in out.items() if k.startswith("perf/")} | {
            N.WEIGHT_DELIVERY_WAIT_SECONDS: time.perf_counter() - t0}

    def _gather_as_peers_do(self, made: int) -> None:
        """Rank 0's TP (and EP) peers take part in `_exports_per_push()` weight gathers every push; when
        rank 0 made fewer (no engine left, nothing to publish), it joins the rest, so no peer waits for ever."""
        if getattr(self.trainer, "exports_with_peers", False):
            for _ in range(self._exports_per_push() - made):
                self.trainer.hf_state_dict()

    def published_weights(self) -> str | None:
        """The run-root URI of the last pushed version's weights when producers may join, else None."""
        return self.snapshot

    def _push_to_engines(self, step: int, wait: bool) -> dict | None:
        """Export the next version and deliver it, here or (`wait=False`, the store transport) on the
        delivery thread. None when no engine is left to push to."""
        with trace.span("engines.check", lane="weights", step=step):
            self._drop_lost_engines()
        if self.sync is None:
            return None
        self.sync.version = max(self.sync.version, self.version)
        exported = self.loop.run_until_complete(self.sync.export(step))
        staged = {"staged": exported.snapshot} if isinstance(self.transport, StoreWeightTransport) else {}
        if wait or not staged:
            return self._deliver(exported) | staged
        self._delivering = self._deliveries.submit(self._deliver, exported)
        return self._pushed(exported) | staged

    def _deliver(self, exported: Exported) -> dict:
        """Deliver `exported`, drop superseded staged weights, and tell the rollout side (also when no
        engine was left to load it)."""
        result = self._deliver_surviving(exported)
        if isinstance(self.transport, StoreWeightTransport) and self.transport.key is not None:
            with trace.span("weights.cleanup", lane="weights", step=exported.step):
                self._drop_staged_except(self.transport.key)
        if result is None:  # every engine was lost
            self._publish(exported.version)
            return self._pushed(exported)
        return self._pushed(exported) | {N.WEIGHT_UPDATE_SECONDS: result.total_seconds,
                                         N.ENGINE_PAUSE_SECONDS: result.pause_seconds}

    def _pushed(self, exported: Exported) -> dict:
        """A push's answer once `exported`: its version, the export's seconds, whether this trainer tells the
        rollout side (else the driver does)."""
        return {"version": exported.version, N.WEIGHT_EXPORT_SECONDS: exported.seconds,
                "published": self.publish_version is not None}

    def _exports_per_push(self) -> int:
        """Weight gathers rank 0 makes per push (its TP peers take part in each): one, and a second when
        the distributed transport's broadcast is followed by the run-root export for producers."""
        return 2 if self.publish and self.cfg.engine.weight_transport == "distributed" else 1

    def _published(self, step: int, staged: str | None) -> str | None:
        """The run-root URI of this version's weights when producers may join (exported here unless the
        store transport's push just staged them: `staged`), else None."""
        if not self.publish:
            return None
        if staged is not None:
            return staged
        key = export_snapshot(self.trainer, self.run_store, step, prefix="weights")
        self._drop_staged_except(key)
        return self.run_store.uri(key)

    def set_version(self, version: int) -> None:
        self._settle()
        self.version = version
        if self.sync is not None:
            self.sync.version = version

    def save_checkpoint(self, step: int, extras: dict) -> str | None:
        """Trainer state (and, with --save-hf, an HF checkpoint that reuse-mode evals read). The
        driver's Checkpointer owns the cadence, so this always saves."""
        with trace.span("checkpoint", lane="checkpoint", step=step):
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
        with trace.span("snapshot export", lane="eval", step=step):
            self._export_hf(step, dest_uri)

    def _export_hf(self, step: int, dest_uri: str) -> None:
        if self.rank != 0:
            self.trainer.join_export()
            return
        export_snapshot(self.trainer, Store(dest_uri), step, key="")

    def logprobs(self, samples: list) -> list[list[float]]:
        return self.trainer.logprobs(samples)

    def close(self) -> None:
        try:
            try:
                self._settle()
            except Exception as e:  # noqa: BLE001 - closing goes on; the driver raised its own error already
                log.warning("weights: the last delivery to the engines failed: %s", e)
            self._deliveries.shutdown()
            if self.loop is not None:
                self._disconnect_engines()
                self.loop.close()
                self.loop = None  # freed now, not in the teardown Ray interrupts when it ends the actor
        finally:
            self.trainer.close()
            trace.shutdown()

    def _drop_staged_except(self, keep_key: str | None) -> None:
        """Delete staged weights but `keep_key`'s. When producers may join, a superseded version stays
        PRODUCER_GRACE_SECONDS after it was superseded: a producer starting or loading engines from it
        right now (it read the feed before this push) still finds it."""
        staged = sorted({k.split("/")[1] for k in self.run_store.list("weights") if "/" in k})
        now = time.monotonic()
        for key in staged:
            if keep_key and keep_key.endswith(key):
                continue
            if self.publish and now - self._superseded.setdefault(key, now) < PRODUCER_GRACE_SECONDS:
                continue
            self._superseded.pop(key, None)
            try:
                self.run_store.delete_prefix(f"weights/{key}")
            except Exception as e:  # noqa: BLE001 - staging cleanup never fails a step
                log.warning("could not delete staged weights %s: %s", key, e)


def _loader(ray, engine_actor):
    """Engine i's loading, done by its actor on its node (`EngineActor.load_weights`)."""
    return lambda uri, version: ray.get(engine_actor.load_weights.remote(uri, version))


def _stager(ray, engine_actor):
    """Engine i's staging before the pause, done by its actor on its node (`EngineActor.stage_weights`)."""
    return lambda uri: ray.get(engine_actor.stage_weights.remote(uri))
