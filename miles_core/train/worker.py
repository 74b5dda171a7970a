"""One trainer rank as a Ray actor body: its Megatron model and optimizer, checkpoints, weight exports.

`miles_core.driver.placement.TrainerGroup` creates one `TrainerWorker` per rank and calls every method on
every rank (collectives need all of them). Roles inside a call:
- every rank trains on its data-parallel shard and takes part in checkpoint saves (barriers);
- exporting weights: the ranks of the first replica (rank 0's TP peers and, under expert parallelism,
  the ranks holding the other experts: expert-DP rank 0) take part in gathering the shards; a snapshot
  in the run root (store pushes, pushes producers read, eval snapshots) is then written in parts, each by
  a rank holding the whole model (`Trainer.export_writer`; without TP or EP every DP rank), and sealed by
  the driver once every rank answered; the distributed broadcast and --save-hf come from global rank 0.
Every push gathers the weights once (rank 0's TP and EP peers join that one gather, on their first call for
the version; see `push_weights`), and a push made again for the same version (the driver's, after a lost
engine) delivers those same weights: no rank gathers twice for a version, so none waits in a gather the
others never make. A push (`push_weights(step, version)`) with `--weight-transport store` is the export alone: the writer
ranks write the version's snapshot into the run root and rank 0 answers its URI; the rollout side delivers it to
the engines (pause, load, resume) on a call the driver holds. With `distributed` rank 0 also delivers
it, here and before it answers (SGLang's weight-update group, NCCL on GPU and gloo on CPU: it reads the
trainer's tensors while the engines are paused). The version number is the driver's
(miles_core.driver.pushes.WeightVersion); a rank keeps none. Which engines exist is the driver's fleet's
(`set_engines`); a push that fails because an engine is gone raises, and the driver decides.
Inputs arrive as URIs and are copied to this node (miles_core.storage.node_local); nothing handed out is a
local path. Methods block until done; `alive` (its own concurrency group) answers only when the rank
closes, so a driver waiting on it learns at once that a rank died.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Callable

from miles_core.engines.client import EngineClient
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.rank_batches import RankBatch, data_layout
from miles_core.storage import Store
from miles_core.storage.node_local import localize, require_uri
from miles_core.storage.weight_versions import PartStats, PartWriter, needed, version_dirs
from miles_core.weights.snapshot import export_part, export_snapshot, export_version, seal, snapshot_key
from miles_core.weights.sync import WeightSync

log = logging.getLogger(__name__)

PRODUCER_GRACE_SECONDS = 120.0  # superseded weights kept for producer jobs still copying them
# An engine that dies mid-run is restarted by its actor; a push waits for it (control calls retried 0.5 s
# doubling: ~30 s) instead of failing the segment over a CPU engine's restart.
ENGINE_CONTROL_RETRIES = 6


class TrainerWorker:
    # The push of one version (`push_weights`): its (step, version), and on rank 0 the weights gathered for it,
    # kept until it was delivered (a push made again after a failed delivery sends them without a new gather).
    _push_key: tuple[int, int] | None = None
    _push_weights: dict | None = None
    _gathered = False  # rank 0 gathered (or began to gather) the weights of `_push_key`

    def __init__(self, cfg, hf_uri: str, rank: int, world_size: int, master: tuple[str, int],
                 engine_urls: list[str], engine_actors: list | None = None,
                 preflight: Callable[..., None] | None = None):
        """`preflight(cfg, model_uri, warn=...)` runs first, before the model is built: the driver passes
        the device-memory check (miles_core.prepare.checks.check_device_memory, a layer above this one)."""
        import torch

        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank % cfg.train.actor_num_gpus_per_node)})
        torch.set_num_threads(cfg.run.rank_threads)  # on GPU too: the export's casts and writes run on the CPU

        self.cfg, self.rank = cfg, rank
        # Before anything is allocated: a trainer that cannot fit this rank's GPU is refused on every rank
        # (a rank left building its model would wait at the rendezvous for one that refused); rank 0 warns.
        if preflight is not None:
            preflight(cfg, require_uri(hf_uri, "--hf-checkpoint"), warn=rank == 0)
        # Here, not at the top: the driver imports this module to define the actor class, and torch and
        # Megatron (seconds of CPU to import) belong in the rank's process only.
        from miles_core.train.checkpoint import CheckpointManager
        from miles_core.train.initial_weights import apply_ref_load
        from miles_core.train.trainer import Trainer

        self.trainer = Trainer(cfg.train, localize(hf_uri, "models"),
                               seed=cfg.run.seed, optimizer_steps=cfg.optimizer_steps_per_rollout)
        layout = data_layout(cfg.train)
        if layout.dp_rank(rank) != self.trainer.dp_rank:  # the parts the rollout side cuts would go astray
            raise RuntimeError(f"rank {rank} is data-parallel rank {self.trainer.dp_rank} in Megatron's groups, "
                               f"but {layout.dp_rank(rank)} in the rollout's DataLayout")
        apply_ref_load(self.trainer, cfg.train.ref_load)
        self.run_store = Store(cfg.run_uri)
        trace.join(cfg.metrics, self.run_store, f"trainer-rank{rank}")
        self.checkpoints = CheckpointManager.from_config(cfg.train, self.run_store)
        self.loop = self.engines = self.sync = None
        self.publish = cfg.buffer.allow_rollout_producers  # every version in the run root, for producer jobs
        # this rank's part of the versions it publishes: bf16 anchors and deltas (docs/weight-versions.md)
        self._versions = PartWriter(anchor_every=cfg.engine.weight_anchor_interval)
        self.distributed = cfg.engine.weight_transport == "distributed"
        self._superseded: dict[str, float] = {}  # staged weights -> when a newer version replaced them
        self._last_key: str | None = None  # the previous push's staged weights
        self._closed = threading.Event()
        if rank == 0 and self.distributed and engine_urls:
            self._connect_engines(engine_urls, engine_actors or [])

    def alive(self) -> None:
        """Answers once the rank closed: the driver keeps this call pending (a concurrency group of its own),
        so a rank that dies ends it with Ray's ActorDiedError where the driver waits."""
        self._closed.wait()

    def _connect_engines(self, engine_urls: list[str], engine_actors: list) -> None:
        import ray

        self._connect(engine_urls, ray.util.get_node_ip_address(),
                      engine_generations=lambda: ray.get([a.restart_count.remote() for a in engine_actors]),
                      restart_engine=lambda i: ray.get(engine_actors[i].restart.remote()))

    def _connect(self, engine_urls: list[str], master_address: str, *, engine_generations, restart_engine,
                 control_retries: int = ENGINE_CONTROL_RETRIES) -> None:
        """The distributed transport's wiring to `engine_urls` (the engines' actors behind the two callables)."""
        self.loop = self.loop or asyncio.new_event_loop()
        e = self.cfg.engine
        from miles_core.weights.distributed import DistributedWeightTransport

        self.engines = EngineClient(list(engine_urls), control_retries=control_retries)
        transport = DistributedWeightTransport(
            self._weights, list(engine_urls), master_address=master_address,
            backend="nccl" if self.trainer.cuda else "gloo", bucket_bytes=e.update_weight_buffer_size,
            engine_tp_size=e.rollout_num_gpus_per_engine if e.engine_backend == "sglang" else 1,
            engine_generations=engine_generations, restart_engine=restart_engine)
        self.sync = WeightSync(engines=[self.engines], transport=transport,
                               pause_mode=self.cfg.rollout.pause_generation_mode)

    def set_engines(self, engine_urls: list[str], engine_actors: list) -> None:
        """The engines a distributed push reaches from now on (the driver's fleet changed; rank 0 forms the
        weight-update group again, with them, at the next push). Nothing to do on other ranks, or with the
        store transport (the rollout side delivers to the engines the driver names)."""
        if self.rank != 0 or not self.distributed:
            return
        self._disconnect_engines()
        if engine_urls:
            self._connect_engines(engine_urls, engine_actors)

    def _disconnect_engines(self) -> None:
        if self.sync is not None:
            self.loop.run_until_complete(self.sync.transport.close())
            self.loop.run_until_complete(self.engines.close())
        self.engines = self.sync = None

    def train_part(self, step: int, part: RankBatch) -> dict:
        """Train on this rank's data-parallel part of the rollout (Ray resolved its reference here)."""
        return self.trainer.train_part(step, part)

    def push_weights(self, step: int, version: int) -> dict:
        """Export the weights of `step` as `version` (rank 0 answers; the others take part in the gather).

        The answer: "snapshot", the run-root URI of the version's weights when they are there (always with
        the store transport, whose delivery the driver then asks of the rollout side; with `distributed`
        when producer jobs may join), and "delivered", whether the engines serve it already (the
        distributed transport delivered it here, pause, broadcast, resume), with the timings.

        One gather per version, on every rank, in the first call for it: rank 0's TP (and EP) peers join it
        and return; rank 0 gathers it (`_weights`) for the broadcast and the snapshot alike, and makes it even
        when its push fails before it would have. A call made again for the same version (the driver's retry
        after a lost engine, `WeightPusher._pushed`) gathers nowhere: rank 0 sends the weights it kept."""
        first = self._push_key != (step, version)
        if first:
            self._push_key, self._push_weights, self._gathered = (step, version), None, False
        if self.rank != 0:
            if first:
                if self._writes_snapshot:
                    part = self._write_part(self.run_store, snapshot_key(step, "weights"), version=True)
                    return {} if part is None else {"part": asdict(part)}
                self.trainer.join_export()
            return {}
        try:
            out = self._push(step, version)
        finally:
            if first and not self._gathered:  # its peers joined one gather for this version: so does rank 0
                self._weights()
        self._push_weights = None  # delivered: views of live parameters must not outlive the push
        return out

    def _push(self, step: int, version: int) -> dict:
        out: dict = {"delivered": False}
        if self.distributed and self.sync is not None:
            result = self.loop.run_until_complete(self.sync.push(step, version))
            out = {"delivered": True, N.WEIGHT_EXPORT_SECONDS: result.export_seconds,
                   N.WEIGHT_UPDATE_SECONDS: result.total_seconds, N.ENGINE_PAUSE_SECONDS: result.pause_seconds}
        elif self.distributed:  # no engine left: the version is made all the same
            out["delivered"] = True
        if self._writes_snapshot:
            t0 = time.perf_counter()
            parts, key = self._parts, snapshot_key(step, "weights")
            with trace.span("export", lane="weights", version=version) as args:
                part = export_version(self._weights(), self.run_store, key, self._versions, 0, parts,
                                      self.trainer.aux_files)
                if parts == 1:
                    seal(self.run_store, key)
                args.update(anchor=part.anchor, bytes=part.bytes, changed=part.changed)
            out.setdefault(N.WEIGHT_EXPORT_SECONDS, time.perf_counter() - t0)
            with trace.span("weights.cleanup", lane="weights", step=step):
                self._drop_staged_except(key)
            out["snapshot"], out["sealed"], out["part"] = self.run_store.uri(key), parts == 1, asdict(part)
        return out

    @property
    def _writes_snapshot(self) -> bool:
        """A push writes the version's weights to the run root: the store transport's delivery reads them,
        and producer jobs (`publish`) load them whatever the transport."""
        return self.publish or not self.distributed

    @property
    def _parts(self) -> int:
        """The parts a snapshot is written in: one per rank that holds the whole model (`Trainer.export_writer`),
        each written by its rank at once; the driver seals it once every rank answered."""
        writer = self.trainer.export_writer
        return writer[1] if writer else 1

    def _write_part(self, store: Store, key: str, *, version: bool = False) -> PartStats | None:
        """A rank but 0, while rank 0 exports a snapshot: its part (joining the gather that makes the whole
        model, with TP or EP peers), or only the gather when it writes none. A weight version's part
        (`version`) is bf16, an anchor or a delta against this rank's part of the version before."""
        writer = self.trainer.export_writer
        if writer is None:  # a rank of another replica: nothing to gather or write
            self.trainer.join_export()
            return None
        with trace.span("export part", lane="weights", part=writer[0]) as args:
            if version:
                part = export_version(self.trainer.hf_state_dict(), store, key, self._versions, *writer)
                args.update(anchor=part.anchor, bytes=part.bytes, changed=part.changed)
                return part
            export_part(self.trainer.hf_state_dict(), store, key, *writer)
        return None

    def _weights(self) -> dict:
        """The HF tensors of the version being pushed: gathered on the first call for it (a TP/EP collective its
        peers join in `push_weights`), the same tensors after."""
        if self._push_weights is None:
            if self._gathered:  # gathering again would wait for peers that gather once per version
                raise RuntimeError(f"the weights of push {self._push_key} were gathered and are gone: "
                                   "a push is made again only after its delivery failed")
            self._gathered = True
            self._push_weights = self.trainer.hf_state_dict()
        return self._push_weights

    def save_checkpoint(self, step: int, extras: dict) -> str | None:
        """Trainer state (and, with --save-hf, an HF checkpoint that reuse-mode evals read). The
        driver's Checkpointer owns the cadence, so this always saves."""
        with trace.span("checkpoint", lane="checkpoint", step=step):
            return self.checkpoints.maybe_save(step, self.trainer, extras, last=True)

    def restore_latest(self) -> tuple[int, dict] | None:
        """(step, extras) of this run's latest checkpoint, restored; else --load from elsewhere
        (weights and optimizer only) and None: the run starts at step 0."""
        from miles_core.train.initial_weights import apply_load

        restored = None if self.checkpoints.store is None else self.checkpoints.load_latest(self.trainer)
        if restored is None:
            apply_load(self.trainer, self.cfg.train.load, self.checkpoints.store)
        return restored

    def export_hf(self, step: int, dest_uri: str) -> bool:
        """Write the current weights as an HF directory at dest_uri, every writer rank its part; whether it is
        sealed (`.complete` written last): when written in parts the caller seals it once every rank answered
        (miles_core.weights.snapshot.seal)."""
        with trace.span("snapshot export", lane="eval", step=step):
            return self._export_hf(step, dest_uri)

    def _export_hf(self, step: int, dest_uri: str) -> bool:
        if self.rank != 0:
            self._write_part(Store(dest_uri), "")
            return True
        parts = self._parts
        export_snapshot(self.trainer, Store(dest_uri), step, key="", parts=parts)
        return parts == 1

    def logprobs(self, samples: list) -> list[list[float]]:
        return self.trainer.logprobs(samples)

    def close(self) -> None:
        self._closed.set()
        try:
            if self.loop is not None:
                self._disconnect_engines()
                self.loop.close()
                self.loop = None  # freed now, not in the teardown Ray interrupts when it ends the actor
        finally:
            self.trainer.close()
            trace.shutdown()

    def _drop_staged_except(self, new_key: str) -> None:
        """Delete staged weights but the new version's and the one before it (what the engines serve until
        the new one is delivered, and what a restarting engine reloads meanwhile). When producers may join, a
        superseded version stays PRODUCER_GRACE_SECONDS after it was superseded: a producer starting or
        loading engines from it right now (it read the feed before this push) still finds it."""
        dirs = version_dirs(self.run_store.list("weights"))
        if self._parts > 1 and new_key.split("/")[-1] in dirs:  # other ranks may be writing delta parts of it still
            dirs[new_key.split("/")[-1]] = True
        # a version stored as a delta needs the versions back to its anchor (docs/weight-versions.md)
        keep = needed(dirs, {k.split("/")[-1] for k in (new_key, self._last_key) if k})
        self._last_key = new_key
        now = time.monotonic()
        for key in sorted(dirs):
            if key in keep:
                continue
            if self.publish and now - self._superseded.setdefault(key, now) < PRODUCER_GRACE_SECONDS:
                continue
            self._superseded.pop(key, None)
            try:
                self.run_store.delete_prefix(f"weights/{key}")
            except Exception as e:  # noqa: BLE001 - staging cleanup never fails a step
                log.warning("could not delete staged weights %s: %s", key, e)
