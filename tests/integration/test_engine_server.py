"""The CPU engine server (a real process on 127.0.0.1) driven over HTTP by EngineClient.

Pins the SGLang native API subset: the JSON keys and types of /generate (plain and SSE streaming) and
of the control endpoints; per-token weight versions across an in-place pause + weight update +
resume; that a weight reload changes what is generated; abort by rid and pause(mode=abort) end
requests with finish_reason abort; retract keeps requests alive; batched /generate (SGLang's list of
lists: a list answer in order, streamed chunks with "index" and one [DONE], abort of one item, a client
gone mid-stream frees every item, bad batches refused with nothing enqueued); the client's least-in-flight
dispatch, its fallback when a connection is refused, and that a killed engine's in-flight requests come
back as aborted (not as exceptions) while the launcher restarts the process. The distributed weight
update endpoints (SGLang's shapes over gloo): their error answers, and a round trip with rank 0 in
this test process (partial buckets merge, the version moves only when sent, the result equals a disk
load of the same weights exactly; SGLang 0.5.23's begin/end_weight_update session is required). The
launcher's watchdog never restarts an engine paused for an update (its probe, /model_info, answers
during a pause; /health does not); a fault in a batching step aborts the requests in flight with the
error, /health reports it, the process exits and the launcher restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from datetime import timedelta

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from miles_core.engines.client import EngineClient, GenerateResult, _sse_data, _Stream
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer, free_port
from miles_core.models.builtin import materialize_checkpoint
from miles_core.weights.distributed import broadcast_bucket, destroy_custom_process_group, init_custom_process_group

from tests.support.timeouts import ENGINE_START_SECONDS, WAIT_SECONDS, await_until

REQUEST_TIMEOUT_SECONDS = 0.5  # the timeout under test: a paused engine answers no request within it
SETTLE_SECONDS = 10.0  # the engine or the client reaches a state the test just asked for (requests held or freed)
LOOK_SECONDS = 0.02  # how often a wait asks the engine or the client

PROMPT = [1, 2, 3, 4, 10]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-server")
    return {
        "gpt": materialize_checkpoint("builtin:tiny-gpt", 1, str(root / "gpt")),
        "gpt_other": materialize_checkpoint("builtin:tiny-gpt", 2, str(root / "gpt_other")),
        "llama": materialize_checkpoint("builtin:tiny-llama", 1, str(root / "llama")),
        "llama_other": materialize_checkpoint("builtin:tiny-llama", 2, str(root / "llama_other")),
    }


def start(path: str, version: int = 1, **kw) -> EngineServer:
    server = EngineServer(EngineLaunchSpec("cpu", path, weight_version=version,
                                           startup_timeout_seconds=ENGINE_START_SECONDS, **kw))
    server.start()
    return server


@pytest.fixture(scope="module")
def gpt_engine(ckpts):
    s = start(ckpts["gpt"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llama_engines(ckpts):
    servers = [start(ckpts["llama"]), start(ckpts["llama"])]
    yield servers
    for s in servers:
        s.stop()


def run(coro):
    return asyncio.run(coro)


async def until(condition, what: str, timeout: float = SETTLE_SECONDS):
    """tests.support.timeouts.await_until, looking as often as these tests need."""
    return await await_until(condition, timeout, what, interval=LOOK_SECONDS)


# ---- shapes -------------------------------------------------------------------------------------
def check_meta(meta: dict, rid: str, final: bool):
    assert meta["id"] == rid
    assert isinstance(meta["prompt_tokens"], int) and meta["prompt_tokens"] == len(PROMPT)
    assert isinstance(meta["completion_tokens"], int)
    assert isinstance(meta["weight_version"], str)
    assert isinstance(meta["cached_tokens"], int) and isinstance(meta["e2e_latency"], float)
    for entry in meta["output_token_logprobs"]:
        lp, tok, text = entry
        assert isinstance(lp, float) and lp <= 0 and isinstance(tok, int) and text is None
    if final:
        assert meta["finish_reason"]["type"] in ("stop", "length")
    else:
        assert meta["finish_reason"] is None


def test_generate_shape_matches_sglang(gpt_engine):
    """POST /generate (no stream) answers SGLang's shape: text, output_ids, meta_info with id,
    finish_reason {type, matched|length}, prompt/completion tokens, weight_version (a string) and
    output_token_logprobs as [logprob, token_id, null]."""
    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": PROMPT, "rid": "shape-1", "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                        "stop_token_ids": [11]}}
            async with s.post(gpt_engine.url + "/generate", json=body) as r:
                assert r.status == 200
                return await r.json()

    out = run(go())
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and all(isinstance(t, int) for t in out["output_ids"])
    meta = out["meta_info"]
    check_meta(meta, "shape-1", final=True)
    assert meta["weight_version"] == "1"
    assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_logprobs"])
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    fr = meta["finish_reason"]
    assert fr == {"type": "length", "length": 5} or (fr["type"] == "stop" and fr["matched"] == out["output_ids"][-1])


def test_stream_shape_matches_sglang(gpt_engine):
    """"stream": true answers text/event-stream lines `data: {json}` with incremental output_ids and
    output_token_logprobs (SGLang's --incremental-streaming-output; completion_tokens cumulative), then
    `data: [DONE]`; only the last JSON chunk has a finish_reason."""
    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": PROMPT, "rid": "shape-2", "return_logprob": True, "stream": True,
                    "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
            async with s.post(gpt_engine.url + "/generate", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                return [line.decode() async for line in r.content]

    lines = [ln.strip() for ln in run(go()) if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all(ln.startswith("data: ") for ln in lines)
    prev = []
    for i, c in enumerate(chunks):
        last = i == len(chunks) - 1
        check_meta(c["meta_info"], "shape-2", final=last)
        assert c["output_ids"] or last
        assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
        prev = prev + c["output_ids"]
        assert c["meta_info"]["completion_tokens"] == len(prev)
    assert len(prev) == 20 and len(chunks) >= 3  # --stream-interval 8: chunks at 8, 16 and the finish


def test_control_endpoint_shapes(gpt_engine, ckpts):
    """Control endpoints answer like SGLang 0.5.23: /health 200, /get_weight_version 404 (gone),
    /get_model_info and /model_info {model_path, is_generation, weight_version, ...}, pause/continue
    {message, status},
    /flush_cache 200 when idle, /abort_request 200, /update_weights_from_disk {success, message,
    num_paused_requests} and 400 with success false for a bad path."""
    async def go():
        async with aiohttp.ClientSession() as s:
            u = gpt_engine.url
            async with s.get(u + "/health") as r:
                assert r.status == 200
            async with s.get(u + "/get_weight_version") as r:
                assert r.status == 404 and await r.json() == {"detail": "Not Found"}
            for path in ("/get_model_info", "/model_info"):
                async with s.get(u + path) as r:
                    info = await r.json()
                    assert info["is_generation"] is True and info["model_path"] == ckpts["gpt"]
                    assert info["weight_version"] == "1"
            async with s.post(u + "/pause_generation", json={"mode": "retract"}) as r:
                assert set(await r.json()) == {"message", "status"}
            async with s.post(u + "/pause_generation", json={"mode": "sideways"}) as r:
                assert r.status == 400
            async with s.post(u + "/flush_cache") as r:
                assert r.status == 200
            async with s.post(u + "/continue_generation", json={}) as r:
                assert set(await r.json()) == {"message", "status"}
            async with s.post(u + "/abort_request", json={"rid": "nobody"}) as r:
                assert r.status == 200
            body = {"model_path": ckpts["gpt"], "weight_version": "1", "flush_cache": True,
                    "abort_all_requests": False}
            async with s.post(u + "/update_weights_from_disk", json=body) as r:
                ok = await r.json()
                assert r.status == 200 and ok["success"] is True and isinstance(ok["message"], str)
                assert isinstance(ok["num_paused_requests"], int)
            async with s.post(u + "/update_weights_from_disk", json={**body, "model_path": "/nonexistent"}) as r:
                bad = await r.json()
                assert r.status == 400 and bad["success"] is False and "/nonexistent" in bad["message"]
            async with s.post(u + "/generate", json={"input_ids": [], "sampling_params": {}}) as r:
                assert r.status == 400 and "input_ids" in (await r.json())["error"]["message"]

    run(go())


# ---- weight updates and versions ----------------------------------------------------------------
def test_in_place_update_keeps_requests_and_versions_each_token(llama_engines, ckpts):
    """pause(in_place) -> update_weights_from_disk(v2) -> continue: no request is aborted, each
    finishes its full length, and streamed per-token versions go 1..1 then 2..2 for requests that
    straddled the update (docs/fully-async.md)."""
    url = llama_engines[0].url

    async def go():
        async with EngineClient([url]) as c:
            await c.update_weights_from_disk(ckpts["llama"], 1)
            for attempt in range(3):
                tasks = [asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 100, "ignore_eos": True}))
                         for _ in range(16)]
                await asyncio.sleep(0.05 * (attempt + 1))
                await c.pause_generation("in_place")
                await c.update_weights_from_disk(ckpts["llama_other"], 2 + attempt)
                await c.continue_generation()
                results: list[GenerateResult] = await asyncio.gather(*tasks)
                assert all(r.finish_reason == "length" and len(r.output_ids) == 100 for r in results)
                for r in results:
                    assert r.token_versions == sorted(r.token_versions)
                    assert set(r.token_versions) <= {1 if attempt == 0 else 1 + attempt, 2 + attempt}
                    assert len(r.token_versions) == len(r.output_logprobs) == 100
                mixed = [r for r in results if len(set(r.token_versions)) == 2]
                if mixed:
                    assert all(r.weight_version == 2 + attempt for r in results)
                    return True
            return False

    assert run(go()), "no request straddled the weight update in 3 attempts"


def test_weight_reload_changes_outputs(gpt_engine, ckpts):
    """Loading other weights changes what the engine computes (the log-probs of the greedy tokens; a
    random tiny model's argmax may not move) and reloading the first brings it back exactly; the
    reported version follows each load."""
    async def go():
        async with EngineClient([gpt_engine.url]) as c:
            greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
            await c.update_weights_from_disk(ckpts["gpt"], 1)
            first = await c.generate(PROMPT, greedy)
            await c.update_weights_from_disk(ckpts["gpt_other"], 7)
            other = await c.generate(PROMPT, greedy)
            assert await c.get_weight_version() == {gpt_engine.url: 7}
            await c.update_weights_from_disk(ckpts["gpt"], 8)
            back = await c.generate(PROMPT, greedy)
            await c.update_weights_from_disk(ckpts["gpt"], 1)
            return first, other, back

    first, other, back = run(go())
    assert (first.output_ids, first.output_logprobs) != (other.output_ids, other.output_logprobs)
    assert first.output_ids == back.output_ids
    assert max(abs(a - b) for a, b in zip(first.output_logprobs, back.output_logprobs)) < 1e-6
    assert (first.token_versions, other.token_versions, back.token_versions) == ([1] * 8, [7] * 8, [8] * 8)


# ---- abort and pause modes ----------------------------------------------------------------------
def test_abort_request_returns_abort(gpt_engine):
    """/abort_request {rid} ends that request with finish_reason abort (returned, not raised)."""
    async def go():
        async with EngineClient([gpt_engine.url]) as c:
            await c.pause_generation("in_place")  # keep the request queued until we abort it
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 20}, rid="victim"))
            keep = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}, rid="keep"))
            await asyncio.sleep(0.2)
            await c.abort_request("victim")
            res = await task
            await c.continue_generation()
            return res, await keep

    res, keep = run(go())
    assert res.finish_reason == "abort" and res.aborted and res.rid == "victim"
    assert keep.finish_reason == "length" and len(keep.output_ids) == 3


def test_pause_abort_mode_aborts_in_flight(gpt_engine):
    """pause_generation(mode=abort) ends every request in flight with finish_reason abort; after
    continue_generation new requests run normally."""
    async def go():
        async with EngineClient([gpt_engine.url]) as c:
            await c.pause_generation("retract")
            tasks = [asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 10})) for _ in range(4)]
            await asyncio.sleep(0.2)
            await c.pause_generation("abort")
            aborted = await asyncio.gather(*tasks)
            await c.continue_generation()
            return aborted, await c.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})

    aborted, after = run(go())
    assert all(r.finish_reason == "abort" for r in aborted)
    assert after.finish_reason == "length"


def test_retract_keeps_requests_and_flush_cache_works(ckpts, monkeypatch):
    """pause(retract) -> flush_cache -> update -> continue: requests are re-queued, their cache is
    recomputed, and they all finish at full length (none aborted), their last tokens from the new
    weights. The flush is allowed: while paused, SGLang 0.5.23 does not count waiting (retracted)
    requests. The pause goes out once every request has streamed a token (a condition, not a sleep),
    on an engine paced at 20 ms a token, so none can finish before it."""
    monkeypatch.setenv("MILES_CPU_ENGINE_SECONDS_PER_TOKEN", "0.02")
    server = start(ckpts["llama"])
    url = server.url

    async def one(session, started: asyncio.Event) -> GenerateResult:
        rid = os.urandom(8).hex()
        payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True},
                   "rid": rid, "return_logprob": True, "stream": True}
        st, t0 = _Stream(prompt_tokens=len(PROMPT)), time.monotonic()
        async with session.post(f"{url}/generate", json=payload) as resp:
            assert resp.status == 200
            async for data in _sse_data(resp.content):
                if data == b"[DONE]":
                    break
                st.absorb(json.loads(data))
                if st.output_ids:
                    started.set()
        assert st.finish is not None, "the stream ended without a finish_reason"
        return st.result(rid, url, t0)

    async def go():
        async with EngineClient([url]) as c, aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.create_task(one(session, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            await c.pause_generation("retract")
            await c.flush_cache()
            await c.update_weights_from_disk(ckpts["llama_other"], 5)
            await c.continue_generation()
            return await asyncio.gather(*tasks)

    try:
        res = run(go())
    finally:
        server.stop()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 60 for r in res)
    assert all(r.token_versions[0] == 1 and r.token_versions[-1] == 5 for r in res)


def test_timed_out_request_is_aborted_and_freed(gpt_engine, ckpts):
    """A /generate past request_timeout_seconds returns finish_reason abort, and the engine frees the
    request (the client aborts it by rid; the server also aborts when the connection drops), so a
    later weight update counts no request left behind."""
    async def go():
        async with EngineClient([gpt_engine.url], request_timeout_seconds=REQUEST_TIMEOUT_SECONDS) as c:
            await c.pause_generation("in_place")
            res = await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 5}, stream=s) for s in (True, False)))
        async with aiohttp.ClientSession() as s:

            async def freed() -> bool:  # the client's abort by rid, or the dropped connection, has landed
                return await in_flight(s, gpt_engine, ckpts["gpt"]) == 0

            await until(freed, "the timed-out requests freed")
            body = {"model_path": ckpts["gpt"], "weight_version": "1"}
            async with s.post(gpt_engine.url + "/update_weights_from_disk", json=body) as r:
                left = (await r.json())["num_paused_requests"]
            async with s.post(gpt_engine.url + "/continue_generation", json={}) as r:
                assert r.status == 200
        return res, left

    res, left = run(go())
    assert all(r.finish_reason == "abort" and "Timeout" in r.abort_message for r in res)
    assert left == 0


# ---- batched /generate (SGLang's GenerateReqInput batch: input_ids a list of lists) -------------
PROMPTS = [PROMPT, [7, 8, 9], [2, 4]]


@pytest.fixture(scope="module")
def slow_engine(ckpts):
    """An engine whose every step lasts 1 s (MILES_CPU_ENGINE_SECONDS_PER_TOKEN): a request that runs to
    the model's context (~27 new tokens) stays in flight ~27 s, so what a test leaves behind is still
    there when it looks, however loaded the machine."""
    from miles_core.engines.cpu_server import SECONDS_PER_TOKEN_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECONDS_PER_TOKEN_ENV, "1.0")
        s = start(ckpts["gpt"])
    yield s
    s.stop()


async def in_flight(session, engine: EngineServer, ckpt: str) -> int:
    """The requests the engine holds: the num_paused_requests of a reload of the weights it serves."""
    body = {"model_path": ckpt, "weight_version": "1", "flush_cache": False}
    async with session.post(engine.url + "/update_weights_from_disk", json=body) as r:
        return (await r.json())["num_paused_requests"]


def sse_chunks(lines: list[str]) -> list:
    """The `data:` payloads of an SSE body: JSON chunks, and "[DONE]" as a string."""
    data = [ln.strip()[len("data: "):] for ln in lines if ln.strip()]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def stream_batch(s, url: str, body: dict, on_chunk=None) -> list:
    """POST a streamed batch and read it to the end; `on_chunk(chunk)` is awaited for each JSON chunk."""
    async with s.post(url + "/generate", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        chunks = []
        async for line in r.content:
            for chunk in sse_chunks([line.decode()]):
                chunks.append(chunk)
                if on_chunk is not None and chunk != "[DONE]":
                    await on_chunk(chunk)
        return chunks


def by_index(chunks: list) -> dict[int, list[dict]]:
    items: dict[int, list[dict]] = {}
    for c in chunks:
        items.setdefault(c["index"], []).append(c)
    return items


def test_batched_generate_answers_a_list_in_order(gpt_engine):
    """A batch (input_ids a list of lists, rid a list, sampling_params one per item) answers a JSON list of
    the items' answers in request order, each SGLang's single answer (no index) for its own rid."""
    lengths = [6, 2, 4]
    body = {"input_ids": PROMPTS, "rid": ["b-0", "b-1", "b-2"], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": n, "ignore_eos": True} for n in lengths]}

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(gpt_engine.url + "/generate", json=body) as r:
                assert r.status == 200
                return await r.json()

    out = run(go())
    assert isinstance(out, list) and len(out) == 3
    for i, item in enumerate(out):
        meta = item["meta_info"]
        assert set(item) == {"text", "output_ids", "meta_info"}
        assert meta["id"] == f"b-{i}" and meta["prompt_tokens"] == len(PROMPTS[i])
        assert meta["completion_tokens"] == len(item["output_ids"]) == lengths[i]
        assert meta["finish_reason"] == {"type": "length", "length": lengths[i]}
        assert [e[1] for e in meta["output_token_logprobs"]] == item["output_ids"]


def test_batched_stream_interleaves_items_by_index(gpt_engine):
    """A streamed batch: every chunk is the item's single-request chunk plus "index" (its position in the
    batch); each item's chunks reassemble into its whole output (completion_tokens cumulative, only the
    last chunk with a finish_reason), a short item ends before a long one, one [DONE] ends the stream."""
    lengths = [20, 3, 12]
    body = {"input_ids": PROMPTS, "rid": ["s-0", "s-1", "s-2"], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": n, "ignore_eos": True} for n in lengths]}

    async def go():
        async with aiohttp.ClientSession() as s:
            return await stream_batch(s, gpt_engine.url, body)

    chunks = run(go())
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    chunks = chunks[:-1]
    assert all(set(c) == {"text", "output_ids", "meta_info", "index"} for c in chunks)
    items = by_index(chunks)
    assert sorted(items) == [0, 1, 2]
    for i, mine in items.items():
        ids = []
        for k, c in enumerate(mine):
            meta = c["meta_info"]
            assert meta["id"] == f"s-{i}" and meta["prompt_tokens"] == len(PROMPTS[i])
            ids += c["output_ids"]
            assert meta["completion_tokens"] == len(ids)
            assert len(meta["output_token_logprobs"]) == len(c["output_ids"])
            assert (meta["finish_reason"] is not None) == (k == len(mine) - 1)
        assert len(ids) == lengths[i] and mine[-1]["meta_info"]["finish_reason"]["type"] == "length"
    last = {i: max(k for k, c in enumerate(chunks) if c["index"] == i) for i in items}
    assert last[1] < last[0]  # interleaved as produced: the 3-token item is done before the 20-token one


def test_abort_of_one_rid_ends_only_that_item(slow_engine, ckpts):
    """/abort_request with one item's rid, while the streamed batch runs, ends that item with finish_reason
    abort; the others run to their full length and the stream ends with one [DONE]."""
    body = {"input_ids": PROMPTS, "rid": ["ab-0", "ab-1", "ab-2"],  # 3 s, ~27 s (to the context), 3 s
            "sampling_params": [{"max_new_tokens": n, "ignore_eos": True} for n in (3, 100, 3)]}

    async def go():
        async with aiohttp.ClientSession() as s:
            aborted = []

            async def abort_once(chunk):
                if not aborted:
                    aborted.append(chunk["index"])
                    async with s.post(slow_engine.url + "/abort_request", json={"rid": "ab-1"}) as r:
                        assert r.status == 200

            chunks = await stream_batch(s, slow_engine.url, body, abort_once)
            return chunks, await in_flight(s, slow_engine, ckpts["gpt"])

    chunks, left = run(go())
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    items = by_index(chunks[:-1])
    finish = {i: mine[-1]["meta_info"]["finish_reason"] for i, mine in items.items()}
    assert finish[1]["type"] == "abort"
    assert finish[0] == finish[2] == {"type": "length", "length": 3}
    assert left == 0


def test_client_gone_mid_stream_frees_every_item(slow_engine, ckpts):
    """A client that closes a streamed batch after its first chunk: the engine aborts every unfinished
    item (nothing in flight within 10 s, where the items would run ~27 s: room for a loaded machine)."""
    body = {"input_ids": PROMPTS, "rid": ["gone-0", "gone-1", "gone-2"], "stream": True,
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}

    async def go():
        async with aiohttp.ClientSession() as s:
            async with aiohttp.ClientSession() as client:
                r = await client.post(slow_engine.url + "/generate", json=body)
                first = sse_chunks([(await r.content.readline()).decode()])[0]
                held = await in_flight(s, slow_engine, ckpts["gpt"])
                r.close()  # the connection drops mid-stream

            async def freed() -> bool:
                return not await in_flight(s, slow_engine, ckpts["gpt"])

            await until(freed, "items freed after the client left")
            return first, held

    first, held = run(go())
    assert first["index"] in (0, 1, 2) and first["meta_info"]["finish_reason"] is None
    assert held == 3  # all three ran when the client left


def test_bad_batches_are_refused_and_leave_nothing_in_flight(slow_engine, ckpts):
    """400, naming the problem, and nothing enqueued: rids fewer than prompts, a duplicate rid, a rid in
    flight already, a sampling_params list of the wrong length, an empty item, an empty batch."""
    params = {"max_new_tokens": 20, "ignore_eos": True}
    cases = [({"rid": ["a", "b"]}, "rid has 2 ids for a batch of 3"),
             ({"rid": ["a", "b", "a"]}, "duplicate rids"),
             ({"rid": ["fresh-0", "busy", "fresh-2"]}, "'busy' is already in flight"),
             ({"sampling_params": [params, params]}, "sampling_params has 2 entries for a batch of 3"),
             ({"input_ids": [PROMPT, [], PROMPT]}, "input_ids[1] must be a non-empty list of ints"),
             ({"input_ids": []}, "input_ids cannot be empty")]

    async def go():
        async with aiohttp.ClientSession() as s:
            busy = asyncio.create_task(stream_batch(s, slow_engine.url, {  # ~27 s unless aborted
                "input_ids": PROMPT, "rid": "busy", "sampling_params": {**params, "max_new_tokens": 100}}))
            await until(lambda: in_flight(s, slow_engine, ckpts["gpt"]), "the busy request held")
            answers = []
            for extra, _ in cases:
                body = {"input_ids": PROMPTS, "sampling_params": params, **extra}
                async with s.post(slow_engine.url + "/generate", json=body) as r:
                    answers.append((r.status, (await r.json())["error"]["message"]))
            held = await in_flight(s, slow_engine, ckpts["gpt"])
            async with s.post(slow_engine.url + "/abort_request", json={"rid": "busy"}) as r:
                assert r.status == 200
            await busy
            return answers, held, await in_flight(s, slow_engine, ckpts["gpt"])

    answers, held, left = run(go())
    for (status, message), (_, want) in zip(answers, cases):
        assert status == 400 and want in message, (message, want)
    assert held == 1 and left == 0  # only "busy" was ever in flight


# ---- the client over several engines -----------------------------------------------------------
def test_dispatch_is_least_in_flight(llama_engines):
    """With both engines paused, 10 requests split 5/5 by in-flight count; all finish after continue."""
    urls = [s.url for s in llama_engines]

    async def go():
        async with EngineClient(urls) as c:
            await c.pause_generation("retract")
            tasks = [asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 2})) for _ in range(10)]
            await until(lambda: sum(c.in_flight().values()) == 10, "all 10 requests dispatched")
            counts = c.in_flight()
            await c.continue_generation()
            res = await asyncio.gather(*tasks)
            return counts, res, c.in_flight()

    counts, res, after = run(go())
    assert sorted(counts.values()) == [5, 5]
    assert {r.engine_url for r in res} == set(urls) and all(not r.aborted for r in res)
    assert set(after.values()) == {0}


def test_refused_connection_tries_another_engine(gpt_engine):
    """A refused connection (the request never left) is sent to another engine; with none left the
    result is an abort, not an exception."""
    dead = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with EngineClient([dead, gpt_engine.url]) as c:
            ok = [await c.generate(PROMPT, {"max_new_tokens": 2}) for _ in range(3)]
        async with EngineClient([dead], refused_wait_seconds=0.5) as c:
            t0 = time.monotonic()
            return ok, await c.generate(PROMPT, {"max_new_tokens": 2}), time.monotonic() - t0

    ok, none, waited = run(go())
    assert all(r.engine_url == gpt_engine.url and not r.aborted for r in ok)
    assert none.aborted and "no engine accepted the connection within 0.5 s" in none.abort_message
    assert 0.3 <= waited < 2.0


def test_a_restarting_engine_is_waited_for_not_aborted(gpt_engine):
    """Every engine refusing (the only one restarting): the request backs off and is served once the
    engine listens again, instead of coming back aborted at once (a storm of aborted groups)."""
    port = free_port()
    target = gpt_engine.url.rsplit(":", 1)[1]

    async def pipe(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def forward(client_r, client_w):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", int(target))
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

    async def go():
        async def come_back():
            await asyncio.sleep(0.6)  # the behaviour under test: the engine's port refuses for this long
            return await asyncio.start_server(forward, "127.0.0.1", port)

        back = asyncio.ensure_future(come_back())
        async with EngineClient([f"http://127.0.0.1:{port}"], refused_wait_seconds=20) as c:
            t0 = time.monotonic()
            result = await c.generate(PROMPT, {"max_new_tokens": 2})
            waited = time.monotonic() - t0
        (await back).close()
        return result, waited

    result, waited = run(go())
    assert not result.aborted and len(result.output_ids) == 2 and 0.5 <= waited < 5


def test_killed_engine_returns_in_flight_as_aborted_and_restarts(ckpts):
    """SIGKILL of the engine process: requests in flight come back with finish_reason abort (never an
    exception) and the launcher's monitor restarts the process on the same URL."""
    server = start(ckpts["gpt"], health_interval_seconds=0.2)
    try:
        pid = server.pid()

        async def go():
            async with EngineClient([server.url]) as c:
                await c.pause_generation("in_place")  # the requests are surely in flight when it dies
                tasks = [asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 5}, stream=s))
                         for s in (True, False)]
                await asyncio.sleep(0.3)
                os.kill(pid, signal.SIGKILL)
                res = await asyncio.gather(*tasks)
                await until(lambda: _restarted(server), "the engine restarted", timeout=WAIT_SECONDS)
                after = await c.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})
                return res, after

        res, after = run(go())
        assert all(r.finish_reason == "abort" for r in res)
        assert server.restarts == 1 and server.pid() != pid
        assert after.finish_reason == "length"
    finally:
        server.stop()


async def _restarted(server: EngineServer) -> bool:
    return server.restarts >= 1


# ---- distributed weight update (SGLang's protocol over gloo) ------------------------------------
async def _post(session, url, path, body):
    async with session.post(url + path, json=body) as r:
        return r.status, await r.json()


def _is_validation_error(status, body):
    """SGLang's answer to a body its request model rejects: 400 with FastAPI's error envelope."""
    return status == 400 and body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"


def test_distributed_update_error_answers(gpt_engine):
    """Missing or mistyped fields: 400 with SGLang's validation-error body; an unknown group (update or
    destroy) and a backend the CPU engine lacks: 400 with success false and SGLang's message."""
    good = {"names": ["transformer.ln_f.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope"}

    async def go():
        async with aiohttp.ClientSession() as s:
            u = gpt_engine.url
            for path, body in [("/init_weights_update_group", {}),
                               ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x",
                                                               "rank_offset": 1, "world_size": 2}),
                               ("/update_weights_from_distributed", {}),
                               ("/update_weights_from_distributed", {**good, "names": "transformer.ln_f.weight"}),
                               ("/update_weights_from_distributed", {**good, "shapes": [[1.5]]}),
                               ("/update_weights_from_distributed", {**good, "weight_version": [3]})]:
                status, res = await _post(s, u, path, body)
                assert _is_validation_error(status, res), (path, body, status, res)
            status, res = await _post(s, u, "/update_weights_from_distributed", good)  # no session (SGLang 0.5.23)
            assert (status, res["success"]) == (400, False) and "begin_weight_update()" in res["message"]
            assert (await _post(s, u, "/begin_weight_update", {}))[0] == 200
            assert (await _post(s, u, "/begin_weight_update", {}))[0] == 400  # one session at a time
            status, res = await _post(s, u, "/update_weights_from_distributed", good)
            assert status == 400 and res["success"] is False
            assert "Group nope not in" in res["message"] and "init_weights_update_group" in res["message"]
            assert (await _post(s, u, "/end_weight_update", {}))[0] == 200
            assert (await _post(s, u, "/end_weight_update", {}))[0] == 400
            status, res = await _post(s, u, "/destroy_weights_update_group", {"group_name": "nope"})
            assert (status, res) == (400, {"success": False, "message": "The group to be destroyed does not exist."})
            status, res = await _post(s, u, "/init_weights_update_group",
                                      {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2, "group_name": "g", "backend": "nccl"})
            assert status == 400 and res["success"] is False and "gloo" in res["message"]

    run(go())


def test_distributed_update_round_trip(gpt_engine, ckpts):
    """This process is rank 0 of a world of 2 (the engine at rank_offset 1): init answers success; a second
    init of the same group is refused; a bad dtype or a negative dim is refused before the broadcast; a
    shape that differs from the served tensor is refused after it, changing nothing; two buckets without
    a version while paused are merged, kept the version, and are served after the resume; a bucket with
    weight_version "7" moves the version; both times the engine computes what a disk load of the same
    checkpoint computes (to 1e-6); destroy answers success, a second destroy does not."""
    other = load_file(os.path.join(ckpts["gpt_other"], "model.safetensors"))
    names = list(other)
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mine = {}

    def join():
        mine["pg"] = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", timedelta(seconds=30), 2, 0,
                                               group_name="g")

    async def update(s, bucket, version=None, body_extra=None):
        body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": "g", "flush_cache": False,
                **({"weight_version": version} if version is not None else {}), **(body_extra or {})}
        (status, res), _ = await asyncio.gather(_post(s, gpt_engine.url, "/update_weights_from_distributed", body),
                                                asyncio.to_thread(broadcast_bucket, [t for _, t in bucket], mine["pg"]))
        return status, res

    async def go():
        async with aiohttp.ClientSession() as s, EngineClient([gpt_engine.url]) as c:
            u = gpt_engine.url
            await c.update_weights_from_disk(ckpts["gpt"], 1)
            before = await c.generate(PROMPT, greedy)
            init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": "g", "backend": "gloo"}
            (status, res), _ = await asyncio.gather(_post(s, u, "/init_weights_update_group", init),
                                                    asyncio.to_thread(join))
            assert (status, res) == (200, {"success": True, "message": "Succeeded to initialize custom process group."})
            status, res = await _post(s, u, "/init_weights_update_group", init)
            assert status == 400 and res["success"] is False and "already exists" in res["message"]
            assert (await _post(s, u, "/begin_weight_update", {}))[0] == 200  # SGLang 0.5.23's session

            for bad in ({"dtypes": ["float99"]}, {"shapes": [[-1]]}):  # refused before any broadcast
                body = {"names": [names[0]], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g", **bad}
                status, res = await _post(s, u, "/update_weights_from_distributed", body)
                assert status == 400 and res["success"] is False
                assert res["message"].startswith("Failed to update parameter online")

            wrong = [(names[0], torch.zeros(3, 3))]  # received, then refused: the served weights stay
            status, res = await update(s, wrong, "5")
            assert status == 400 and "shape differs" in res["message"]
            assert (await c.model_info(u))["weight_version"] == "1"
            same = await c.generate(PROMPT, greedy)

            await c.pause_generation("retract")  # paused: buckets without a version are merged, built later
            for part in (names[:3], names[3:]):
                status, res = await update(s, [(n, other[n]) for n in part])
                assert (status, res["success"]) == (200, True) and "Weight version" not in res["message"]
            assert (await c.model_info(u))["weight_version"] == "1"
            await c.continue_generation()
            unversioned = await c.generate(PROMPT, greedy)  # every bucket is served, under the old version
            status, res = await update(s, [(names[0], other[names[0]])], "7")  # running: built at once
            assert (status, res["success"]) == (200, True) and res["message"].endswith("Weight version updated to 7.")
            assert (await c.model_info(u))["weight_version"] == "7"
            pushed = await c.generate(PROMPT, greedy)
            await c.update_weights_from_disk(ckpts["gpt_other"], 7)
            loaded = await c.generate(PROMPT, greedy)
            assert (await _post(s, u, "/end_weight_update", {}))[0] == 200

            status, res = await _post(s, u, "/destroy_weights_update_group", {"group_name": "g"})
            assert (status, res) == (200, {"success": True, "message": "Succeeded to destroy custom process group."})
            status, res = await _post(s, u, "/destroy_weights_update_group", {"group_name": "g"})
            assert status == 400 and res["success"] is False
            await c.update_weights_from_disk(ckpts["gpt"], 1)  # leave the shared engine as the other tests expect
            return before, same, unversioned, pushed, loaded

    try:
        before, same, unversioned, pushed, loaded = run(go())
    finally:
        destroy_custom_process_group(mine.get("pg"))
    assert (same.output_ids, same.output_logprobs) == (before.output_ids, before.output_logprobs)
    for got in (unversioned, pushed):  # same tensors as the disk load; float noise of the batch layout only
        assert got.output_ids == loaded.output_ids
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, loaded.output_logprobs)) < 1e-6
    assert max(abs(a - b) for a, b in zip(pushed.output_logprobs, before.output_logprobs)) > 1e-3
    assert (set(unversioned.token_versions), set(pushed.token_versions)) == ({1}, {7})



# ---- the watchdog and the engine's own faults ----------------------------------------------------
def test_watchdog_never_restarts_an_engine_paused_for_an_update(ckpts, monkeypatch):
    """An engine paused (in_place, a request held) for much longer than the watchdog's patience is not
    restarted: the watchdog probes /model_info, which answers during a pause. SGLang's /health (which
    the CPU engine copies) answers 503 meanwhile, so a /health watchdog would have restarted it."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    server = start(ckpts["gpt"], health_interval_seconds=0.2, health_failures_before_restart=3)
    try:
        async def go():
            async with EngineClient([server.url]) as c, aiohttp.ClientSession() as s:
                task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 20, "ignore_eos": True}))
                await asyncio.sleep(0.2)
                await c.pause_generation("in_place")
                pid = server.pid()
                async with s.get(server.url + "/health") as r:
                    assert r.status == 503  # what SGLang's /health answers during a pause
                # A negative check: no restart is the answer, and nothing signals one not happening, so the
                # watchdog gets 15 of its intervals to (wrongly) act.
                await asyncio.sleep(3.0)
                assert server.restarts == 0 and server.pid() == pid
                assert await c.health(server.url)
                await c.continue_generation()
                return await task

        res = run(go())
        assert res.finish_reason == "length" and len(res.output_ids) == 20
    finally:
        server.stop()


def test_engine_fault_aborts_in_flight_and_the_launcher_restarts_it(ckpts, tmp_path, monkeypatch):
    """A batching step that raises (MILES_CPU_ENGINE_FAULT_ONCE) ends the requests in flight with
    finish_reason abort and the error, /health answers 503, the process exits and the launcher restarts
    it (same URL); the restarted engine serves."""
    from miles_core.engines.cpu_server import FAULT_ONCE_ENV

    marker = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ONCE_ENV, str(marker))
    monkeypatch.setenv("MILES_CPU_ENGINE_EXIT_AFTER_FAULT_SECONDS", "3")
    server = start(ckpts["gpt"], health_interval_seconds=0.2)
    try:
        async def go():
            async with EngineClient([server.url]) as c, aiohttp.ClientSession() as s:
                hit = await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 10, "ignore_eos": True})
                                             for _ in range(3)))
                async with s.get(server.url + "/health") as r:
                    dead = (r.status, await r.json())
                await until(lambda: _restarted(server), "the engine restarted", timeout=WAIT_SECONDS)
                return hit, dead, await c.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})

        hit, dead, after = run(go())
        assert marker.exists()
        assert all(r.finish_reason == "abort" and "fault injected" in r.abort_message for r in hit)
        assert dead[0] == 503 and "fault injected" in dead[1]["message"]
        assert server.restarts == 1 and after.finish_reason == "length" and len(after.output_ids) == 4
    finally:
        server.stop()


def test_an_engine_port_taken_before_the_engine_binds_it_is_replaced(ckpts):
    """The port is picked free and bound by the process seconds later; another process taking it in
    between must not fail the start (the engine starts again on another port, its URL follows)."""
    server = EngineServer(EngineLaunchSpec("cpu", ckpts["gpt"], weight_version=1,
                                           startup_timeout_seconds=ENGINE_START_SECONDS))
    with socket.socket() as other:
        other.bind(("127.0.0.1", server.port))
        other.listen()
        taken = server.port
        try:
            url = server.start()
            assert server.port != taken and url == f"http://127.0.0.1:{server.port}"
            assert "address already in use" in open(server.log_path).read().lower()  # the first try's bind
            result = run(_generate_once(url))
            assert result.finish_reason in ("length", "stop") and result.weight_version == 1
        finally:
            server.stop()


async def _generate_once(url: str) -> GenerateResult:
    async with EngineClient([url]) as client:
        return await client.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.0})
