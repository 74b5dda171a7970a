"""The CPU engine server: a subset of SGLang's native HTTP API over `BatchEngine` (torch, CPU).

    python -m miles_core.engines.cpu_server --model-path DIR --host 127.0.0.1 --port P --weight-version N

Endpoints, with SGLang 0.5.23's request/response shapes and rules (docs/engines.md cites the source;
tests/integration/test_sglang_conformance.py pins them): `POST /generate` (one request or a batch; non-streaming
and `"stream": true` SSE), `POST /pause_generation {mode}`, `POST /continue_generation {}`, `GET|POST /flush_cache`,
`POST /update_weights_from_disk`, `GET /model_info` (and the deprecated `/get_model_info`),
`POST /abort_request {rid}`, `GET /health` (and `/health_generate`), and SGLang's distributed weight
update over gloo: `POST /init_weights_update_group`, `POST /update_weights_from_distributed`,
`POST /destroy_weights_update_group`, inside SGLang 0.5.23's session `POST /begin_weight_update` ..
`POST /end_weight_update` (miles_core.weights.distributed is the trainer's side). Its own, not
SGLang's: `POST /stage_weights_from_disk {model_path}` reads a checkpoint and builds its model beside
the served one while generation goes on; the `/update_weights_from_disk` of the same path that
follows (the files unchanged since) swaps that model in instead of reading the disk while paused
(`miles_core.weights.sync`: a push stages before it pauses; SGLang answers 404 and loads as usual).
Any other path answers 404 `{"detail": "Not Found"}`, as FastAPI does (`/get_weight_version` is gone in 0.5.23).

SGLang's rules it enforces, so tests fail where SGLang would:
- `/flush_cache` answers 400 "Flush cache failed." while a request runs (a pause `in_place` keeps them
  running), or waits while generation is not paused; while paused, waiting (retracted) requests do not
  count. A weight update's own `flush_cache` (default true) follows the same rule after the load, and a
  refused flush fails the update call although the new weights (and version) are in place.
- `/health` generates one token through the batching loop and answers 503 when nothing comes out within
  `--health-check-timeout` (20 s): during a pause it cannot answer 200. `/model_info` answers always.
- `/pause_generation` and `/continue_generation` need a JSON body; a bad body gets the 400 validation error.

Faults: an exception in a batching step ends every request in flight with finish_reason abort and the
error, `/health` answers 503, new requests get 503, and the process exits (code 1) after
`--exit-after-fault-seconds` so its launcher restarts it (SGLang's server exits when its scheduler dies).
`MILES_CPU_ENGINE_FAULT_ONCE=<marker path>` makes one step fail (test hook).

Latency-bound stand-in (benches): `MILES_CPU_ENGINE_SECONDS_PER_TOKEN=S` makes every batching step last
at least S seconds (an asyncio sleep after the step's compute, before its tokens go out), so each
request gets one token per S seconds however many run beside it: a GPU engine's decode latency, with
`--max-running-requests` as its batch capacity, on a machine whose cores are not the limit. Pauses,
weight updates and aborts keep their own costs. Unset or 0: no pacing.

Streaming: with `--incremental-streaming-output` (the default here; SGLang's flag) each chunk carries only
the new `output_ids`, `text` and `meta_info.output_token_logprobs`; `completion_tokens` is cumulative.
A request whose tokens span weight versions carries SGLang 0.5.23's `meta_info.weight_versions`
([{version, start, end}] over the output tokens).

Routed experts (rollout routing replay), as SGLang 0.5.23 returns them: launched with
`--enable-return-routed-experts` (SGLang's ServerArgs.enable_return_routed_experts; refused at start for
a dense model, which SGLang's capturer cannot size either), a `/generate` with `"return_routed_experts":
true` gets, in its finished answer (the last chunk when streamed), `meta_info.routed_experts`: base64 of
the int32 array [positions, num_hidden_layers, num_experts_per_tok] (C order) of the experts each
position was routed to, over positions `routed_experts_start_len` (default 0; above the prompt length
the request ends aborted with SGLang's message) .. prompt + output - 1 (the last output token never ran);
a dense layer's row is zeros. Without the launch option the field is absent, as in SGLang
(state_capturer/routed_experts.py, managers/scheduler_components/batch_result_processor.py
_maybe_collect_routed_experts, managers/tokenizer_manager.py). `return_routed_experts` and
`routed_experts_start_len` are one value for every item of a batch (GenerateReqInput.__getitem__).

Batches (SGLang's GenerateReqInput): `input_ids` a list of lists (or `text` a list of strings) makes each
item a request of its own, with its rid (`rid` a list, one string that item i suffixes with `_i`, or
none), and `sampling_params` / `return_logprob` either one value for all or a list of one per item; the
items enter the engine together. The answer is the list of the items' answers in order, or one SSE
stream of every item's chunks as they come, each with the item's `"index"`, and one [DONE] at the end.
`/abort_request` of one rid ends that item only; a client that goes away aborts every unfinished item.

Distributed weight update: the engine joins the group at `rank_offset` (it has one rank: TP 1) with
SGLang's `init_custom_process_group` helper, in a thread of its own (the rendezvous blocks until every
rank joined). Each `/update_weights_from_distributed` receives its tensors by broadcast from rank 0 in
that thread, then merges them into the current HF tensors (a bucket is partial: names it does not
carry keep their values) and swaps the new model in between two engine steps, like
`/update_weights_from_disk`; `weight_version` changes only when the request carries one. While the
engine is paused, the model is built once per push rather than once per bucket: a bucket without a
version is merged and the build waits for the bucket with the version, or for the next engine step,
whichever comes first (no step ever runs on a model that lacks a received bucket). Errors answer
as SGLang's do: 400 with `{"success": false, "message"}`, or 400 with SGLang's request-validation error
body (`{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`) for a body
that lacks a field or has one of the wrong type. Metadata that cannot be received (an unknown group,
an unknown dtype, a malformed shape) is refused before the broadcast, as in SGLang; a name whose
shape differs from the served tensor is refused after it (so rank 0's broadcast completes) and the
served weights stay as they were.

Threading: the HTTP side runs on one asyncio loop; every engine operation (step, add, abort, pause,
weight swap) runs on one worker thread, one at a time, so they never interleave. Weight-update group
operations run on a second thread (see below); a receive blocked by a dead peer does not hold up
shutdown (the process exits without waiting for it). A streamed chunk carries the tokens of one
weight version only, so a client can attribute every token to the version that produced it
(docs/fully-async.md): a chunk goes out every `--stream-interval` tokens, at every version change and at
the finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import NamedTuple

from aiohttp import web

from miles_core.engines.auth import authorized, engine_token
from miles_core.engines.batching import BatchEngine, Request, SamplingParams, TokenEvent
from miles_core.engines.model import (
    CausalLM,
    ModelLoadError,
    fused_layout,
    read_eos_token_ids,
    read_safetensors,
    read_spec,
)
from miles_core.engines.weight_group import broadcast_bucket, init_custom_process_group
from miles_core.failures import chaos
from miles_core.models.safetensors_dir import safetensors_files

log = logging.getLogger("miles_core.engines.cpu_server")

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's sglang.srt.constants.HEALTH_CHECK_RID_PREFIX
FAULT_ONCE_ENV = "MILES_CPU_ENGINE_FAULT_ONCE"  # test hook: a marker path; see CpuEngineServer._inject_fault
SECONDS_PER_TOKEN_ENV = "MILES_CPU_ENGINE_SECONDS_PER_TOKEN"  # bench hook: the least seconds a step lasts
FLUSH_REFUSED = "Flush cache failed.\n"  # SGLang 0.5.23's body when the scheduler refuses (empty message)
FLUSH_DONE = ("Cache flushed.\nPlease check backend logs for more details. "
              "(When there are running or waiting requests, the operation will not be performed.)\n")
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
UPDATE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running "
                      "or queued. Retract or finish them, then call /flush_cache.")


class _Generate(NamedTuple):
    """A parsed /generate body: one request, or the items of a batch."""

    reqs: list[Request]
    logprobs: list[bool]  # return_logprob, per item
    stream: bool
    single: bool  # not a batch: answered as one object, its chunks without "index"


class _Progress:
    """What a /generate handler has accumulated for one of its requests (item `index` of a batch)."""

    __slots__ = ("req", "index", "logprob", "queue", "output_ids", "logprobs", "versions", "finish", "version",
                 "sent", "text", "sent_text", "detok", "routes")

    def __init__(self, req: Request, index: int | None, logprob: bool, queue: asyncio.Queue, version: int,
                 detok=None):
        self.req, self.index, self.logprob = req, index, logprob  # index: None for a single request
        self.queue = queue  # shared by the items of a batch
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the weight version of each output token
        self.finish: dict | None = None
        self.version = version
        self.sent = 0  # tokens already streamed (incremental chunks start here)
        self.text = ""  # decoded output so far (incremental detokenization)
        self.sent_text = 0  # characters of `text` already streamed
        self.detok = detok  # tokenizers.decoders.DecodeStream, or None without a tokenizer
        self.routes = None  # the finish event's routed experts (torch [positions, MoE layers, k]), when captured


class CpuEngineServer:
    def __init__(self, model_path: str, weight_version: int = 0, max_running_requests: int = 512,
                 max_total_tokens: int = 4096, seed: int = 0, stream_interval: int = 8,
                 dist_timeout_seconds: float = 120.0, incremental_streaming_output: bool = True,
                 health_check_timeout: float = 20.0, api_token: str | None = None,
                 enable_return_routed_experts: bool = False):
        self.model_path = model_path
        self.api_token = api_token  # every endpoint needs it when set (miles_core.engines.auth)
        self.stream_interval = stream_interval
        self.incremental = incremental_streaming_output
        self.health_check_timeout = health_check_timeout
        model, self.hf_tensors = _load_model(model_path)
        self.tokenizer = _load_tokenizer(model_path)
        decode = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        self.engine = BatchEngine(model, weight_version, max_running_requests, max_total_tokens, seed,
                                  eos_token_ids=read_eos_token_ids(model_path), decode=decode,
                                  capture_routes=enable_return_routed_experts)
        self.dead: str | None = None  # why the batching loop died (then /health answers 503)
        self.update_session = False  # SGLang 0.5.23's weight-update session (begin/end_weight_update)
        self.on_fatal = None  # called once when the loop dies (main() exits the process, as SGLang does)
        self.last_output = time.monotonic()  # when the loop last produced any event (SGLang's last_receive_tstamp)
        self._fault_marker = os.environ.get(FAULT_ONCE_ENV)
        self.seconds_per_token = _seconds_per_token(os.environ.get(SECONDS_PER_TOKEN_ENV, ""))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Weight-update groups: joins, receives and destroys run here, one at a time, off the engine
        # thread and off the event loop (a rendezvous or a broadcast blocks until every rank takes part).
        self.dist_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-group")
        self.dist_timeout_seconds = dist_timeout_seconds
        self.groups: dict = {}  # group_name -> torch ProcessGroup
        self.dist_busy = 0  # operations queued or running in dist_pool
        self._dist_count = threading.Lock()
        self._dist_waiters: set[asyncio.Task] = set()
        self._weights_lock = asyncio.Lock()  # one weight change at a time (disk or distributed)
        self._build_lock = asyncio.Lock()  # model builds from hf_tensors, in order
        self._stale = False  # hf_tensors holds received buckets the served model does not have yet
        self._staged: tuple | None = None  # (path, _identity, the load of it, the _Buffers it loads into)
        self._held: list = []  # _Buffers a load in progress or a staged model uses (never handed out)
        # New weights land in one of (at most) two sets of buffers, reused push after push (fresh memory
        # costs more than the copy into it): never the set the served model uses (`_arena`).
        self._arenas: list[_Buffers] = []
        self._receiving: _Buffers | None = None  # the set that holds received buckets not built yet
        self._served = _storages(self.hf_tensors)  # the storages the served model was built from
        self.progress: dict[str, _Progress] = {}
        self._inbox: list[Request] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._loop_task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        guards = [_require_token(self.api_token)] if self.api_token else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[*guards, _fastapi_errors])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/stage_weights_from_disk", self.stage_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def _stop(self, _app) -> None:
        self._closing = True
        await self._abort(None, "Server shutting down")
        self._wake.set()
        if self._loop_task:
            self._loop_task.cancel()
        self.pool.shutdown(wait=False)
        for task in list(self._dist_waiters):  # a handler waiting on a blocked receive must not hold shutdown
            task.cancel()
        if not self.dist_busy:  # destroying a group that a blocked receive still uses would block too
            for name in list(self.groups):
                try:
                    self._destroy_group(name)
                except Exception as e:  # noqa: BLE001 - shutting down anyway
                    log.warning("destroying group %s at shutdown failed: %s", name, e)
        self.dist_pool.shutdown(wait=False)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _run_loop(self) -> None:
        while not self._closing:
            self._wake.clear()  # clear before checking, so a wake-up between the two is not lost
            if self.engine.paused or not (self._inbox or self.engine.has_work()):
                await self._wake.wait()
                continue
            if self._stale:  # never step on a model that lacks received buckets
                await self._rebuild(None)
            inbox, self._inbox = self._inbox, []
            t0 = time.monotonic()
            try:
                events = await self._call(self._add_and_step, inbox)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a fault in a step: the engine state cannot be trusted
                self._die(f"{type(e).__name__}: {e}", inbox)
                return
            await self._pace(t0)
            self._dispatch(events)

    async def _pace(self, t0: float) -> None:
        """With MILES_CPU_ENGINE_SECONDS_PER_TOKEN set, sleep out the rest of the step's seconds."""
        rest = self.seconds_per_token - (time.monotonic() - t0)
        if rest > 0:
            await asyncio.sleep(rest)

    def _die(self, why: str, inbox: list[Request]) -> None:
        """The batching loop failed: every request in flight ends with finish_reason abort and the
        reason, `/health` answers 503 from now on, new requests are refused, and `on_fatal` runs (the
        process then exits and its launcher restarts it, as SGLang's server exits when its scheduler dies)."""
        log.error("the batching loop died: %s", why)
        self.dead = why
        message = f"The CPU engine's batching loop failed: {why}"
        self._inbox = []
        for rid in list(self.progress):
            self._dispatch([TokenEvent(rid, None, None, self.engine.version, {"type": "abort", "message": message})])
        if self.on_fatal is not None:
            self.on_fatal()

    def _inject_fault(self) -> None:
        """Test hook: with MILES_CPU_ENGINE_FAULT_ONCE=<path> set, the first step that decodes a request
        raises once (the marker file records it, across restarts of the process)."""
        if self._fault_marker and self.engine.running and not os.path.exists(self._fault_marker):
            with open(self._fault_marker, "w") as f:
                f.write(str(os.getpid()))
            raise RuntimeError(f"fault injected by {FAULT_ONCE_ENV}")

    def _add_and_step(self, inbox: list[Request]) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for req in inbox:
            try:
                events += self.engine.add(req)
            except ValueError as e:  # checked in the handler already; a rid clash is all that is left
                events.append(TokenEvent(req.rid, None, None, self.engine.version,
                                         {"type": "abort", "message": str(e)}))
        self._inject_fault()
        return events + self.engine.step()

    def _take_from_inbox(self, rid: str | None, message: str) -> list[TokenEvent]:
        """Requests not yet handed to the engine end here (abort by rid, or all when rid is None)."""
        taken = [r for r in self._inbox if rid is None or r.rid == rid]
        if taken:
            self._inbox = [r for r in self._inbox if not (rid is None or r.rid == rid)]
        return [TokenEvent(r.rid, None, None, self.engine.version, {"type": "abort", "message": message})
                for r in taken]

    def _dispatch(self, events: list[TokenEvent]) -> None:
        if any(ev.token is not None or not ev.rid.startswith(HEALTH_CHECK_RID_PREFIX) for ev in events):
            self.last_output = time.monotonic()  # a health probe's own abort is not output
        for ev in events:
            p = self.progress.get(ev.rid)
            if p is not None:
                p.queue.put_nowait(ev)

    # ---- /generate ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's /generate: one request, or a batch (`input_ids` a list of lists) whose items run as
        requests of their own, added to the engine together; a batch answers a list in request order, or
        streams every item's chunks with its `index`, then one [DONE] (TokenizerManager._handle_batch_request)."""
        t0 = time.monotonic()
        try:
            gen = self._parse_generate(await request.json())
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return _error(400, f"bad /generate request: {e}")
        if self._closing or self.dead:
            return _error(503, "server is shutting down" if self._closing else f"the engine loop died: {self.dead}")
        try:
            self._admit_check(gen.reqs)
        except ValueError as e:
            return _error(400, f"bad /generate request: {e}")
        progs = self._track(gen)
        try:
            self._inbox.extend(gen.reqs)  # added to the engine by the loop, in one hop with the next step
            self._wake.set()
            if gen.stream:
                return await self._stream(request, progs, t0)
            async for prog, ev in self._events(progs):
                self._absorb(prog, ev)
            bodies = [self._body(p, t0, delta=False) for p in progs]
            return web.json_response(bodies[0] if gen.single else bodies, dumps=_dumps)
        finally:
            for p in progs:
                self.progress.pop(p.req.rid, None)
            unfinished = [p.req.rid for p in progs if p.finish is None]
            if unfinished and not self._closing:  # the client went away: free their slots
                asyncio.get_running_loop().create_task(self._abort_quietly(unfinished))

    def _admit_check(self, reqs: list[Request]) -> None:
        """ValueError for an item the engine cannot serve or whose rid is in flight already."""
        for i, req in enumerate(reqs):
            try:
                self.engine.check(req)
            except ValueError as e:
                raise ValueError(e if len(reqs) == 1 else f"input_ids[{i}]: {e}") from None
            if req.rid in self.progress:
                raise ValueError(f"rid {req.rid!r} is already in flight")

    def _track(self, gen: _Generate) -> list[_Progress]:
        """One _Progress per item, where `_dispatch` finds it; the items share one queue."""
        queue: asyncio.Queue = asyncio.Queue()
        progs = [_Progress(req, None if gen.single else i, want, queue, self.engine.version,
                           self._detokenizer(req.params))
                 for i, (req, want) in enumerate(zip(gen.reqs, gen.logprobs))]
        self.progress.update((p.req.rid, p) for p in progs)
        return progs

    async def _events(self, progs: list[_Progress]):
        """(item, event) as the items' events come, until every item finished (later events are dropped)."""
        by_rid = {p.req.rid: p for p in progs}
        while not _all_finished(progs):
            for ev in await _ready(progs[0].queue):
                prog = by_rid[ev.rid]
                if prog.finish is None:
                    yield prog, ev

    async def _stream(self, request: web.Request, progs: list[_Progress], t0: float) -> web.StreamResponse:
        """SSE: an item's chunk goes out every `stream_interval` tokens, before a token of another weight
        version (a chunk never mixes versions) and at its finish; [DONE] once every item finished."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chaos.point("engine.generate")
        async for prog, ev in self._events(progs):
            if ev.version != prog.version and _unsent(prog):
                await resp.write(self._chunk(prog, t0))
            self._absorb(prog, ev)
            if prog.finish is None and _unsent(prog) < self.stream_interval:
                continue
            if not _all_finished(progs):
                await resp.write(self._chunk(prog, t0))
            else:  # the last chunk, [DONE] and the end of the chunked body leave in one write
                await resp.write_eof(self._chunk(prog, t0) + b"data: [DONE]\n\n")
        return resp

    def _chunk(self, prog: _Progress, t0: float) -> bytes:
        """One SSE chunk; a batch item's carries its `index` (SGLang's _stream_batch_responses)."""
        body = self._body(prog, t0, self.incremental)
        if prog.index is not None:
            body["index"] = prog.index
        return _sse(body)

    def _detokenizer(self, params: SamplingParams):
        if self.tokenizer is None:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=params.skip_special_tokens)

    def _absorb(self, prog: _Progress, ev: TokenEvent) -> None:
        if ev.token is not None:
            prog.output_ids.append(ev.token)
            prog.logprobs.append(ev.logprob)
            prog.versions.append(ev.version)
            if prog.detok is not None:
                prog.text += prog.detok.step(self.tokenizer, ev.token) or ""
        if ev.finish is not None:
            prog.finish = ev.finish
            prog.routes = ev.routed_experts
        prog.version = ev.version

    def _parse_generate(self, body: dict) -> _Generate:
        """SGLang's GenerateReqInput.normalize_batch_and_arguments, for the fields the CPU engine serves."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        prompts, single = self._prompts(body)
        n = len(prompts)
        params = [SamplingParams.from_json(p) for p in _each(body, "sampling_params", n, single)]
        routed = _typed("return_routed_experts", body.get("return_routed_experts", False), bool)
        start = _typed("routed_experts_start_len", body.get("routed_experts_start_len", 0), int)
        reqs = [Request(rid, ids, p, return_routed_experts=routed, routed_experts_start_len=start)
                for rid, ids, p in zip(_rids(body.get("rid"), n, single), prompts, params)]
        wants = [bool(w) for w in _each(body, "return_logprob", n, single)]
        return _Generate(reqs, wants, bool(body.get("stream", False)), single)

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        """The prompts as token ids, and whether the body is one request rather than a batch (SGLang's
        _determine_batch_size: a batch when `input_ids` is a list of lists, or `text` a list)."""
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            ids = self._encode(body["text"])
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids cannot be empty: send a list of ints, or a batch (a list of such lists)")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        for i, p in enumerate(prompts):
            if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
                raise ValueError(f"input_ids{'' if single else f'[{i}]'} must be a non-empty list of ints")
        return prompts, single

    def _encode(self, text) -> list:
        """`text`, one string or a batch of them, as token ids."""
        batch = isinstance(text, list) and all(isinstance(t, str) for t in text)
        if self.tokenizer is None or not (batch or isinstance(text, str)):
            raise ValueError("text needs a string (or a list of them) and a tokenizer.json in the model dir; "
                             "send input_ids")
        return [self.tokenizer.encode(t).ids for t in text] if batch else self.tokenizer.encode(text).ids

    def _body(self, prog: _Progress, t0: float, delta: bool) -> dict:
        """One answer (or SSE chunk) in SGLang's shape. `delta`: SGLang's `--incremental-streaming-output`
        chunk: `output_ids`, `text` and `meta_info.output_token_logprobs` carry only what is new since the
        previous chunk; `completion_tokens` and `weight_versions` always cover the whole output."""
        req = prog.req
        start = prog.sent if delta else 0
        ids = prog.output_ids[start:]
        text = _final_text(prog, req.params)
        meta = {
            "id": req.rid,
            "finish_reason": prog.finish,
            "prompt_tokens": len(req.input_ids),
            "weight_version": str(prog.version),
            "completion_tokens": len(prog.output_ids),
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - t0,
        }
        spans = _version_spans(prog.versions)
        if len(spans) > 1:  # SGLang 0.5.23: per-token versions of a request that straddled an update
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if prog.logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(prog.logprobs[start:], ids)]
        if prog.finish is not None and prog.routes is not None:
            meta["routed_experts"] = encode_routed_experts(prog.routes, self.engine.model.spec)
        out_text = text[prog.sent_text:] if delta else text
        prog.sent, prog.sent_text = len(prog.output_ids), max(prog.sent_text, len(text))
        return {"text": out_text, "output_ids": list(ids), "meta_info": meta}

    async def _abort(self, rid: str | None, message: str) -> None:
        self._dispatch(self._take_from_inbox(rid, message))
        self._dispatch(await self._call(self.engine.abort, rid, message))

    async def _abort_quietly(self, rids: list[str]) -> None:
        """Abort requests whose client went away (one hop to the engine thread for them all)."""
        message = "Client disconnected"
        try:
            for rid in rids:
                self._dispatch(self._take_from_inbox(rid, message))
            self._dispatch(await self._call(lambda: [ev for rid in rids for ev in self.engine.abort(rid, message)]))
        except RuntimeError:  # pool already shut down
            pass

    # ---- control ------------------------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's PauseGenerationReqInput: a JSON body is required; `mode` is abort (the default) |
        retract | in_place. Requests that arrive while paused wait (SGLang holds them in its tokenizer
        manager)."""
        try:
            mode = _fields(await _json_body(request), {}, {"mode": (str, "abort")})["mode"]
            if mode not in ("abort", "retract", "in_place"):
                raise ValueError(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
        except ValueError as e:
            return _validation_error(str(e))
        self._dispatch(await self._call(self.engine.pause, mode))
        if mode == "abort":
            self._dispatch(self._take_from_inbox(None, "Aborted by pause_generation(mode=abort)"))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            _fields(await _json_body(request), {}, {"torch_empty_cache": (bool, True)})
        except ValueError as e:
            return _validation_error(str(e))
        await self._call(self.engine.resume)
        self._wake.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _can_flush(self) -> bool:
        """SGLang 0.5.23's rule (Scheduler.flush_cache -> is_fully_idle(ignore_waiting=paused)): refused
        while any request is running (in_place keeps them running), or waiting while not paused; while
        paused, waiting requests (retracted ones, which hold no KV) do not count. Runs on the engine thread."""
        waiting = bool(self.engine.waiting or self._inbox)
        return not self.engine.running and not (waiting and not self.engine.paused)

    async def flush_cache(self, request: web.Request) -> web.Response:
        # The CPU engine has no prefix cache to drop; it answers as SGLang would.
        if not await self._call(self._can_flush):
            return web.Response(status=400, text=FLUSH_REFUSED)
        return web.Response(text=FLUSH_DONE)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's UpdateWeightFromDiskReqInput. The weights and the version change first; then, with
        `flush_cache` (default true), the cache is flushed under the /flush_cache rule, and a refused
        flush fails the call (400, success false) although the new weights are served (SGLang 0.5.23)."""
        try:
            body = _fields(await _json_body(request), {"model_path": str},
                           {"weight_version": ((str, int, type(None)), None), "flush_cache": (bool, True),
                            "abort_all_requests": (bool, False), "load_format": ((str, type(None)), None),
                            "torch_empty_cache": (bool, False), "is_async": (bool, False),
                            "keep_pause": (bool, False), "recapture_cuda_graph": (bool, False),
                            "token_step": (int, 0)})
            version = _parse_version(body["weight_version"])
        except ValueError as e:
            return _validation_error(str(e))
        path = body["model_path"]
        if body["abort_all_requests"]:
            await self._abort(None, "Aborted by update_weights_from_disk")
        async with self._weights_lock:
            try:  # read the checkpoint off the engine thread (or take the staged one), then swap it in between two steps
                model, tensors, arena = await self._read_model(path)
                try:
                    await self._call(self.engine.load_weights, model, version)
                    self._served = _storages(tensors)
                finally:
                    self._release(arena)  # served now, or free again
            except (ModelLoadError, ValueError, OSError) as e:
                return web.json_response({"success": False, "message": f"Failed to load weights from {path}: {e}",
                                          "num_paused_requests": 0}, status=400)
            self.model_path, self.hf_tensors, self._stale, self._receiving = path, tensors, False, None
        log.info("loaded weights from %s (weight version %s)", path, self.engine.version)
        paused = self.engine.num_requests
        if body["flush_cache"] and not await self._call(self._can_flush):
            return web.json_response({"success": False, "message": UPDATE_NOT_FLUSHED,
                                      "num_paused_requests": paused}, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": paused})

    async def stage_weights_from_disk(self, request: web.Request) -> web.Response:
        """Not SGLang's: read `model_path` and build its model off the engine thread, beside the served one
        (which it does not touch), for the `/update_weights_from_disk` of the same path to swap in. One
        staged model at a time: staging another path replaces it; staging the same unchanged path again
        reuses it. 400 `{"success": false}` when the checkpoint cannot be read."""
        try:
            path = _fields(await _json_body(request), {"model_path": str}, {})["model_path"]
        except ValueError as e:
            return _validation_error(str(e))
        t0 = time.monotonic()
        try:
            await (await self._stage(path))
        except (ModelLoadError, ValueError, OSError) as e:
            return _answer(False, f"Failed to stage weights from {path}: {e}")
        log.info("staged weights from %s in %.3fs", path, time.monotonic() - t0)
        return _answer(True, f"Staged the weights of {path}.")

    async def _stage(self, path: str) -> asyncio.Future:
        """The staged load of `path`: the one started already when the files are unchanged since, else a new one."""
        ident = _identity(path)
        while (staged := self._staged) is not None:
            if staged[0] == path and ident is not None and staged[1] == ident:
                return asyncio.shield(staged[2])
            await self._drop_staged()
        arena = self._hold(self._arena())
        load = asyncio.get_running_loop().run_in_executor(None, _load_model, path, arena)
        self._staged = (path, ident, load, arena)
        return asyncio.shield(load)

    async def _read_model(self, path: str) -> tuple[CausalLM, dict, "_Buffers"]:
        """The model of `path` and the buffers it lies in, held until the caller releases them: the staged
        model when it is of these very files, else read now. Nothing stays staged."""
        staged = self._staged
        if staged is not None and staged[0] == path and staged[1] is not None and staged[1] == _identity(path):
            self._staged = None  # its buffers stay held: they pass to the caller
            try:
                return (*await staged[2], staged[3])
            except (ModelLoadError, ValueError, OSError) as e:
                self._release(staged[3])
                log.info("the staged load of %s failed (%s); reading it again", path, e)
        while self._staged is not None:
            await self._drop_staged()
        arena = self._hold(self._arena())
        try:
            return (*await asyncio.get_running_loop().run_in_executor(None, _load_model, path, arena), arena)
        except BaseException:
            self._release(arena)
            raise

    async def _drop_staged(self) -> None:
        """Forget the staged model, once its load (which writes into its buffers) is over."""
        staged = self._staged
        if staged is not None:
            await asyncio.gather(staged[2], return_exceptions=True)
            if self._staged is staged:
                self._staged = None
                self._release(staged[3])

    def _hold(self, arena: "_Buffers") -> "_Buffers":
        self._held.append(arena)
        return arena

    def _release(self, arena: "_Buffers") -> None:
        if any(a is arena for a in self._held):
            self._held.remove(arena)

    # ---- distributed weight update (SGLang's protocol over gloo) ------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = _fields(await _json_or_empty(request), {"master_address": str, "master_port": int,
                                                           "rank_offset": int, "world_size": int},
                           {"group_name": (str, "weight_update_group"), "backend": (str, "nccl")})
        except ValueError as e:
            return _validation_error(str(e))
        name, backend = body["group_name"], body["backend"]
        rank = body["rank_offset"]  # + this engine's TP rank, which is 0
        log.info("init custom process group: master_address=%s, master_port=%d, rank_offset=%d, rank=%d, "
                 "world_size=%d, group_name=%s, backend=%s", body["master_address"], body["master_port"],
                 body["rank_offset"], rank, body["world_size"], name, backend)
        if not name:
            return _answer(False, "Failed to initialize custom process group: group name cannot be empty.")
        if name in self.groups:
            return _answer(False, f"Failed to initialize custom process group: group {name!r} already exists; "
                                  "destroy it first (/destroy_weights_update_group).")
        if backend != "gloo":
            return _answer(False, f"Failed to initialize custom process group: backend {backend!r} is not "
                                  "available on the CPU engine; use gloo.")
        try:
            self.groups[name] = await self._dist(self._join, body["master_address"], body["master_port"], rank,
                                                 body["world_size"], name)
        except Exception as e:  # noqa: BLE001 - SGLang answers every failure of the join the same way
            log.error("Failed to initialize custom process group: %s", e)
            return _answer(False, f"Failed to initialize custom process group: {e}.")
        return _answer(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = _fields(await _json_or_empty(request), {"names": list, "dtypes": list, "shapes": list},
                           {"group_name": (str, "weight_update_group"), "flush_cache": (bool, True),
                            "weight_version": ((str, int, type(None)), None), "abort_all_requests": (bool, False),
                            "load_format": ((str, type(None)), None)})
            _list_of("names", body["names"], str)
            _list_of("dtypes", body["dtypes"], str)
            for shape in body["shapes"]:
                _list_of("shapes", shape, int)
            version = _parse_version(body["weight_version"])
        except ValueError as e:
            return _validation_error(str(e))
        if not self.update_session:  # checked first in SGLang's scheduler, before any receive
            return _answer(False, NO_SESSION)
        name = body["group_name"]
        if name not in self.groups:
            return _unknown_group(name, self.groups)
        try:  # refused before the broadcast, like SGLang (whose rank 0 then waits for this engine until its timeout)
            metas = _tensor_metas(body["names"], body["dtypes"], body["shapes"])
            if body["load_format"] not in (None, "direct", "flattened_bucket"):
                raise ValueError(f"load_format={body['load_format']!r} is not supported by the CPU engine")
        except ValueError as e:
            return _answer(False, f"Failed to update parameter online: {e}. The served weights are unchanged.")
        if body["abort_all_requests"]:
            await self._abort(None, "Aborted by update_weights_from_distributed")
        async with self._weights_lock:
            group = self.groups.get(name)
            if group is None:  # destroyed while this request waited
                return _unknown_group(name, self.groups)
            t0 = time.monotonic()
            try:
                arena = self._arena(receive=True)
                received = await self._dist(_receive, group, metas, arena, body["load_format"] == "flattened_bucket")
            except Exception as e:  # noqa: BLE001 - a broken collective: the group is unusable now
                log.error("receiving weights failed: %s", e)
                return _answer(False, f"Failed to update parameter online: {e}. The served weights are "
                                      "unchanged; destroy and re-initialize the group.")
            t1 = time.monotonic()
            try:
                tensors = _merge(self.hf_tensors, received)
            except ValueError as e:
                return _answer(False, f"Failed to update parameter online: {e}. The served weights are unchanged.")
            previous, self.hf_tensors = self.hf_tensors, tensors
            self._receiving = arena  # until the build, the next bucket goes to the same buffers
            if version is None and self.engine.paused:
                self._stale = True  # built once: with the bucket that carries the version, or before the next step
            else:
                try:
                    await self._rebuild(version)
                except (ModelLoadError, ValueError) as e:
                    self.hf_tensors, self._stale = previous, True  # previous may hold deferred buckets
                    return _answer(False, f"Failed to update parameter online: {e}. "
                                          "The served weights are unchanged.")
            nbytes = sum(t.numel() * t.element_size() for t in received.values())
            log.info("received %d tensors (%.1f MiB) over %s in %.3fs, %s in %.3fs (weight version %s)", len(metas),
                     nbytes / 2**20, name, t1 - t0, "deferred the build" if self._stale else "built the model",
                     time.monotonic() - t1, self.engine.version)
        if body["flush_cache"] and not await self._call(self._can_flush):
            return _answer(False, UPDATE_NOT_FLUSHED)
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return _answer(True, message)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23: open the session `/update_weights_from_distributed` runs in (one at a time)."""
        try:
            _fields(await _json_body(request), {}, {"selector": (str, "all")})
        except ValueError as e:
            return _validation_error(str(e))
        if self.update_session:
            return _answer(False, "a weight-update session is already open; call end_weight_update() first")
        self.update_session = True
        return _answer(True, "Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        try:
            _fields(await _json_body(request), {}, {})
        except ValueError as e:
            return _validation_error(str(e))
        if not self.update_session:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        self.update_session = False
        return _answer(True, "Success")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = _fields(await _json_or_empty(request), {}, {"group_name": (str, "weight_update_group")})
        except ValueError as e:
            return _validation_error(str(e))
        if body["group_name"] not in self.groups:
            return _answer(False, "The group to be destroyed does not exist.")
        try:
            await self._dist(self._destroy_group, body["group_name"])
        except Exception as e:  # noqa: BLE001
            return _answer(False, f"Failed to destroy custom process group: {e}.")
        return _answer(True, "Succeeded to destroy custom process group.")

    async def _rebuild(self, version: int | None) -> None:
        """Build the model from `hf_tensors` off the engine thread and swap it in between two steps."""
        async with self._build_lock:
            tensors, self._stale, self._receiving = self.hf_tensors, False, None
            model = await asyncio.get_running_loop().run_in_executor(None, CausalLM, self.engine.model.spec,
                                                                     tensors, "update_weights_from_distributed")
            await self._call(self.engine.load_weights, model, version)
            self._served = _storages(tensors)

    def _arena(self, receive: bool = False) -> "_Buffers":
        """Buffers for new weights: for a distributed receive, those of the push in progress; else a set
        that neither the served model, nor `hf_tensors`, nor a load, a staged model or a push in progress
        uses; else a new set while there are fewer than two; else a set of no buffers (new tensors are
        allocated then, as SGLang does)."""
        if receive and self._receiving is not None:
            return self._receiving
        used = self._served | _storages(self.hf_tensors)
        busy = [*self._held, self._receiving]
        for arena in self._arenas:
            if not any(arena is b for b in busy) and used.isdisjoint(arena.storages()):
                return arena
        if len(self._arenas) < 2:
            self._arenas.append(_Buffers(self.hf_tensors))
            return self._arenas[-1]
        return _Buffers(None)

    async def _dist(self, fn, *args):
        """Run `fn` in the group thread. `dist_busy` counts operations until their thread finishes (a
        cancelled waiter does not end a blocked receive); the waiting handler can be cancelled at shutdown."""
        with self._dist_count:
            self.dist_busy += 1
        future = self.dist_pool.submit(fn, *args)
        future.add_done_callback(self._dist_done)
        task = asyncio.current_task()
        self._dist_waiters.add(task)
        try:
            return await asyncio.wrap_future(future)
        finally:
            self._dist_waiters.discard(task)

    def _dist_done(self, _future) -> None:
        with self._dist_count:
            self.dist_busy -= 1

    def _join(self, address: str, port: int, rank: int, world_size: int, name: str):
        return init_custom_process_group(backend="gloo", init_method=f"tcp://{address}:{port}",
                                         timeout=timedelta(seconds=self.dist_timeout_seconds),
                                         world_size=world_size, rank=rank, group_name=name)

    def _destroy_group(self, name: str) -> None:
        import torch.distributed as dist

        pg = self.groups.pop(name, None)
        if pg is not None:
            dist.destroy_process_group(pg)

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's /model_info (and the deprecated /get_model_info): `weight_version` is where a
        client reads the served version (/get_weight_version answers 404 there)."""
        spec = self.engine.model.spec
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": str(self.engine.version),
            "load_format": "safetensors", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": spec.family, "architectures": None,
        })

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        rid = body.get("rid") or None
        if rid is None and not body.get("abort_all"):
            return web.Response(status=200)
        await self._abort(rid, "Abort requested")
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's /health and /health_generate: 503 while shutting down or when the loop died; otherwise
        a one-token greedy request on input_ids [0] joins the queue, and the answer is 200 as soon as the
        loop produces any output after the probe started (a busy engine answers through its running
        requests), or 503 after `health_check_timeout` seconds (SGLANG_HEALTH_CHECK_TIMEOUT, 20). While
        generation is paused nothing is produced: the probe waits the whole timeout and answers 503."""
        if self._closing:
            return web.Response(status=503)
        if self.dead:
            return web.json_response({"error": "the batching loop died", "message": self.dead}, status=503)
        tic = time.monotonic()
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        self._inbox.append(Request(rid, [0], SamplingParams(max_new_tokens=1, temperature=0.0)))
        self._wake.set()
        try:
            while time.monotonic() < tic + self.health_check_timeout and not self.dead:
                await asyncio.sleep(0.01)
                if self.last_output > tic:
                    return web.Response(status=200)
            log.error("Health check failed: no output from the engine loop for %.1f s", time.monotonic() - tic)
            return web.Response(status=503)
        finally:
            if not self._closing and not self.dead:
                await self._abort(rid, "health check done")


async def _ready(queue: asyncio.Queue) -> list[TokenEvent]:
    """Wait for events and take all that are ready."""
    events = [await queue.get()]
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


def _all_finished(progs: list[_Progress]) -> bool:
    return all(p.finish is not None for p in progs)


def _unsent(prog: _Progress) -> int:
    """Tokens absorbed but not streamed yet."""
    return len(prog.output_ids) - prog.sent


def _rids(rid, n: int, single: bool) -> list[str]:
    """The items' rids (SGLang's GenerateReqInput._normalize_rid, _validate_rid_uniqueness): a single
    request's string (generated when absent); for a batch a list of distinct strings, one per item, or
    one string (item i gets "{rid}_{i}"), or none (generated)."""
    if single:
        rid = rid or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ValueError("rid must be a string")
        return [rid]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise ValueError("rid must be a string or a list of strings")
    if len(rid) != n:
        raise ValueError(f"rid has {len(rid)} ids for a batch of {n} prompts")
    duplicates = [r for r, count in Counter(rid).items() if count > 1]
    if duplicates:
        raise ValueError(f"duplicate rids within the batch: {duplicates}")
    return rid


def _each(body: dict, key: str, n: int, single: bool) -> list:
    """A per-item field (SGLang's _normalize_sampling_params, _normalize_logprob_params): a single
    request's value; for a batch one value for every item, or a list of one per item."""
    value = body.get(key)
    if single or not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{key} has {len(value)} entries for a batch of {n} prompts")
    return value


def _seconds_per_token(text: str) -> float:
    """MILES_CPU_ENGINE_SECONDS_PER_TOKEN as seconds (unset: 0); a clear error for anything else."""
    try:
        seconds = float(text or 0)
    except ValueError:
        raise ValueError(f"{SECONDS_PER_TOKEN_ENV}={text!r}: not a number of seconds") from None
    if not seconds >= 0:
        raise ValueError(f"{SECONDS_PER_TOKEN_ENV}={text!r}: must be >= 0")
    return seconds


def _final_text(prog: _Progress, params: SamplingParams) -> str:
    """The decoded output; a request stopped by a stop string has its text cut before the match (SGLang
    trims it unless `no_stop_trim`)."""
    matched = (prog.finish or {}).get("matched")
    if isinstance(matched, str) and matched and not params.no_stop_trim:
        at = prog.text.rfind(matched)
        if at >= 0:
            return prog.text[:at]
    return prog.text


def encode_routed_experts(routes, spec) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of int32 [positions, num_hidden_layers, top-k] (C order),
    from `routes` [positions, MoE layers, k] (the MoE layers in `spec.moe_layers` order); a dense
    layer's row stays zeros, as in SGLang's capture buffer (only MoE layers write to it)."""
    import base64

    import torch

    full = torch.zeros(routes.shape[0], spec.num_layers, spec.moe_topk, dtype=torch.int32)
    full[:, list(spec.moe_layers)] = routes.to(torch.int32)
    return base64.b64encode(full.numpy().tobytes()).decode("ascii")


def _version_spans(versions: list[int]) -> list[dict]:
    """SGLang's `meta_info.weight_versions`: [{version, start, end}] runs over the output tokens."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _parse_version(v) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError) as e:
        raise ValueError(f"weight_version={v!r}: the CPU engine keeps integer versions") from e


class _Buffers:
    """One set of reusable buffers for new weights, shaped like the served HF tensors, allocated when first
    used (`fused_layout`: a model built from them concatenates nothing). A flattened bucket gets one flat
    buffer per layout of the bucket."""

    def __init__(self, like: dict | None):
        import torch

        # shapes and dtypes only (meta tensors): the buffers must not keep the served weights alive
        self.like = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in (like or {}).items()}
        self.reusable = like is not None  # else: no buffers kept (every tensor is allocated anew)
        self.named: dict | None = None if self.reusable else {}
        self.flat: dict[tuple, object] = {}

    def storages(self) -> set[int]:
        return _storages(self.named or {}) | _storages(self.flat)

    def tensors(self) -> dict:
        if self.named is None:
            self.named = fused_layout(self.like)
        return self.named

    def flat_buffer(self, metas: list):
        """A uint8 buffer for a flattened bucket of `metas` (the same one for the same layout)."""
        import torch

        key = tuple((name, str(dt), tuple(shape)) for name, dt, shape in metas)
        if not self.reusable:
            return torch.empty(_nbytes(metas), dtype=torch.uint8)
        if key not in self.flat:
            names = {name for name, _, _ in metas}
            for other in [k for k in self.flat if any(n in names for n, _, _ in k)]:
                del self.flat[other]  # the same tensors in another layout: kept no longer (one model's bytes at most)
            self.flat[key] = torch.empty(_nbytes(metas), dtype=torch.uint8)
        return self.flat[key]


def _nbytes(metas: list) -> int:
    import torch

    return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for _, dt, shape in metas)


def _load_model(path: str, into: _Buffers | None = None) -> tuple[CausalLM, dict]:
    """The served model and the HF tensors it was built from (a distributed update merges into these).
    With reusable buffers (`into`), every tensor is converted straight into its buffer (those the model
    concatenates, q/k/v and gate/up, lie in fused buffers, so the model views them there); else each is
    a new float32 tensor."""
    tensors = read_safetensors(path, into.tensors() if into is not None and into.reusable else None)
    return CausalLM(read_spec(path), tensors, path), tensors


def _storages(tensors: dict) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors.values()}


def _identity(path: str) -> tuple | None:
    """What tells the files of checkpoint `path` apart from other contents at the same path (inode, size
    and mtime of config.json and each safetensors file); None when they cannot be listed."""
    try:
        names = ["config.json", *safetensors_files(path)]
        return tuple((n, st.st_ino, st.st_size, st.st_mtime_ns) for n in names
                     for st in [os.stat(os.path.join(path, n))])
    except (OSError, ValueError):
        return None


def _fields(body: dict, required: dict, optional: dict) -> dict:
    """Check a JSON body like SGLang's request models do: required fields and types, defaults for the rest."""
    out = {}
    missing = [k for k in required if k not in body]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    for k, typ in required.items():
        out[k] = _typed(k, body[k], typ)
    for k, (typ, default) in optional.items():
        out[k] = _typed(k, body[k], typ) if k in body else default
    return out


def _typed(key: str, value, typ):
    types = typ if isinstance(typ, tuple) else (typ,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"field {key!r}: {value!r} is not {names}")
    return value


def _list_of(key: str, value, typ) -> None:
    """A request-model check: `value` is a list of `typ` (bools are not ints)."""
    if not isinstance(value, list) or not all(isinstance(v, typ) and not isinstance(v, bool) for v in value):
        raise ValueError(f"field {key!r}: {value!r} is not a list of {typ.__name__}")


def _tensor_metas(names: list, dtypes: list, shapes: list) -> list:
    """(name, torch dtype, shape) per tensor; ValueError for metadata that cannot be received."""
    import torch

    if not (len(names) == len(dtypes) == len(shapes)):  # SGLang zips them (silently dropping the excess)
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"{name}: dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: shape {shape} has a negative dimension")
        metas.append((name, dt, shape))
    return metas


def _receive(group, metas: list, into: _Buffers, flattened: bool = False) -> dict:
    """Receive a bucket by broadcast from rank 0 of `group` (the CPU engine's TP is 1): each tensor, in
    order, into the buffer of its name in `into` when it has the same shape and dtype, else into a new
    tensor; or, `flattened` (SGLang's load_format="flattened_bucket"), one uint8 tensor holding every
    tensor's bytes in order, into `into`'s flat buffer for this layout, whose views are returned."""
    import torch

    if flattened:
        flat = into.flat_buffer(metas)
        broadcast_bucket([flat], group)
        out, offset = {}, 0
        for name, dt, shape in metas:
            size = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
            piece = flat[offset:offset + size]
            if offset % torch.empty(0, dtype=dt).element_size():  # not aligned for a view: a copy
                piece = torch.empty(size, dtype=torch.uint8).copy_(piece)
            out[name] = piece.view(dt).view(shape)
            offset += size
        return out
    named = into.tensors()

    def target(name, dt, shape):
        t = named.get(name)
        return t if t is not None and t.dtype == dt and list(t.shape) == list(shape) else torch.empty(shape, dtype=dt)

    tensors = {name: target(name, dt, shape) for name, dt, shape in metas}
    broadcast_bucket(list(tensors.values()), group)
    return tensors


def _merge(current: dict, received: dict) -> dict:
    """The current HF tensors with `received` replacing (or adding) theirs, as float32; ValueError when a
    received tensor's shape differs from the served one's."""
    bad = [f"{k}: {list(v.shape)} != {list(current[k].shape)}" for k, v in received.items()
           if k in current and v.shape != current[k].shape]
    if bad:
        raise ValueError("shape differs from the served tensor: " + "; ".join(bad))
    return {**current, **{k: v.float() for k, v in received.items()}}


def _unknown_group(name: str, groups: dict) -> web.Response:
    # SGLang's ModelRunner asserts this (outside its try); the CPU engine answers it like a failed update.
    return _answer(False, f"Group {name} not in {list(groups)}. Please call `init_weights_update_group` first.")


def _answer(success: bool, message: str) -> web.Response:
    """SGLang's answer to the weight-update endpoints: 200, or 400 with success false."""
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _validation_error(message: str) -> web.Response:
    """SGLang's answer to a body its request model rejects (FastAPI validation, mapped to 400)."""
    return web.json_response({"object": "error", "message": message, "type": "Bad Request", "param": None,
                              "code": 400}, status=400)


def _load_tokenizer(model_path: str):
    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _sse(obj) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _require_token(token: str):
    """401 {"error": "Unauthorized"} (SGLang's answer) for a request without the engine token."""

    @web.middleware
    async def check(request: web.Request, handler):
        if authorized(request.headers, token):
            return await handler(request)
        return web.json_response({"error": "Unauthorized"}, status=401)

    return check


@web.middleware
async def _fastapi_errors(request: web.Request, handler):
    """Unknown routes and methods answer as SGLang's FastAPI app does: 404 {"detail": "Not Found"} (e.g.
    /get_weight_version, gone in SGLang 0.5.23) and 405 {"detail": "Method Not Allowed"}."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


async def _json_body(request: web.Request) -> dict:
    """A required JSON object body (FastAPI's `Body()`); ValueError (-> SGLang's 400 validation error)
    when it is missing or not an object."""
    try:
        body = await request.json()
    except ValueError as e:
        raise ValueError("Field required: the body must be a JSON object") from e
    if not isinstance(body, dict):
        raise ValueError("Input should be a valid dictionary or object")
    return body


async def _json_or_empty(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def serve(server: CpuEngineServer, host: str, port: int) -> web.AppRunner:
    """Start serving on host:port inside the running loop; the caller stops it with `runner.cleanup()`."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def _exit_with_parent(stop: asyncio.Event, poll_seconds: float = 1.0) -> None:
    """Stop when the process that started us dies (a SIGKILLed engine actor or driver): the server
    runs in its own session, so nothing else would end it and it would hold its port forever."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(poll_seconds)
    log.warning("parent process %d is gone; shutting down", parent)
    stop.set()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m miles_core.engines.cpu_server", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="HF-format model directory (config.json + safetensors).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", type=int, default=0, help="Version reported until the next weight update.")
    ap.add_argument("--max-running-requests", type=int, default=512)
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="Positions per request (prompt + output).")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the sampling generator.")
    ap.add_argument("--stream-interval", type=int, default=8,
                    help="Send a stream chunk every N tokens (SGLang's flag). A chunk is also sent at every "
                         "weight-version change and at the finish, so per-token versions stay exact.")
    ap.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads.")
    ap.add_argument("--dist-timeout-seconds", type=float, default=120.0,
                    help="Timeout of a weight-update group's rendezvous and of each of its broadcasts.")
    ap.add_argument("--incremental-streaming-output", action=argparse.BooleanOptionalAction, default=True,
                    help="Stream chunks that carry only the new tokens/text/log-probs (SGLang's flag); "
                         "--no-incremental-streaming-output sends the whole output in every chunk.")
    ap.add_argument("--health-check-timeout", type=float,
                    default=float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)),
                    help="How long /health waits for engine output before answering 503 (SGLang's "
                         "SGLANG_HEALTH_CHECK_TIMEOUT, default 20).")
    ap.add_argument("--exit-after-fault-seconds", type=float,
                    default=float(os.environ.get("MILES_CPU_ENGINE_EXIT_AFTER_FAULT_SECONDS", 1.0)),
                    help="When the batching loop dies, exit (code 1) this long after aborting the requests "
                         "in flight, as SGLang's server exits when its scheduler dies.")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="Return each position's routed experts when a /generate asks (return_routed_experts; "
                         "SGLang's flag). A mixture-of-experts model only.")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> tuple[int, bool]:
        try:
            server = CpuEngineServer(args.model_path, args.weight_version, args.max_running_requests,
                                     args.max_total_tokens, args.seed, args.stream_interval, args.dist_timeout_seconds,
                                     args.incremental_streaming_output, args.health_check_timeout, engine_token(),
                                     args.enable_return_routed_experts)
        except (ModelLoadError, ValueError) as e:
            ap.error(str(e))
        runner = await serve(server, args.host, args.port)
        log.info("CPU engine serving %s on http://%s:%d (weight version %d; API token %s)", args.model_path,
                 args.host, args.port, args.weight_version, "required" if server.api_token else "not set")
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        server.on_fatal = lambda: loop.call_later(args.exit_after_fault_seconds, stop.set)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watchdog = asyncio.create_task(_exit_with_parent(stop))
        await stop.wait()
        watchdog.cancel()
        await runner.cleanup()
        return server.dist_busy, server.dead is not None

    busy, died = asyncio.run(run())
    if busy or died:
        # A receive blocked in a collective (a peer died) ends only at the group's timeout, and the
        # interpreter would wait for its thread: leave now, the process is being stopped. A dead loop
        # exits with code 1 so its launcher restarts it.
        log.warning("exiting with %s", "the batching loop dead" if died else "a weight-update group operation blocked")
        logging.shutdown()
        os._exit(1 if died else 0)


if __name__ == "__main__":
    main()
