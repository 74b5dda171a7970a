"""Conformance with SGLang 0.5.23 (the version pyproject pins) for every endpoint the client uses.

`SGLANG` below is data read from SGLang's source (the PyPI wheel sglang==0.5.23; files named per entry,
docs/engines.md cites them): each endpoint's method(s), request fields and response fields. The tests
check both sides against it:
- the client: every request `EngineClient` sends (captured by a recording server that answers in
  SGLang's shapes) goes to a route SGLang has, with a method it accepts and only fields its request
  model declares (the required ones present);
- the CPU engine (in process, builtin:tiny-gpt): its answers carry SGLang's response fields and
  statuses, and it enforces SGLang's rules: `/flush_cache` 400 "Flush cache failed." while requests run
  (pause in_place), 200 while retracted requests wait in a pause; a weight update's own `flush_cache`
  failing the call after the load; `/get_weight_version` 404 `{"detail": "Not Found"}`; `/health` 503
  during a pause while `/model_info` answers; pause/continue without a JSON body get the 400
  validation error; the sampling parameters RL rollouts send (stop strings, stop_token_ids,
  min_new_tokens, ignore_eos, the three penalties, sampling_seed, max_new_tokens' default 128, EOS ids
  from generation_config.json) and incremental streaming (each chunk carries only what is new);
  the batched `/generate` (`BATCH`): `input_ids` a list of lists, the items entering the engine together,
  `rid` a list / one string (item i gets "{rid}_{i}") / none, per-item or shared `sampling_params` and
  `return_logprob`; not streamed, a list of the items' answers in order; streamed, every chunk carries the
  item's `index`, then one [DONE];
- routed experts (`ROUTED`): `return_routed_experts` / `routed_experts_start_len` are GenerateReqInput
  fields, the launch option is `--enable-return-routed-experts`, and the finished answer's
  `meta_info.routed_experts` is base64 int32 [positions, num_hidden_layers, top-k] over positions
  start .. prompt + output - 1 (dense layers zeros), absent without the launch option; a start above the
  prompt ends the request aborted; a dense model is refused the option.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web

from miles_core.engines.batching import DEFAULT_MAX_NEW_TOKENS, BatchEngine, Request, SamplingParams
from miles_core.engines.client import EngineClient, EngineRequestError, decode_routed_experts, moe_layer_routes
from miles_core.engines.cpu_server import CpuEngineServer, serve
from miles_core.engines.cpu_server import main as cpu_server_main
from miles_core.engines.model import CausalLM, read_eos_token_ids, read_safetensors, read_spec
from miles_core.models.builtin import materialize_checkpoint

HEALTH_CHECK_TIMEOUT = 0.3  # SGLang's /health bound: short, so a pause's 503 comes at once

torch.set_num_threads(1)

IO = "python/sglang/srt/managers/io_struct.py"
HTTP = "python/sglang/srt/entrypoints/http_server.py"
SAMPLING = "python/sglang/srt/sampling/sampling_params.py"
TM = "python/sglang/srt/managers/tokenizer_manager.py"

# SGLang 0.5.23: route -> methods, request model fields (required first), response fields, source.
SGLANG = {
    "/generate": {
        "methods": {"POST", "PUT"}, "required": set(),
        "request": {"rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "lora_path",
                    "custom_logit_processor", "return_hidden_states", "priority", "extra_key", "no_logs",
                    "return_routed_experts", "routed_experts_start_len"},
        "response": {"text", "output_ids", "meta_info"},
        "source": f"{IO} GenerateReqInput; {HTTP} generate_request; {TM} _handle_batch_output",
    },
    "/pause_generation": {
        "methods": {"POST"}, "required": set(), "request": {"mode", "rid"},
        "response": {"message", "status"}, "source": f"{IO} PauseGenerationReqInput; {HTTP} pause_generation",
    },
    "/continue_generation": {
        "methods": {"POST"}, "required": set(), "request": {"torch_empty_cache", "rid"},
        "response": {"message", "status"}, "source": f"{IO} ContinueGenerationReqInput; {HTTP} continue_generation",
    },
    "/flush_cache": {
        "methods": {"GET", "POST"}, "required": set(), "request": set(), "response": None,  # plain text
        "source": f"{HTTP} flush_cache; python/sglang/srt/managers/scheduler.py Scheduler.flush_cache",
    },
    "/update_weights_from_disk": {
        "methods": {"POST"}, "required": {"model_path"},
        "request": {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                    "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache",
                    "manifest", "rid"},
        "response": {"success", "message", "num_paused_requests"},
        "source": f"{IO} UpdateWeightFromDiskReqInput; {HTTP} update_weights_from_disk",
    },
    "/model_info": {
        "methods": {"GET"}, "required": set(), "request": set(),
        "response": {"model_path", "served_model_name", "tokenizer_path", "is_generation",
                     "preferred_sampling_params", "weight_version", "load_format", "reasoning_parser",
                     "tool_call_parser", "disaggregation_mode", "has_image_understanding",
                     "has_audio_understanding", "model_type", "architectures"},
        "source": f"{HTTP} model_info",
    },
    "/get_model_info": {  # deprecated alias of /model_info
        "methods": {"GET"}, "required": set(), "request": set(), "response": "/model_info",
        "source": f"{HTTP} get_model_info",
    },
    "/health": {
        "methods": {"GET"}, "required": set(), "request": set(), "response": None,
        "source": f"{HTTP} health_generate",
    },
    "/abort_request": {
        "methods": {"POST"}, "required": set(),
        "request": {"rid", "abort_all", "finished_reason", "abort_message", "weight_versions", "http_worker_ipc"},
        "response": None, "source": f"{IO} AbortReq; {HTTP} abort_request",
    },
    "/init_weights_update_group": {
        "methods": {"POST"}, "required": {"master_address", "master_port", "rank_offset", "world_size"},
        "request": {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "rid"},
        "response": {"success", "message"}, "source": f"{IO} InitWeightsUpdateGroupReqInput",
    },
    "/update_weights_from_distributed": {
        "methods": {"POST"}, "required": {"names", "dtypes", "shapes"},
        "request": {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                    "weight_version", "load_format", "selector", "torch_empty_cache", "rid"},
        "response": {"success", "message"}, "source": f"{IO} UpdateWeightsFromDistributedReqInput",
    },
    "/begin_weight_update": {
        "methods": {"POST"}, "required": set(), "request": {"selector", "rid"},
        "response": {"success", "message"},
        "source": f"{IO} BeginWeightUpdateReqInput; {HTTP} begin_weight_update; "
                  "python/sglang/srt/managers/scheduler_components/weight_updater.py",
    },
    "/end_weight_update": {
        "methods": {"POST"}, "required": set(), "request": {"rid"}, "response": {"success", "message"},
        "source": f"{IO} EndWeightUpdateReqInput; {HTTP} end_weight_update",
    },
    "/destroy_weights_update_group": {
        "methods": {"POST"}, "required": set(), "request": {"group_name", "rid"},
        "response": {"success", "message"}, "source": f"{IO} DestroyWeightsUpdateGroupReqInput",
    },
}
# A batched /generate (input_ids a list of lists): not streamed, the list of the items' single answers in
# request order; streamed, each item's single chunk plus "index" (its rid's position in the batch), then one
# "data: [DONE]" after every item finished.
BATCH = {
    "chunk": SGLANG["/generate"]["response"] | {"index"},
    "source": f"{IO} GenerateReqInput._determine_batch_size, _normalize_rid, _normalize_sampling_params, "
              f"_normalize_logprob_params, _validate_rid_uniqueness; {TM} _handle_batch_request, "
              f"_collect_batch_responses, _stream_batch_responses (result['index'] = rid_to_index[id]); "
              f"{HTTP} generate_request (one [DONE] after the whole generator)",
}
GONE = {"/get_weight_version": f"{HTTP}: no such route in 0.5.23 (FastAPI answers 404 {{'detail': 'Not Found'}})"}
# SamplingParams fields an RL rollout sends, with SGLang's defaults (sampling_params.py).
SAMPLING_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": None,
                     "stop_token_ids": None, "ignore_eos": False, "min_new_tokens": 0, "repetition_penalty": 1.0,
                     "frequency_penalty": 0.0, "presence_penalty": 0.0, "sampling_seed": None,
                     "no_stop_trim": False, "skip_special_tokens": True}
META_FIELDS = {"id", "finish_reason", "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens",
               "e2e_latency", "output_token_logprobs", "weight_versions", "num_retractions", "reasoning_tokens",
               "routed_experts"}
# SGLang 0.5.23's routed-expert capture: the server option (python/sglang/srt/arg_groups/fields/exec_.py
# enable_return_routed_experts; the flag string in python/sglang/kernels/plugin_kernels/nvidia/spec.py), the
# request fields (IO GenerateReqInput), the response field and its layout
# (python/sglang/srt/state_capturer/routed_experts.py RoutedExpertsCapturer: [tokens, num_hidden_layers,
# num_experts_per_tok] int32; state_capturer/base.py get_topk: positions [start_len, seqlen - 1);
# {TM} _handle_batch_output: meta_info["routed_experts"] = base64 of the int32 bytes).
ROUTED = {"option": "--enable-return-routed-experts", "request": ("return_routed_experts", "routed_experts_start_len"),
          "meta": "routed_experts", "dtype": "int32"}
PROMPT = [1, 2, 3, 4, 10]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("conformance") / "gpt"))


def with_engine(ckpt, body, **kw):
    """Run `body(url, server)` against an in-process CPU engine."""
    async def main():
        server = CpuEngineServer(ckpt, **kw)
        port = _free_port()
        runner = await serve(server, "127.0.0.1", port)
        try:
            return await body(f"http://127.0.0.1:{port}", server)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


# ---- the client's requests ---------------------------------------------------------------------
class Recorder:
    """A server that records every request and answers in SGLang's shapes."""

    def __init__(self):
        self.calls: list[tuple[str, str, object]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path, body))
        if request.path == "/generate":
            meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 5,
                    "completion_tokens": 1, "weight_version": "3", "output_token_logprobs": [[-0.5, 7, None]]}
            chunk = {"text": "x", "output_ids": [7], "meta_info": meta}
            if body.get("return_routed_experts"):  # one position x 1 layer x top-2
                meta["routed_experts"] = base64.b64encode(np.array([[[3, 1]]], dtype=np.int32).tobytes()).decode()
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write_eof(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
                return resp
            return web.json_response(chunk)
        if request.path in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": "m", "weight_version": "3"})
        if request.path in ("/pause_generation", "/continue_generation"):
            return web.json_response({"message": "ok", "status": "ok"})
        if request.path == "/update_weights_from_disk":
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        if request.path in ("/flush_cache", "/health", "/abort_request"):
            return web.Response(status=200)
        return web.json_response({"success": True, "message": "ok"})


def test_client_requests_match_sglang():
    """Every endpoint EngineClient calls exists in SGLang 0.5.23 with that method, and every body holds
    only fields of SGLang's request model, the required ones included; sampling params are SGLang's."""
    rec = Recorder()

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", rec.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with EngineClient([url]) as c:
                params = {k: v for k, v in SAMPLING_DEFAULTS.items() if v is not None}
                await c.generate(PROMPT, {**params, "stop": ["\n"], "stop_token_ids": [2], "sampling_seed": 3})
                await c.generate(PROMPT, params, stream=False)
                await c.generate_batch([PROMPT, PROMPT], params)  # a group: SGLang's batch, one rid per item
                await c.generate_batch([PROMPT, PROMPT], [params, params], stream=False)
                routed = await c.generate(PROMPT, params, return_routed_experts=True)
                assert routed.routed_experts == [3, 1]
                assert await c.health(url) and await c.health_generate(url)
                assert await c.get_weight_version() == {url: 3}
                await c.model_info(url)
                await c.pause_generation("retract")
                await c.pause_generation("in_place")
                await c.update_weights_from_disk("/ckpt", 4)
                await c.flush_cache()
                await c.continue_generation()
                await c.abort_request("r1")
                await c.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g", "gloo")
                await c.begin_weight_update()
                await c.update_weights_from_distributed(["w"], ["float32"], [[2]], "g", weight_version=4)
                await c.end_weight_update()
                await c.destroy_weights_update_group("g")
        finally:
            await runner.cleanup()

    asyncio.run(main())
    seen = set()
    for method, path, body in rec.calls:
        assert path in SGLANG, f"{method} {path}: not an SGLang 0.5.23 route ({GONE.get(path, 'unknown')})"
        spec = SGLANG[path]
        assert method in spec["methods"], f"{method} {path}: SGLang accepts {spec['methods']}"
        keys = set(body or {})
        assert keys <= spec["request"], f"{path}: {keys - spec['request']} not in SGLang's request model"
        assert spec["required"] <= keys, f"{path}: lacks required {spec['required'] - keys}"
        if path == "/generate":
            per_item = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
            assert all(set(p) <= set(SAMPLING_DEFAULTS) for p in per_item)
            if isinstance(body["input_ids"][0], list):  # a batch: _normalize_rid, _validate_rid_uniqueness
                n = len(body["input_ids"])
                assert isinstance(body["rid"], list) and len(set(body["rid"])) == n
                assert not isinstance(body["sampling_params"], list) or len(body["sampling_params"]) == n
        if path in ("/pause_generation", "/continue_generation"):
            assert isinstance(body, dict)  # FastAPI's Body(): SGLang answers 400 without a JSON body
        seen.add(path)
    assert "/get_weight_version" not in seen and {"/model_info", "/health", "/generate"} <= seen
    assert sum(p == "/generate" and isinstance(b["input_ids"][0], list) for _, p, b in rec.calls) == 2
    assert sum(bool(b.get(ROUTED["request"][0])) for _, p, b in rec.calls if p == "/generate") == 1
    # the liveness probe does not generate: health() asked /model_info; only health_generate() asked /health
    assert [p for _, p, _ in rec.calls].count("/health") == 1
    disk = [b for _, p, b in rec.calls if p == "/update_weights_from_disk"][0]
    assert disk["weight_version"] == "4" and disk["flush_cache"] is False


def test_defaults_match_sglang():
    """SamplingParams() has SGLang's defaults (max_new_tokens 128, not 16)."""
    p = SamplingParams.from_json({})
    assert DEFAULT_MAX_NEW_TOKENS == 128
    for k, v in SAMPLING_DEFAULTS.items():
        got = getattr(p, k)
        assert got == v or (v is None and got in ((), None)), k


# ---- the CPU engine's answers ------------------------------------------------------------------
def _keys_ok(path: str, answer: dict) -> None:
    want = SGLANG[path]["response"]
    want = SGLANG[want]["response"] if isinstance(want, str) else want
    assert set(answer) == want, f"{path}: {set(answer) ^ want}"


def test_cpu_engine_answers_match_sglang(ckpt):
    """Shapes and statuses: /generate, /model_info (+ deprecated alias), pause/continue, update, abort,
    /health 200 when idle, /get_weight_version 404 {"detail": "Not Found"}, validation errors."""
    async def body(url, server):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                                       "sampling_params": {"max_new_tokens": 4}}) as r:
                out = await r.json()
                _keys_ok("/generate", out)
                assert set(out["meta_info"]) <= META_FIELDS
            for path in ("/model_info", "/get_model_info"):
                async with s.get(url + path) as r:
                    _keys_ok(path, await r.json())
            async with s.get(url + "/get_weight_version") as r:
                assert r.status == 404 and await r.json() == {"detail": "Not Found"}
            for path in ("/pause_generation", "/continue_generation"):
                async with s.post(url + path, json={}) as r:
                    _keys_ok(path, await r.json())
                async with s.post(url + path) as r:  # no JSON body
                    err = await r.json()
                    assert r.status == 400 and err["code"] == 400 and err["type"] == "Bad Request"
            async with s.post(url + "/pause_generation", json={"mode": "sideways"}) as r:
                assert r.status == 400 and (await r.json())["object"] == "error"
            async with s.post(url + "/update_weights_from_disk", json={"model_path": ckpt, "weight_version": "2"}) as r:
                ok = await r.json()
                assert r.status == 200 and ok["success"] is True
                _keys_ok("/update_weights_from_disk", ok)
            async with s.post(url + "/update_weights_from_disk", json={"weight_version": "2"}) as r:
                assert r.status == 400 and (await r.json())["object"] == "error"  # model_path is required
            async with s.post(url + "/abort_request", json={"rid": "nobody"}) as r:
                assert r.status == 200
            async with s.get(url + "/health") as r:
                assert r.status == 200
            async with s.get(url + "/flush_cache") as r:
                assert r.status == 200 and (await r.text()).startswith("Cache flushed.")
            dist = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "none"}
            init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                    "backend": "nccl"}  # refused at once by the CPU engine (gloo only)
            for path, req, status in (("/update_weights_from_distributed", dist, 400),  # no session open
                                      ("/begin_weight_update", {"selector": "all"}, 200),
                                      ("/update_weights_from_distributed", dist, 400),  # no such group
                                      ("/end_weight_update", {}, 200),
                                      ("/init_weights_update_group", init, 400),
                                      ("/destroy_weights_update_group", {"group_name": "none"}, 400)):
                async with s.post(url + path, json=req) as r:
                    assert r.status == status, (path, await r.text())
                    _keys_ok(path, await r.json())

    with_engine(ckpt, body)


def test_cpu_engine_batched_answers_match_sglang(ckpt):
    """A batch enters the engine in one hop (one inbox holds all its items). Not streamed it answers the
    list of SGLang's single answers in order: rid "grp" names the items grp_0, grp_1, return_logprob is per
    item, no rid gets distinct generated ones. Streamed, every chunk carries its item's "index" (its rid's
    position), each item's tokens add up, and one [DONE] ends it; a single request's chunks have no index."""
    sp = {"max_new_tokens": 3, "ignore_eos": True}

    async def body(url, server):
        inboxes, add_and_step = [], server._add_and_step

        def recording(inbox):
            inboxes.append([r.rid for r in inbox])
            return add_and_step(inbox)

        server._add_and_step = recording
        async with aiohttp.ClientSession() as s:
            async def post(req):
                async with s.post(url + "/generate", json=req) as r:
                    assert r.status == 200, await r.text()
                    if not req.get("stream"):
                        return await r.json()
                    lines = [ln.decode().strip() async for ln in r.content]
                    return [ln[len("data: "):] for ln in lines if ln]

            named = await post({"input_ids": [PROMPT, PROMPT[:2]], "rid": "grp", "sampling_params": sp,
                                "return_logprob": [True, False]})
            unnamed = await post({"input_ids": [PROMPT, PROMPT], "sampling_params": sp})
            streamed = await post({"input_ids": [PROMPT, PROMPT[:3]], "rid": ["x", "y"], "stream": True,
                                   "sampling_params": [sp, {**sp, "max_new_tokens": 5}]})
            single = await post({"input_ids": PROMPT, "sampling_params": sp, "stream": True})
        return inboxes, named, unnamed, streamed, single

    inboxes, named, unnamed, streamed, single = with_engine(ckpt, body)
    assert ["grp_0", "grp_1"] in inboxes and ["x", "y"] in inboxes
    assert isinstance(named, list) and [a["meta_info"]["id"] for a in named] == ["grp_0", "grp_1"]
    for answer in named:
        _keys_ok("/generate", answer)
    assert [a["meta_info"]["prompt_tokens"] for a in named] == [len(PROMPT), 2]
    assert "output_token_logprobs" in named[0]["meta_info"] and "output_token_logprobs" not in named[1]["meta_info"]
    ids = [a["meta_info"]["id"] for a in unnamed]
    assert len(set(ids)) == 2 and all(isinstance(i, str) and i for i in ids)
    assert streamed[-1] == "[DONE]" and streamed.count("[DONE]") == 1
    chunks = [json.loads(c) for c in streamed[:-1]]
    tokens = {0: 0, 1: 0}
    for c in chunks:
        assert set(c) == BATCH["chunk"] and c["meta_info"]["id"] == ["x", "y"][c["index"]]
        tokens[c["index"]] += len(c["output_ids"])
        assert c["meta_info"]["completion_tokens"] == tokens[c["index"]]
    assert tokens == {0: 3, 1: 5}
    assert single[-1] == "[DONE]" and all(set(json.loads(c)) == SGLANG["/generate"]["response"] for c in single[:-1])


def test_flush_rule_and_health_during_a_pause(ckpt):
    """SGLang's flush rule: 400 "Flush cache failed." while a request runs (pause in_place), 200 while
    retracted requests only wait in a pause; an update's own flush_cache (default true) then fails the
    call although the new version is served. /health answers 503 during a pause, /model_info 200."""
    async def body(url, server):
        async with aiohttp.ClientSession() as s, EngineClient([url]) as c:
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 25, "ignore_eos": True}))
            while not (server.engine.running and server.engine.running[0].output_ids):
                await asyncio.sleep(0.001)
            await c.pause_generation("in_place")
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 400 and await r.text() == "Flush cache failed.\n"
            async with s.post(url + "/update_weights_from_disk", json={"model_path": ckpt, "weight_version": "5"}) as r:
                bad = await r.json()
                assert r.status == 400 and bad["success"] is False and "not flushed" in bad["message"]
            assert (await c.get_weight_version()) == {url: 5}  # loaded anyway, as SGLang does
            async with s.get(url + "/health") as r:
                assert r.status == 503  # nothing is generated while paused
            assert await c.health(url)  # /model_info answers
            await c.pause_generation("retract")
            assert server.engine.waiting and not server.engine.running
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 200
            await c.update_weights_from_disk(ckpt, 6, flush_cache=True)
            await c.continue_generation()
            res = await task
            assert res.finish_reason == "length" and res.token_versions[-1] == 6

    with_engine(ckpt, body, health_check_timeout=HEALTH_CHECK_TIMEOUT)


def test_incremental_and_cumulative_streaming(ckpt):
    """Incremental chunks (the CPU engine's default, SGLang's --incremental-streaming-output) carry only
    the new output_ids / text / output_token_logprobs, completion_tokens stays cumulative; they add up
    to the non-streamed answer. The client reads both chunk kinds to the same result."""
    req = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                            "ignore_eos": True}}

    async def chunks(url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=req) as r:
                whole = await r.json()
            async with s.post(url + "/generate", json={**req, "stream": True}) as r:
                lines = [ln.decode().strip() async for ln in r.content]
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        async with EngineClient([url]) as c:
            res = await c.generate(PROMPT, req["sampling_params"])
        return whole, data, res

    async def inc(url, server):
        return await chunks(url)

    whole, data, res = with_engine(ckpt, inc, stream_interval=4)
    assert len(data) >= 5
    ids = [t for c in data for t in c["output_ids"]]
    assert ids == whole["output_ids"] == res.output_ids
    assert "".join(c["text"] for c in data) == whole["text"]
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) for c in data)
    assert [c["meta_info"]["completion_tokens"] for c in data][-1] == 20
    assert max(len(c["output_ids"]) for c in data) <= 4
    cum_whole, cum, cum_res = with_engine(ckpt, inc, stream_interval=4, incremental_streaming_output=False)
    assert cum[-1]["output_ids"] == cum_whole["output_ids"] == cum_res.output_ids == res.output_ids
    assert cum_res.output_logprobs == pytest.approx(res.output_logprobs, abs=1e-6)


# ---- sampling parameters -----------------------------------------------------------------------
def _gen(ckpt, requests: list[dict]) -> list[dict]:
    async def body(url, server):
        async with aiohttp.ClientSession() as s:
            async def one(sp):
                async with s.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()
            return await asyncio.gather(*(one(sp) for sp in requests))

    return with_engine(ckpt, body)


def test_stop_strings_and_stop_token_ids(ckpt):
    """`stop` (a string found in the decoded output) ends the request with finish_reason
    {type: stop, matched: <string>} and the text is cut before it (kept with no_stop_trim);
    `stop_token_ids` end it at the first such token, matched = the token."""
    greedy = {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}  # reproducible
    (base,) = _gen(ckpt, [greedy])
    text, ids = base["text"], base["output_ids"]
    words = text.split()  # the builtin digit tokenizer: "3 1 4 ..."
    stop = " ".join(words[len(words) // 2:len(words) // 2 + 2])
    assert len(words) > 4 and stop.strip(), text
    cut, kept, by_id = _gen(ckpt, [{**greedy, "stop": stop}, {**greedy, "stop": [stop], "no_stop_trim": True},
                                   {**greedy, "stop_token_ids": [ids[5]]}])
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and text.startswith(cut["text"]) and stop in kept["text"]
    assert by_id["output_ids"] == ids[:ids.index(ids[5]) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[5]}


def test_min_new_tokens_ignore_eos_and_generation_config_eos(ckpt, tmp_path):
    """min_new_tokens masks EOS and the stop tokens until that many tokens exist; EOS ids come from
    generation_config.json as well as config.json; ignore_eos keeps going past EOS."""
    spec = read_spec(ckpt)
    vocab, config_eos = spec.vocab_size, read_eos_token_ids(ckpt)[0]  # config.json's comes first
    (masked,) = _gen(ckpt, [{"max_new_tokens": 6, "temperature": 0, "min_new_tokens": 5,
                             "stop_token_ids": list(range(1, vocab))}])
    assert masked["output_ids"][:5] == [0] * 5 and len(masked["output_ids"]) == 6  # only token 0 was allowed
    with open(os.path.join(ckpt, "generation_config.json")) as f:
        gen_cfg = json.load(f)
    other = str(tmp_path / "gen-eos")
    os.makedirs(other)
    for name in os.listdir(ckpt):
        if name != "generation_config.json":
            os.symlink(os.path.join(ckpt, name), os.path.join(other, name))
    model = CausalLM(spec, read_safetensors(ckpt))
    probe = BatchEngine(model)
    probe.add(Request("g", PROMPT, SamplingParams(max_new_tokens=1, temperature=0)))
    first = [ev.token for ev in probe.step() if ev.token is not None][0]
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({**gen_cfg, "eos_token_id": [config_eos, first]}, f)
    eos = read_eos_token_ids(other)
    assert eos == (config_eos, first)
    engine = BatchEngine(model, eos_token_ids=eos)
    engine.add(Request("stop", PROMPT, SamplingParams(max_new_tokens=5, temperature=0)))
    engine.add(Request("go", PROMPT, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)))
    finishes = {}
    while engine.num_requests:
        finishes.update({ev.rid: ev.finish for ev in engine.step() if ev.finish})
    assert finishes == {"stop": {"type": "stop", "matched": first}, "go": {"type": "length", "length": 5}}


def test_penalties_follow_sglang_formulas(ckpt):
    """repetition (logit>0: /p, logit<0: *p), frequency (-f * count) and presence (-p once) apply to the
    logits sampling reads, over output tokens only; returned log-probs stay those of the raw logits."""
    model = CausalLM(read_spec(ckpt), read_safetensors(ckpt))
    engine = BatchEngine(model)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    req = Request("p", PROMPT, params, output_ids=[3, 3, 7])
    logits = torch.randn(1, model.spec.vocab_size)
    got = engine._penalize([req], logits)[0]
    want = logits[0].clone()
    for tok, count in ((3, 2), (7, 1)):
        x = want[tok]
        want[tok] = (x * 1.5 if x < 0 else x / 1.5) - 0.5 * count - 0.25
    assert torch.allclose(got, want)
    assert torch.equal(engine._penalize([Request("q", PROMPT, SamplingParams(), output_ids=[3])], logits), logits)
    outs = _gen(ckpt, [{"max_new_tokens": 8, "repetition_penalty": 2.0, "frequency_penalty": 2.0,
                        "presence_penalty": -2.0, "ignore_eos": True}])
    assert len(outs[0]["output_ids"]) == 8
    for bad in ({"repetition_penalty": 0}, {"frequency_penalty": 2.5}, {"presence_penalty": -3},
                {"min_new_tokens": 9, "max_new_tokens": 8}):
        with pytest.raises(ValueError):
            SamplingParams.from_json(bad)


def test_sampling_seed_is_per_request(ckpt):
    """Requests with the same sampling_seed sample the same tokens whatever else runs beside them."""
    seeded = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    alone = _gen(ckpt, [seeded])[0]["output_ids"]
    crowd = _gen(ckpt, [seeded, {**seeded, "sampling_seed": None}, {**seeded, "sampling_seed": 99}, seeded])
    assert crowd[0]["output_ids"] == crowd[3]["output_ids"] == alone
    (long,) = _gen(ckpt, [{"ignore_eos": True}])  # default max_new_tokens 128, capped by 32 positions
    assert long["meta_info"]["finish_reason"]["type"] == "length" and len(long["output_ids"]) == 32 - len(PROMPT)


# ---- routed experts ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """A tiny GLM-4.5-style model (transformers' own classes): layer 0 dense, layers 1-2 MoE, top-4 of 8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Glm4MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                                     num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     n_routed_experts=8, num_experts_per_tok=4, n_group=1, topk_group=1,
                                     n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64,
                                     initializer_range=0.2, eos_token_id=None)
    path = str(tmp_path_factory.mktemp("conformance") / "glm4moe")
    transformers.Glm4MoeForCausalLM(cfg).save_pretrained(path)
    return path


def _routes(b64: str, rows: int) -> torch.Tensor:
    return torch.tensor(decode_routed_experts(b64), dtype=torch.int32).view(rows, 3, 4)


def test_routed_experts_as_sglang_returns_them(moe_ckpt):
    """With the launch option, the finished answer (and only the last chunk of a stream) carries
    base64 int32 [prompt + output - 1 - start, num_hidden_layers, top-k]: the dense layer's rows zeros,
    the MoE layers' the experts the model routed each position to; batches carry them per item."""
    new = 5
    req = {"input_ids": PROMPT, "return_routed_experts": True,
           "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}

    async def body(url, server):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=req) as r:
                out = await r.json()
            async with s.post(url + "/generate", json={**req, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in (await r.text()).split("\n\n")
                          if line.startswith("data: {")]
            async with s.post(url + "/generate", json={**req, "routed_experts_start_len": 2,
                                                       "input_ids": [PROMPT, PROMPT[:3]]}) as r:
                batch = await r.json()
            async with s.post(url + "/generate", json={**req, "routed_experts_start_len": len(PROMPT) + 1}) as r:
                beyond = await r.json()
            async with EngineClient([url]) as c:
                res = await c.generate(PROMPT, req["sampling_params"], return_routed_experts=True)
        return out, chunks, batch, beyond, res

    out, chunks, batch, beyond, res = with_engine(moe_ckpt, body, enable_return_routed_experts=True)
    assert set(out["meta_info"]) <= META_FIELDS and ROUTED["meta"] in out["meta_info"]
    seq = PROMPT + out["output_ids"]
    got = _routes(out["meta_info"]["routed_experts"], len(seq) - 1)
    lm = CausalLM.load(moe_ckpt)
    lm.prefill(lm.new_cache(1, 16), 0, torch.tensor([seq]), torch.tensor([len(seq)]))
    assert torch.equal(got[:, 0], torch.zeros(len(seq) - 1, 4, dtype=torch.int32))  # layer 0 is dense
    assert torch.equal(got[:, 1:], lm.last_routes[0, :-1])
    assert [ROUTED["meta"] in c["meta_info"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert torch.equal(_routes(chunks[-1]["meta_info"]["routed_experts"], len(seq) - 1), got)
    assert torch.equal(_routes(batch[0]["meta_info"]["routed_experts"], len(seq) - 3), got[2:])
    assert _routes(batch[1]["meta_info"]["routed_experts"], 3 + new - 1 - 2).shape[0] == 5  # 3-token prompt
    assert beyond["meta_info"]["finish_reason"]["type"] == "abort"
    assert "is higher than the number of input tokens" in beyond["meta_info"]["finish_reason"]["message"]
    assert res.routed_experts == decode_routed_experts(out["meta_info"]["routed_experts"])
    moe_only = torch.tensor(moe_layer_routes(res.routed_experts, 3, (1, 2), 4)).view(len(seq) - 1, 2, 4)
    assert torch.equal(moe_only.int(), got[:, 1:])


def test_routed_experts_need_the_launch_option_and_a_moe_model(moe_ckpt, ckpt):
    """Without --enable-return-routed-experts the field is absent (as in SGLang) and the client, which
    asked, raises naming the option; a dense model is refused the option at start."""
    req = {"input_ids": PROMPT, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}

    async def body(url, server):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=req) as r:
                out = await r.json()
        async with EngineClient([url]) as c:
            with pytest.raises(EngineRequestError, match=ROUTED["option"]):
                await c.generate(PROMPT, {"max_new_tokens": 2}, return_routed_experts=True)
        return out

    assert ROUTED["meta"] not in with_engine(moe_ckpt, body)["meta_info"]
    with pytest.raises(ValueError, match=f"{ROUTED['option']} needs a mixture-of-experts model"):
        CpuEngineServer(ckpt, enable_return_routed_experts=True)
    with pytest.raises(SystemExit) as exit_:  # the command line: a usage error before serving
        cpu_server_main(["--model-path", ckpt, "--port", str(_free_port()), ROUTED["option"]])
    assert exit_.value.code == 2
