"""The CPU engine server: a subset of SGLang's native HTTP API over `BatchEngine` (torch, CPU).

    python -m miles_core.engines.cpu_server --model-path DIR --host 127.0.0.1 --port P --weight-version N

Endpoints, with SGLang's request/response shapes (docs/engines.md lists the fields):
`POST /generate` (non-streaming and `"stream": true` SSE), `POST /pause_generation {mode}`,
`POST /continue_generation`, `GET|POST /flush_cache`, `POST /update_weights_from_disk`,
`GET /get_weight_version`, `GET /get_model_info` (and `/model_info`), `POST /abort_request {rid}`,
`GET /health` (and `/health_generate`).

Threading: the HTTP side runs on one asyncio loop; every engine operation (step, add, abort, pause,
weight swap) runs on one worker thread, one at a time, so they never interleave. A streamed chunk
carries the tokens of one weight version only, so a client can attribute every token to the version
that produced it (DESIGN §5.4): a chunk goes out every `--stream-interval` tokens, at every version
change and at the finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from miles_core.engines.batching import BatchEngine, Request, SamplingParams, TokenEvent
from miles_core.engines.model import CausalLM, ModelLoadError

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
                 max_total_tokens: int = 4096, seed: int = 0, stream_interval: int = 8):
        self.model_path = model_path
        self.stream_interval = stream_interval
        self.engine = BatchEngine(CausalLM.load(model_path), weight_version, max_running_requests,
                                  max_total_tokens, seed)
        self.tokenizer = _load_tokenizer(model_path)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
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

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _run_loop(self) -> None:
        while not self._closing:
            self._wake.clear()  # clear before checking, so a wake-up between the two is not lost
            if self.engine.paused or not (self._inbox or self.engine.has_work()):
                await self._wake.wait()
                continue
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
        try:  # read the checkpoint off the engine thread, then swap it in between two steps
            model = await asyncio.get_running_loop().run_in_executor(None, CausalLM.load, path)
            await self._call(self.engine.load_weights, model, version)
        except (ModelLoadError, ValueError, OSError) as e:
            return web.json_response({"success": False, "message": f"Failed to load weights from {path}: {e}"},
                                     status=400)
        self.model_path = path
        log.info("loaded weights from %s (weight version %s)", path, self.engine.version)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": self.engine.num_requests})

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
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> None:
        server = CpuEngineServer(args.model_path, args.weight_version, args.max_running_requests,
                                 args.max_total_tokens, args.seed, args.stream_interval)
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

    asyncio.run(run())


if __name__ == "__main__":
    main()
