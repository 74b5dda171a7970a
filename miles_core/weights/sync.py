"""Weight sync from the trainer to the rollout engines, keeping in-flight work (docs/fully-async.md).

`WeightSync.push(step, version)` does, in this order (`export` is 1-2, `deliver` the rest):
  1. take the version it is given (the driver owns the number: miles_core.driver.weight_version);
  2. export the snapshot (store transport) -- before the pause, since it reads only the trainer,
     so engines stay paused for the reload alone;
  3. stage it (a transport's optional `stage`), still before the pause, while engines generate:
     the store transport has each engine's node copy the snapshot (`localize`: in place for a
     file:// run root) and each CPU engine read it and build the new model beside the served one,
     so the pause holds the in-memory swap alone. Staging is best effort (an engine without it,
     such as SGLang, or a failed stage, only means that engine loads from disk while paused) and
     never changes what an engine serves;
  4. pause every engine with `pause_generation_mode` (retract | in_place; abort is refused);
  5. load the weights on every engine: each `update_weights_from_disk(local path, version,
     flush_cache=False)` (store: a staged CPU engine swaps in the model it built), or the
     bucketed broadcast of `DistributedWeightTransport` (NCCL on GPU, gloo on CPU), setting the
     weight version without aborting;
  6. resume every engine.
Telling the rollout side is not done here: the driver announces a version once its delivery is done.
Steps 4-6 are `paused_load`, the one pause -> load -> resume of the project (a trainer's delivery, a
producer job following the feed). Engine calls fan out concurrently; any failure resumes the engines
before it propagates, so a failed push never leaves engines paused (an engine that cannot be resumed after a failed load, one
that died with it, is logged: the load's error is the one raised).

No cache flush, in any mode (SGLang 0.5.23, docs/engines.md cites the source): SGLang refuses a flush
while a request is running, so a pause `in_place` (which keeps them running) can never flush -- the
update's own `flush_cache=True` would fail the call after the weights were loaded -- and SGLang
before the paused-waiting exemption refused it while retracted requests wait too. What a flush would
protect against is the radix (prefix) cache handing KV computed by the old weights to a request
prefilled after the update (the shared prompt of a GRPO group); the launcher starts SGLang rollout
engines with `--disable-radix-cache`, so no KV is shared between requests at all: a request prefilled
after the update (new, waiting, or retracted and recomputed) sees only the new weights; a request
kept `in_place` continues on its own KV, which is what in_place means, and its tokens carry their
versions. The CPU engine has no prefix cache.

`EngineControl` is the minimal engine surface this needs (SGLang's native API).
`miles_core.engines.client.EngineClient` implements it over all its engines at once, for SGLang
and the CPU engine server alike, so `engines=[client]` is the usual call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence, runtime_checkable

from miles_core.failures import chaos
from miles_core.metrics import trace
from miles_core.storage import Store
from miles_core.storage.weight_versions import PartStats, PartWriter, localize_weights, sum_reads
from miles_core.weights.snapshot import MARKER, export_version, seal, snapshot_key

log = logging.getLogger(__name__)
PAUSE_MODES = ("retract", "in_place")


@runtime_checkable
class EngineControl(Protocol):
    async def pause_generation(self, mode: str) -> None: ...
    async def continue_generation(self) -> None: ...
    async def update_weights_from_disk(self, model_path: str, weight_version: int, *, flush_cache: bool = False,
                                       abort_all_requests: bool = False) -> None: ...


class WeightTransport(Protocol):
    """How weights reach the engines: `prepare` runs before the pause, `stage` between it and the pause
    (best effort: it must not change what any engine serves; see the module doc), `load` while paused.
    `stage` returns what rebuilding the version read (`sum_reads`; {} when it read nothing of the kind)."""

    def prepare(self, step: int) -> str | None: ...
    async def stage(self, engines: Sequence[EngineControl], version: int) -> dict[str, Any]: ...
    async def load(self, engines: Sequence[EngineControl], version: int) -> None: ...


class WeightSyncError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class PushResult:
    version: int
    snapshot: str | None
    export_seconds: float
    pause_seconds: float
    total_seconds: float
    stage_seconds: float = 0.0  # after the export, before the pause (the transport's `stage`)


@dataclass(frozen=True)
class Exported:
    """A version exported by `WeightSync.export`, not yet delivered to the engines."""
    step: int
    version: int
    snapshot: str | None  # the store transport's run-root URI
    started: float  # perf_counter at the export's start
    seconds: float


class StoreWeightTransport:
    """`--weight-transport store`: the snapshot goes to the run root, each engine copies it to its
    own node and loads it (docs/training.md: nothing local crosses a node).

    `loaders[i](uri, version)` loads on engine i from its node (the engine's Ray actor:
    `EngineActor.load_weights`), and `stagers[i](uri)`, when given, stages it there before the pause
    (`EngineActor.stage_weights`). Without loaders the engines are this node's (tests, benchmarks):
    the snapshot is localized here once (a file:// run root is read in place, never copied) and
    every engine stages, then loads, that local path.
    """

    def __init__(self, trainer, store: Store, *, prefix: str = "snapshots",
                 loaders: Sequence[Callable[[str, int], None]] | None = None,
                 stagers: Sequence[Callable[[str], dict]] | None = None, anchor_interval: int = 20):
        self.trainer, self.store, self.prefix, self.loaders, self.stagers = trainer, store, prefix, loaders, stagers
        self.key: str | None = None
        self.uri: str | None = None
        self.writer = PartWriter(anchor_every=anchor_interval)
        self.written: PartStats | None = None  # what the last `prepare` wrote
        self.read: dict = {}  # what the engines' nodes read to rebuild the last staged version (`sum_reads`)
        self._local: tuple[str, str] | None = None  # (uri, its local path) once localized here

    def prepare(self, step: int) -> str:
        """Export the weight version of `step` (bf16, an anchor or a delta: docs/weight-versions.md; once: a
        push made again after a lost engine reuses it)."""
        key = snapshot_key(step, self.prefix)
        if self.key != key:
            self.written = export_version(self.trainer.hf_state_dict(), self.store, key, self.writer,
                                          aux_files=self.trainer.aux_files)
            seal(self.store, key)
            self.key, self.uri = key, self.store.uri(key)
        return self.uri

    async def stage(self, engines: Sequence[EngineControl], version: int) -> dict[str, Any]:
        """Before the pause: the snapshot on each engine's node, read and built by each engine that can
        (best effort: a failure is logged, and that engine loads from disk while paused). Returns (and
        keeps as `read`) what the engines' nodes read to rebuild it."""
        self.read = {}
        try:
            if self.loaders is not None:
                calls = [asyncio.to_thread(stage, self.uri) for stage in self.stagers or ()]
            else:
                path = await self._localized()
                calls = [e.stage_weights_from_disk(path) for e in engines if hasattr(e, "stage_weights_from_disk")]
            reads = []
            for r in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(r, Exception):
                    log.warning("weights v%d: staging %s failed (the engine loads it while paused): %s",
                                version, self.uri, r)
                elif isinstance(r, BaseException):
                    raise r
                elif isinstance(r, dict):
                    reads.append(r)
            self.read = sum_reads(reads)
        except Exception as e:  # noqa: BLE001 - staging only saves pause time; the load reports real failures
            log.warning("weights v%d: staging %s failed (engines load it while paused): %s", version, self.uri, e)
        return self.read

    async def load(self, engines: Sequence[EngineControl], version: int) -> None:
        if self.loaders is not None:
            await asyncio.gather(*(asyncio.to_thread(load, self.uri, version) for load in self.loaders))
            return
        path = await self._localized()
        await asyncio.gather(*(e.update_weights_from_disk(path, version, flush_cache=False,
                                                          abort_all_requests=False) for e in engines))

    async def _localized(self) -> str:
        """This node's copy of the snapshot (localize: a file:// run root is used in place)."""
        if self._local is None or self._local[0] != self.uri or not os.path.exists(os.path.join(self._local[1], MARKER)):
            uri = self.uri
            self._local = (uri, await asyncio.to_thread(localize_weights, uri))
        return self._local[1]


@dataclass
class WeightSync:
    """Pushes weights to `engines` under the version numbers it is given."""

    engines: Sequence[EngineControl]
    transport: WeightTransport
    pause_mode: str = "retract"
    history: list[PushResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)

    async def push(self, step: int, version: int) -> PushResult:
        """Push the trainer's weights of `step` as `version`; return it with timings.

        `pause_seconds` runs from the pause request to the resume acknowledgement: the longest
        any engine can have been paused.
        """
        return await self.deliver(await self.export(step, version))

    async def export(self, step: int, version: int) -> Exported:
        """Steps 1-2: the transport's export, the part that reads the trainer. What is left (`deliver`)
        reads only what this exported: with the store transport it may run while the trainer goes on."""
        t0 = time.perf_counter()
        with trace.span("export", lane="weights", version=version):
            snapshot = await asyncio.to_thread(self.transport.prepare, step)
        return Exported(step, version, snapshot, t0, time.perf_counter() - t0)

    async def deliver(self, exported: Exported) -> PushResult:
        """Steps 3-6 for an exported version: stage, pause, load, resume."""
        version = exported.version
        t_stage = time.perf_counter()
        with trace.span("stage", lane="weights", version=version) as args:  # engines keep generating meanwhile
            args.update(await self.transport.stage(self.engines, version))  # what rebuilding it read (bf16 deltas)
        t1 = time.perf_counter()
        pause_seconds = await paused_load(self.engines, self.pause_mode, lambda: self.transport.load(self.engines, version),
                                          version)
        result = PushResult(version, exported.snapshot, exported.seconds, pause_seconds,
                            time.perf_counter() - exported.started, t1 - t_stage)
        self.history.append(result)
        log.info("weights v%d pushed at step %d: export %.3fs, staged %.3fs, engines paused %.3fs", version,
                 exported.step, result.export_seconds, result.stage_seconds, result.pause_seconds)
        return result


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise WeightSyncError(f"--pause-generation-mode={mode} cannot keep in-flight work under "
                              f"fully async; use one of {', '.join(PAUSE_MODES)}")


async def paused_load(engines: Sequence[EngineControl], pause_mode: str, load: Callable[[], Awaitable[None]],
                      version: int) -> float:
    """Pause every engine, `load()`, resume every engine: the seconds from the pause request to the last
    resume. Every engine is resumed whatever fails in between, so none stays paused; a resume failure is
    raised unless the load failed (its own error goes on)."""
    span = functools.partial(trace.span, lane="weights", version=version)
    t0 = time.perf_counter()
    try:
        with span("pause"):
            await asyncio.gather(*(e.pause_generation(pause_mode) for e in engines))
        await asyncio.to_thread(chaos.point, "weights.push")  # blocks this delivery only, not its event loop
        with span("load", engines=len(engines)):
            await load()
    finally:
        with span("resume"):
            resumed = await asyncio.gather(*(e.continue_generation() for e in engines), return_exceptions=True)
        _raise_resume_failure(resumed, version)
    return time.perf_counter() - t0


def _raise_resume_failure(resumed: list, version: int) -> None:
    """Raise the first engine's resume failure, unless the push is failing already: then its own error
    goes on (the resume failures are logged), not one about an engine that died along with it."""
    failed = [r for r in resumed if isinstance(r, BaseException)]
    if not failed:
        return
    if sys.exc_info()[1] is None:  # the pause and the load went through: the resume failure is the error
        raise failed[0]
    for r in failed:
        log.error("weights v%d: resuming an engine after the failed push failed too: %s", version, r)
