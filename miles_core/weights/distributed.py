"""The `distributed` weight transport: SGLang's weight-update protocol, NCCL on GPU, gloo on CPU.

The trainer (global rank 0) and every engine rank form one process group outside the trainer's own
world, then the trainer broadcasts the HF tensors bucket by bucket:

1. form the group (when there is none, when an engine was restarted since, or after a failed push):
   `/destroy_weights_update_group` on every engine (an old group, if any, goes), then
   `/init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name,
   backend} to every engine concurrently while the trainer joins as rank 0 on a fresh free port of
   `master_address`. World = 1 + sum of engine TP sizes; engine i's TP ranks start at
   rank_offset = 1 + i * engine_tp_size (SGLang adds its TP rank to the offset).
2. SGLang 0.5.23's weight-update session: `/end_weight_update` (best effort, unless the last push
   closed every session itself: closes one a failed push left open), then `/begin_weight_update`
   {selector: "all"} on every engine; SGLang refuses
   `/update_weights_from_distributed` outside a session (weight_updater.py).
3. per bucket of at most `bucket_bytes` (a larger tensor goes alone), `/update_weights_from_distributed`
   {names, dtypes, shapes, group_name, flush_cache: false[, weight_version][, load_format]} to every
   engine concurrently with `broadcast(src=0)` of the same tensors in the same order: one broadcast per
   tensor, or with `flatten` (SGLang's load_format="flattened_bucket"; the default over gloo, where a
   broadcast's fixed cost is high) one broadcast of a uint8 buffer holding the bucket's tensors' bytes
   one after another, copied there by `prepare` (before the pause, while engines generate). The
   buffers are kept for the next push (fresh memory costs more than the copy into it), so the
   trainer holds one more copy of the weights' bytes with `flatten`.
4. `/end_weight_update` on every engine.

The per-bucket version rule: SGLang sets `weight_version` after every successful call that carries
one, so only the LAST bucket carries it (as a string, like `/update_weights_from_disk`). An engine
that fails part-way keeps advertising the old version, never a version whose weights it lacks.

Failures: no HTTP call is retried (a second request would wait forever in a broadcast). Every HTTP
call and every broadcast are bounded by `timeout_seconds`, the broadcast by this transport itself: it
polls the broadcast's works from the event loop and gives up at the bound (at once when an engine's
call of the same bucket failed). The group's own timeout is never what ends a push: the trainer's side
is formed with GROUP_TIMEOUT_FACTOR times the bound (the rendezvous waits that long), and with
TORCH_NCCL_ASYNC_ERROR_HANDLING=0 for this group alone, so on NCCL a failed or stuck broadcast is
neither torn down by NCCL's watchdog (which ends the trainer's process) nor cleaned up by it. When a
push fails, the trainer ABORTS its side of the group (`abort_custom_process_group`: destroying an NCCL
group waits for its pending broadcast, aborting ends it) and drops the engines' sides, every engine that did not answer in time (connection error, timeout, 5xx) is
restarted with `restart_engine(i)` unless its launcher already restarted it since the group formed,
the group is formed again and the whole push is retried once; if that fails too, `WeightPushError`
names the engines. "Did not answer in time" includes a live engine left waiting in a broadcast that a
dead peer broke: nothing releases such a receive before the group's timeout (destroying or aborting a
gloo group does not; measured on torch 2.13), and SGLang forms its groups with torch's 30-minute
default, so a restart is the only bounded way back. Engines that answered `success: false` are alive
(their receive failed cleanly) and simply rejoin.

The process-group helpers both sides use live in `miles_core.engines.weight_group`.

Only global rank 0 of the trainer holds this transport (miles_core.train.worker): its `prepare`
gathers the full HF tensors, a TP collective its TP peers join through `Trainer.join_export` (the
worker gathers once per version: a push made again after a lost engine gets the same tensors); it
alone talks to the engines and broadcasts. (`prepare`/`load` also do nothing harmful on another
rank: they keep no tensors and return.)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from miles_core.engines.client import EngineClient, EngineControlError, EngineUnavailableError
from miles_core.engines.launcher import free_port
from miles_core.engines.weight_group import broadcast_bucket  # noqa: F401 - the engine side's, re-exported
from miles_core.engines.weight_group import (abort_custom_process_group, destroy_custom_process_group,
                                             init_custom_process_group, start_broadcast, wait_bounded)

log = logging.getLogger(__name__)

BUCKET_BYTES = 512 << 20
GROUP_NAME = "miles-weights"
# The trainer's side of the group is formed with this many times `timeout_seconds`: the transport's own
# bound on every broadcast (`timeout_seconds`) then always ends a stuck push, and aborts the group, before
# the group's timeout could (on NCCL its watchdog would tear the trainer's process down).
GROUP_TIMEOUT_FACTOR = 2


class WeightPushError(RuntimeError):
    """The distributed push failed twice (once, then once more after restarting and rejoining)."""

    def __init__(self, message: str):
        super().__init__(message)


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `bucket_bytes`; a tensor larger than that goes alone."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    bucket, size = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        out.append(bucket)
    return out


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class _Failure:
    """What went wrong in one attempt: per engine index, a message; `silent` did not answer at all."""

    messages: dict[int, str] = field(default_factory=dict)
    silent: set[int] = field(default_factory=set)
    trainer: str = ""

    def add(self, i: int, e: BaseException) -> None:
        self.messages[i] = str(e) or type(e).__name__
        if not isinstance(e, EngineControlError) or isinstance(e, EngineUnavailableError):
            self.silent.add(i)

    def __bool__(self) -> bool:
        return bool(self.messages or self.trainer)

    def describe(self, urls: list[str]) -> str:
        parts = [f"engine {i} ({urls[i]}): {m}" for i, m in sorted(self.messages.items())]
        if self.trainer:
            parts.append(f"trainer (rank 0): {self.trainer}")
        return "; ".join(parts)


class _AttemptFailed(Exception):
    def __init__(self, failure: _Failure):
        super().__init__("push attempt failed")
        self.failure = failure


class DistributedWeightTransport:
    """Pushes `state_fn()` to the engines at `engine_urls` over one process group (module doc)."""

    local_path = None  # no local snapshot with this transport
    key = None

    def __init__(self, state_fn: Callable[[], dict[str, torch.Tensor]], engine_urls: list[str], *,
                 master_address: str, backend: str, bucket_bytes: int, engine_tp_size: int = 1,
                 timeout_seconds: float = 120.0, engine_generations: Callable[[], list[int]] | None = None,
                 restart_engine: Callable[[int], None] | None = None, group_name: str = GROUP_NAME,
                 flatten: bool | None = None):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r}; expected nccl (GPU) or gloo (CPU)")
        if not engine_urls:
            raise ValueError("DistributedWeightTransport needs at least one engine URL")
        if bucket_bytes <= 0 or engine_tp_size <= 0 or timeout_seconds <= 0:
            raise ValueError("bucket_bytes, engine_tp_size and timeout_seconds must be positive")
        self.state_fn, self.engine_urls = state_fn, [u.rstrip("/") for u in engine_urls]
        self.master_address, self.backend, self.bucket_bytes = master_address, backend, bucket_bytes
        self.engine_tp_size, self.timeout_seconds = engine_tp_size, timeout_seconds
        self.engine_generations, self.restart_engine = engine_generations, restart_engine
        self.group_name = group_name
        self.flatten = backend == "gloo" if flatten is None else flatten
        self._flat: dict[tuple, torch.Tensor] = {}  # a bucket's names -> its flat buffer (with `flatten`)
        self._sessions_closed = False  # the last push ended every engine's weight-update session
        self._filled: set[tuple] = set()  # buckets (by names) whose flat buffer prepare() filled
        self.group = None  # the trainer's side of the group, None when there is none
        self.group_generations: list[int] | None = None  # engine_generations() when the group formed
        self.state: dict[str, torch.Tensor] | None = None
        self.history: list[dict] = []  # per load: buckets, bytes, attempts, group formations (for tests/bench)

    # ---- WeightTransport ----------------------------------------------------------------------
    def prepare(self, step: int) -> None:
        """Gather the HF tensors (a TP collective on the trainer: every TP peer calls this) and keep them;
        with `flatten`, also copy each bucket into its flat buffer now, before the pause."""
        state = self.state_fn()
        self.state = state if self._is_source() else None
        if self.state is not None and not self.state:
            raise WeightPushError("state_fn() returned no tensors; nothing to push")
        self._filled = set()
        if self.state is not None and self.flatten:
            for bucket in buckets(self.state, self.bucket_bytes):
                self._flattened(bucket)
                self._filled.add(tuple(n for n, _ in bucket))
        return None

    async def stage(self, engines, version: int) -> dict:
        """Nothing to stage: the tensors travel while the engines are paused."""
        return {}

    async def load(self, engines, version: int) -> None:
        """Push the prepared tensors as `version` (engines are paused). `engines` is ignored: each engine
        joins at its own rank offset, so this talks to `engine_urls` one client per engine."""
        if not self._is_source():
            return
        if self.state is None:
            raise WeightPushError("load() before prepare(): no tensors to push")
        record = {"version": version, "attempts": 0, "formed": 0, "buckets": [], "failures": []}
        self.history.append(record)
        try:
            first = await self._attempt(version, record)
            if first is None:
                return
            log.warning("weights v%d: push failed (%s); restarting what did not answer and retrying once",
                        version, first.describe(self.engine_urls))
            await self._restart_silent(first)
            second = await self._attempt(version, record)
            if second is not None:
                raise WeightPushError(f"weights v{version} did not reach every engine, also after restarting "
                                      f"and rejoining: {second.describe(self.engine_urls)} "
                                      f"(first attempt: {first.describe(self.engine_urls)})")
        finally:
            self.state, self._filled = None, set()  # views of live parameters must not outlive the push

    async def close(self) -> None:
        """Destroy the group on every engine that answers, then the trainer's side."""
        if self._is_source():
            async with _Clients(self.engine_urls) as clients:
                await self._destroy_remote(clients)
        destroy_custom_process_group(self.group)
        self.group, self.group_generations = None, None

    # ---- one attempt ----------------------------------------------------------------------------
    async def _attempt(self, version: int, record: dict) -> _Failure | None:
        """Form the group if needed and send every bucket; the failure, or None when every engine has it."""
        record["attempts"] += 1
        async with _Clients(self.engine_urls) as clients:
            try:
                if self._needs_group():
                    await self._form_group(clients)
                    record["formed"] += 1
                parts = buckets(self.state, self.bucket_bytes)
                keep = {tuple(n for n, _ in b) for b in parts}
                for names in [names for names in self._flat if names not in keep]:
                    del self._flat[names]  # buffers of buckets this push no longer has
                record["buckets"] = [[n for n, _ in b] for b in parts]
                if not self._sessions_closed:
                    await self._end_sessions(clients)  # one a failed push left open; none is fine
                self._sessions_closed = False
                await self._each(clients, lambda c: c.begin_weight_update(timeout_seconds=self.timeout_seconds))
                for k, bucket in enumerate(parts):
                    await self._send_bucket(clients, bucket, str(version) if k == len(parts) - 1 else None)
                await self._each(clients, lambda c: c.end_weight_update(timeout_seconds=self.timeout_seconds))
                self._sessions_closed = True  # by this push: the next one need not close a leftover
            except _AttemptFailed as e:
                self._drop_group()
                record["failures"].append(e.failure.describe(self.engine_urls))
                return e.failure
            except BaseException:
                self._drop_group()  # whatever broke, the next push starts from a fresh group
                raise
        return None

    def _needs_group(self) -> bool:
        if self.group is None:
            return True
        return self.engine_generations is not None and list(self.engine_generations()) != self.group_generations

    async def _form_group(self, clients: list[EngineClient]) -> None:
        self._drop_group()
        await self._destroy_remote(clients)
        generations = list(self.engine_generations()) if self.engine_generations is not None else None
        port = free_port(self.master_address)
        world = 1 + len(clients) * self.engine_tp_size
        log.info("forming weight-update group %s on %s:%d (world %d, %s)", self.group_name, self.master_address,
                 port, world, self.backend)
        calls = [c.init_weights_update_group(self.master_address, port, 1 + i * self.engine_tp_size, world,
                                             self.group_name, self.backend, timeout_seconds=self.timeout_seconds)
                 for i, c in enumerate(clients)]
        join = asyncio.to_thread(init_custom_process_group, backend=self.backend,
                                 init_method=f"tcp://{self.master_address}:{port}",
                                 timeout=timedelta(seconds=GROUP_TIMEOUT_FACTOR * self.timeout_seconds),
                                 world_size=world, rank=0, group_name=self.group_name,
                                 nccl_watchdog_handles_errors=False)
        *answers, mine = await asyncio.gather(*calls, join, return_exceptions=True)
        failure = self._failures(answers)
        if isinstance(mine, BaseException):
            failure.trainer = f"joining the group: {mine}"
        else:
            self.group = mine
        if failure:
            raise _AttemptFailed(failure)
        self.group_generations = generations

    async def _send_bucket(self, clients: list[EngineClient], bucket: list[tuple[str, torch.Tensor]],
                           weight_version: str | None) -> None:
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        if self.flatten:  # filled by prepare() (before the pause), else now
            filled = tuple(names) in self._filled
            tensors = [self._flat[tuple(names)] if filled else self._flattened(bucket)]
        else:
            tensors = [self._on_device(t) for _, t in bucket]
        calls = [c.update_weights_from_distributed(names, dtypes, shapes, self.group_name, flush_cache=False,
                                                   weight_version=weight_version,
                                                   load_format="flattened_bucket" if self.flatten else None,
                                                   timeout_seconds=self.timeout_seconds) for c in clients]
        sent = asyncio.ensure_future(self._broadcast(tensors))
        failure = self._failures(await asyncio.gather(*calls, return_exceptions=True))
        if failure:  # an engine that failed will not take part: no use waiting for the broadcast
            sent.cancel()
        try:
            await sent
        except asyncio.CancelledError:
            if not failure:
                raise
        except Exception as e:  # noqa: BLE001 - the attempt fails naming it; the group is aborted
            failure.trainer = f"broadcast: {e}"
        if failure:
            raise _AttemptFailed(failure)

    async def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's side of one bucket, bounded by `timeout_seconds` here, never by the group's timeout (module
        doc): TimeoutError past it, the works left pending for `_drop_group` to abort."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        issue = asyncio.ensure_future(asyncio.to_thread(start_broadcast, tensors, self.group))
        done, _ = await asyncio.wait({issue}, timeout=self.timeout_seconds)  # NCCL may connect here
        if not done:
            raise TimeoutError(f"the broadcast was not issued within {self.timeout_seconds:g} s")
        await wait_bounded(issue.result(), max(0.0, deadline - loop.time()))

    async def _each(self, clients: list[EngineClient], call) -> None:
        """`call(client)` on every engine concurrently; _AttemptFailed naming those that failed."""
        failure = self._failures(await asyncio.gather(*(call(c) for c in clients), return_exceptions=True))
        if failure:
            raise _AttemptFailed(failure)

    async def _end_sessions(self, clients: list[EngineClient]) -> None:
        """Best effort: close a weight-update session left open (an engine without one answers 400)."""
        await asyncio.gather(*(c.end_weight_update(timeout_seconds=self.timeout_seconds) for c in clients),
                             return_exceptions=True)

    # ---- recovery -------------------------------------------------------------------------------
    async def _restart_silent(self, failure: _Failure) -> None:
        """Restart every engine that did not answer, unless the launcher already did since the group formed."""
        if not failure.silent or self.restart_engine is None:
            return
        now = list(self.engine_generations()) if self.engine_generations is not None else None
        todo = []
        for i in sorted(failure.silent):
            if now is not None and self.group_generations is not None and now[i] != self.group_generations[i]:
                log.info("engine %d (%s) was already restarted by its launcher", i, self.engine_urls[i])
                continue
            log.warning("restarting engine %d (%s): %s", i, self.engine_urls[i], failure.messages.get(i, ""))
            todo.append(i)
        await asyncio.gather(*(asyncio.to_thread(self.restart_engine, i) for i in todo))

    def _drop_group(self) -> None:
        """Abort, not destroy: a broadcast of a failed push may still be pending, and destroying an NCCL group
        waits for it (until NCCL's watchdog ends the process); aborting ends it at once."""
        abort_custom_process_group(self.group)
        self.group = None  # group_generations stays: _restart_silent compares against it

    async def _destroy_remote(self, clients: list[EngineClient]) -> None:
        """Best effort: an engine that is down or has no group is fine."""
        await asyncio.gather(*(c.destroy_weights_update_group(self.group_name, timeout_seconds=self.timeout_seconds)
                               for c in clients), return_exceptions=True)

    # ---- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _failures(answers: list) -> _Failure:
        failure = _Failure()
        for i, a in enumerate(answers):
            if isinstance(a, BaseException):
                failure.add(i, a)
        return failure

    def _flattened(self, bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The bucket's bytes, one tensor after another (SGLang's FlattenedTensorBucket layout), in the
        buffer kept for a bucket of these names."""
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        device = "cuda" if self.backend == "nccl" else "cpu"
        names = tuple(n for n, _ in bucket)
        flat = self._flat.get(names)
        if flat is None or flat.numel() != nbytes or flat.device.type != device:
            flat = self._flat[names] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        offset = 0
        for _, t in bucket:
            n = t.numel() * t.element_size()
            flat[offset:offset + n].copy_(t.contiguous().view(-1).view(torch.uint8), non_blocking=True)
            offset += n
        return flat

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        return t.cuda(non_blocking=True) if self.backend == "nccl" else t.cpu()

    @staticmethod
    def _is_source() -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0


class _Clients:
    """One `EngineClient` per engine for the duration of one attempt (sessions belong to one event loop)."""

    def __init__(self, urls: list[str]):
        self.clients = [EngineClient([u], control_retries=0) for u in urls]

    async def __aenter__(self) -> list[EngineClient]:
        return self.clients

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))
