"""The CPU engine server: a subset of SGLang's native HTTP API over `BatchEngine` (torch, CPU).

    python -m miles_core.engines.cpu_server --model-path DIR --host 127.0.0.1 --port P --weight-version N

Endpoints, with SGLang's request/response shapes (docs/engines.md lists the fields):
`POST /generate` (non-streaming and `"stream": true` SSE), `POST /pause_generation {mode}`,
`POST /continue_generation`, `GET|POST /flush_cache`, `POST /update_weights_from_disk`,
`GET /get_weight_version`, `GET /get_model_info` (and `/model_info`), `POST /abort_request {rid}`,
`GET /health` (and `/health_generate`), and SGLang's distributed weight update over gloo:
`POST /init_weights_update_group`, `POST /update_weights_from_distributed`,
`POST /destroy_weights_update_group` (miles_core.weights.distributed is the trainer's side).

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
(DESIGN §5.4): a chunk goes out every `--stream-interval` tokens, at every version change and at
the finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from aiohttp import web

from miles_core.engines.batching import BatchEngine, Request, SamplingParams, TokenEvent
from miles_core.engines.model import CausalLM, ModelLoadError, read_safetensors, read_spec

log = logging.getLogger("miles_core.engines.cpu_server")


class _Progress:
    """What a /generate handler has accumulated for its request."""

    __slots__ = ("rid", "queue", "output_ids", "logprobs", "finish", "version")

    def __init__(self, rid: str, version: int):
        self.rid, self.queue = rid, asyncio.Queue()
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict | None = None
        self.version = version


class CpuEngineServer:
    def __init__(self, model_path: str, weight_version: int = 0, max_running_requests: int = 512,
                 max_total_tokens: int = 4096, seed: int = 0, stream_interval: int = 8,
                 dist_timeout_seconds: float = 120.0):
        self.model_path = model_path
        self.stream_interval = stream_interval
        model, self.hf_tensors = _load_model(model_path)
        self.engine = BatchEngine(model, weight_version, max_running_requests, max_total_tokens, seed)
        self.tokenizer = _load_tokenizer(model_path)
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
        self.progress: dict[str, _Progress] = {}
        self._inbox: list[Request] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._loop_task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_get("/get_weight_version", self.get_weight_version)
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
            self._dispatch(await self._call(self._add_and_step, inbox))

    def _add_and_step(self, inbox: list[Request]) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        for req in inbox:
            try:
                events += self.engine.add(req)
            except ValueError as e:  # checked in the handler already; a rid clash is all that is left
                events.append(TokenEvent(req.rid, None, None, self.engine.version,
                                         {"type": "abort", "message": str(e)}))
        return events + self.engine.step()

    def _take_from_inbox(self, rid: str | None, message: str) -> list[TokenEvent]:
        """Requests not yet handed to the engine end here (abort by rid, or all when rid is None)."""
        taken = [r for r in self._inbox if rid is None or r.rid == rid]
        if taken:
            self._inbox = [r for r in self._inbox if not (rid is None or r.rid == rid)]
        return [TokenEvent(r.rid, None, None, self.engine.version, {"type": "abort", "message": message})
                for r in taken]

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            p = self.progress.get(ev.rid)
            if p is not None:
                p.queue.put_nowait(ev)

    # ---- /generate ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            body = await request.json()
            req, stream, want_logprob = self._parse_generate(body)
        except (ValueError, TypeError, KeyError) as e:
            return _error(400, f"bad /generate request: {e}")
        if self._closing:
            return _error(503, "server is shutting down")
        try:
            self.engine.check(req)
        except ValueError as e:
            return _error(400, f"bad /generate request: {e}")
        if req.rid in self.progress:
            return _error(400, f"bad /generate request: rid {req.rid!r} is already in flight")
        prog = _Progress(req.rid, self.engine.version)
        self.progress[req.rid] = prog
        try:
            self._inbox.append(req)  # added to the engine by the loop, in one hop with the next step
            self._wake.set()
            if not stream:
                while prog.finish is None:
                    for group in await _next_groups(prog.queue):
                        _absorb(prog, group)
                return web.json_response(self._body(req, prog, want_logprob, t0), dumps=_dumps)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            pending = 0  # tokens absorbed but not yet sent
            while prog.finish is None:
                for group in await _next_groups(prog.queue):
                    if pending and group[0].version != prog.version:  # a chunk never mixes versions
                        await self._send(resp, req, prog, want_logprob, t0)
                        pending = 0
                    _absorb(prog, group)
                    pending += sum(ev.token is not None for ev in group)
                    if prog.finish is None and pending >= self.stream_interval:
                        await self._send(resp, req, prog, want_logprob, t0)
                        pending = 0
            # the last chunk, [DONE] and the end of the chunked body leave in one write
            await resp.write_eof(_sse(self._body(req, prog, want_logprob, t0)) + b"data: [DONE]\n\n")
            return resp
        finally:
            self.progress.pop(req.rid, None)
            if prog.finish is None and not self._closing:  # the client went away: free the slot
                asyncio.get_running_loop().create_task(self._abort_quietly(req.rid))

    async def _send(self, resp, req, prog, want_logprob, t0) -> None:
        await resp.write(_sse(self._body(req, prog, want_logprob, t0)))

    def _parse_generate(self, body: dict) -> tuple[Request, bool, bool]:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            if self.tokenizer is None or not isinstance(body["text"], str):
                raise ValueError("text needs a single string and a tokenizer.json in the model dir; send input_ids")
            ids = self.tokenizer.encode(body["text"]).ids
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("input_ids must be one non-empty list of ints (batched requests are not supported)")
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ValueError("rid must be a string")
        params = SamplingParams.from_json(body.get("sampling_params"))
        return Request(rid, ids, params), bool(body.get("stream", False)), bool(body.get("return_logprob", False))

    def _body(self, req: Request, prog: _Progress, want_logprob: bool, t0: float) -> dict:
        meta = {
            "id": req.rid,
            "finish_reason": prog.finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(prog.output_ids),
            "cached_tokens": 0,
            "weight_version": str(prog.version),
            "e2e_latency": time.monotonic() - t0,
        }
        if want_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(prog.logprobs, prog.output_ids)]
        text = self.tokenizer.decode(prog.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": list(prog.output_ids), "meta_info": meta}

    async def _abort(self, rid: str | None, message: str) -> None:
        self._dispatch(self._take_from_inbox(rid, message))
        self._dispatch(await self._call(self.engine.abort, rid, message))

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self._abort(rid, "Client disconnected")
        except RuntimeError:  # pool already shut down
            pass

    # ---- control ------------------------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        mode = body.get("mode", "abort")
        try:
            self._dispatch(await self._call(self.engine.pause, mode))
        except ValueError as e:
            return _error(400, str(e))
        if mode == "abort":
            self._dispatch(self._take_from_inbox(None, "Aborted by pause_generation(mode=abort)"))
        return web.json_response({"message": "Generation paused successfully."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(self.engine.resume)
        self._wake.set()
        return web.json_response({"message": "Generation continued successfully."})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache to drop; like SGLang, refuse while requests hold cache (paused in place).
        if self.engine.running:
            return web.Response(status=400, text="Cache not flushed: there are running requests. "
                                                 "Pause with mode=retract (or let them finish) first.")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return web.json_response({"success": False, "message": "model_path is required"}, status=400)
        try:
            version = _parse_version(body.get("weight_version"))
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if body.get("abort_all_requests", False):
            await self._abort(None, "Aborted by update_weights_from_disk")
        async with self._weights_lock:
            try:  # read the checkpoint off the engine thread, then swap it in between two steps
                model, tensors = await asyncio.get_running_loop().run_in_executor(None, _load_model, path)
                await self._call(self.engine.load_weights, model, version)
            except (ModelLoadError, ValueError, OSError) as e:
                return web.json_response({"success": False, "message": f"Failed to load weights from {path}: {e}"},
                                         status=400)
            self.model_path, self.hf_tensors, self._stale = path, tensors, False
        log.info("loaded weights from %s (weight version %s)", path, self.engine.version)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": self.engine.num_requests})

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
        name = body["group_name"]
        if name not in self.groups:
            return _unknown_group(name, self.groups)
        try:  # refused before the broadcast, like SGLang (whose rank 0 then waits for this engine until its timeout)
            metas = _tensor_metas(body["names"], body["dtypes"], body["shapes"])
            if body["load_format"] not in (None, "direct"):
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
                received = await self._dist(_receive, group, metas)
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
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return _answer(True, message)

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
            tensors, self._stale = self.hf_tensors, False
            model = await asyncio.get_running_loop().run_in_executor(None, CausalLM, self.engine.model.spec,
                                                                     tensors, "update_weights_from_distributed")
            await self._call(self.engine.load_weights, model, version)

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
        from miles_core.weights.distributed import init_custom_process_group

        return init_custom_process_group(backend="gloo", init_method=f"tcp://{address}:{port}",
                                         timeout=timedelta(seconds=self.dist_timeout_seconds),
                                         world_size=world_size, rank=rank, group_name=name)

    def _destroy_group(self, name: str) -> None:
        import torch.distributed as dist

        pg = self.groups.pop(name, None)
        if pg is not None:
            dist.destroy_process_group(pg)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.version)})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": str(self.engine.version),
            "has_image_understanding": False, "has_audio_understanding": False,
        })

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        rid = body.get("rid") or None
        if rid is None and not body.get("abort_all"):
            return web.Response(status=200)
        await self._abort(rid, "Abort requested")
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


async def _next_groups(queue: asyncio.Queue) -> list[list[TokenEvent]]:
    """Wait for events, take all that are ready, and split them into runs of one weight version."""
    events = [await queue.get()]
    while not queue.empty():
        events.append(queue.get_nowait())
    groups: list[list[TokenEvent]] = []
    for ev in events:
        if groups and groups[-1][-1].version == ev.version:
            groups[-1].append(ev)
        else:
            groups.append([ev])
    return groups


def _absorb(prog: _Progress, group: list[TokenEvent]) -> None:
    for ev in group:
        if ev.token is not None:
            prog.output_ids.append(ev.token)
            prog.logprobs.append(ev.logprob)
        if ev.finish is not None:
            prog.finish = ev.finish
        prog.version = ev.version


def _parse_version(v) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError) as e:
        raise ValueError(f"weight_version={v!r}: the CPU engine keeps integer versions") from e


def _load_model(path: str) -> tuple[CausalLM, dict]:
    """The served model and the HF tensors it was built from (a distributed update merges into these)."""
    tensors = read_safetensors(path)
    return CausalLM(read_spec(path), tensors, path), tensors


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


def _receive(group, metas: list) -> dict:
    """Receive each tensor by broadcast from rank 0 of `group`, in order (the CPU engine's TP is 1)."""
    import torch

    from miles_core.weights.distributed import broadcast_bucket

    tensors = {name: torch.empty(shape, dtype=dt) for name, dt, shape in metas}
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
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> None:
        server = CpuEngineServer(args.model_path, args.weight_version, args.max_running_requests,
                                 args.max_total_tokens, args.seed, args.stream_interval, args.dist_timeout_seconds)
        runner = await serve(server, args.host, args.port)
        log.info("CPU engine serving %s on http://%s:%d (weight version %d)", args.model_path, args.host,
                 args.port, args.weight_version)
        stop = asyncio.Event()
        import signal

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watchdog = asyncio.create_task(_exit_with_parent(stop))
        await stop.wait()
        watchdog.cancel()
        await runner.cleanup()
        return server.dist_busy

    if asyncio.run(run()):
        # A receive blocked in a collective (a peer died) ends only at the group's timeout, and the
        # interpreter would wait for its thread: leave now, the process is being stopped.
        log.warning("exiting with a weight-update group operation still blocked")
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
