"""The engine client against a stub HTTP engine server on loopback (tests/unit runs no servers).
"""

from __future__ import annotations

import asyncio

import pytest

from miles_core.engines.client import EngineClient
from tests.unit.test_engine_client import _run_batch, _stub, chunk

CONTROL_TIMEOUT_SECONDS = 0.3  # the client's bound on a control call: the stub's 1 s weight update passes it


def test_client_reads_long_sse_chunks_from_a_stub_server():
    """Through a real HTTP stream from a stub on 127.0.0.1: a cumulative chunk longer than aiohttp's
    128 KiB line limit is read whole (long SGLang answers with log-probs get there), versions are
    attributed per chunk, and a stream cut before its finish comes back as an abort."""
    from aiohttp import web

    from miles_core.engines.cpu_server import _sse

    n = 12000  # ~300 KB for the last cumulative chunk

    async def generate(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids = list(range(n))
        await resp.write(_sse(chunk(ids[:10], [-0.5] * 10, "4")))
        if body["rid"] == "cut":
            return resp  # the handler ends without a finish chunk or [DONE]
        await resp.write(_sse(chunk(ids, [-0.5] * n, "5", {"type": "length", "length": n})))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with EngineClient([f"http://127.0.0.1:{port}"]) as c:
                return await c.generate([1, 2], {"max_new_tokens": n}, rid="long"), \
                    await c.generate([1, 2], {"max_new_tokens": n}, rid="cut")
        finally:
            await runner.cleanup()

    res, cut = asyncio.run(go())
    assert res.finish_reason == "length" and len(res.output_ids) == n == len(res.output_logprobs)
    assert res.token_versions == [4] * 10 + [5] * (n - 10) and res.weight_version == 5
    assert cut.aborted and cut.output_ids == list(range(10)) and cut.token_versions == [4] * 10


def test_weight_load_is_never_resent_after_a_timeout_and_versions_come_from_model_info():
    """/update_weights_from_disk that times out (a slow load) is sent once and raises
    EngineUnavailableError; idempotent calls are retried. Versions come from /model_info (never
    /get_weight_version), and health() probes /model_info, not /health."""
    from aiohttp import web

    from miles_core.engines.client import EngineUnavailableError

    seen = []

    async def handler(request):
        seen.append(request.path)
        if request.path == "/update_weights_from_disk":
            await asyncio.sleep(1.0)  # the behaviour under test: a weight update slower than the control timeout
        if request.path == "/pause_generation" and seen.count("/pause_generation") == 1:
            return web.Response(status=503)
        return web.json_response({"weight_version": "9", "message": "ok", "status": "ok"})

    async def go():
        url, runner = await _stub(handler)
        try:
            async with EngineClient([url], control_timeout_seconds=CONTROL_TIMEOUT_SECONDS,
                                    retry_backoff_seconds=0.01) as c:
                with pytest.raises(EngineUnavailableError, match="update_weights_from_disk"):
                    await c.update_weights_from_disk("/ckpt", 9)
                await c.pause_generation("retract")  # a 503, then retried
                return await c.get_weight_version(), await c.health(url), url
        finally:
            await runner.cleanup()

    versions, alive, url = asyncio.run(go())
    assert seen.count("/update_weights_from_disk") == 1 and seen.count("/pause_generation") == 2
    assert versions == {url: 9} and alive
    assert "/get_weight_version" not in seen and "/health" not in seen


def test_a_client_without_engines_waits_for_set_urls_and_counts_a_dropped_engine_until_it_is_done():
    """A fleet of 0 engines: the client is built without URLs, a generate waits (no abort) until
    `set_urls` gives it an engine. An engine dropped by `set_urls` gets no new request, and
    `in_flight` counts its request in flight until that answers. `served_versions` records the
    versions each engine generated with."""
    from aiohttp import web

    release = asyncio.Event()

    async def handler(request):
        body = await request.json()
        if body["rid"] == "slow":
            await release.wait()
        return web.json_response({"output_ids": [1, 2], "meta_info": {
            "weight_version": "7", "completion_tokens": 2, "prompt_tokens": 1,
            "output_token_logprobs": [[-0.1, 1], [-0.2, 2]], "finish_reason": {"type": "stop"}}})

    async def go():
        url, runner = await _stub(handler)
        try:
            async with EngineClient([], refused_wait_seconds=10.0) as c:
                assert c.urls == [] and c.in_flight() == {}
                waiting = asyncio.ensure_future(c.generate([1], {}, rid="first", stream=False))
                # A negative check: the request must not end, and nothing signals "still waiting", so it gets 0.3 s.
                await asyncio.sleep(0.3)
                assert not waiting.done()  # no engine: it waits instead of aborting
                c.set_urls([url])
                first = await asyncio.wait_for(waiting, 5)
                slow = asyncio.ensure_future(c.generate([1], {}, rid="slow", stream=False))
                while not c.in_flight()[url]:
                    await asyncio.sleep(0.01)
                c.set_urls([])
                assert c.urls == [] and c.in_flight() == {url: 1}  # dropped, still answering
                release.set()
                await asyncio.wait_for(slow, 5)
                return first, c.in_flight(), c.served_versions(), url
        finally:
            await runner.cleanup()

    first, after, served, url = asyncio.run(go())
    assert first.finish_reason == "stop" and first.engine_url == url
    assert after == {}
    assert served == {url: {"min_version": 7, "max_version": 7, "requests": 2}}


def test_a_batch_is_one_request_and_each_item_is_handed_over_as_it_finishes():
    """SGLang's batched /generate: one request with lists of input_ids and rids; streamed chunks carry
    their item's index, in any order. Each item's result goes to on_result when its finish arrives."""
    def script(body):
        yield 1, chunk([7], [-0.1], "3")
        yield 0, chunk([5, 6], [-0.2, -0.3], "3", {"type": "stop"})
        yield 2, chunk([8], [-0.4], "3", {"type": "length", "length": 1})
        yield 1, chunk([9], [-0.5], "4", {"type": "stop"}, completion=2)

    out, order, seen, in_flight = _run_batch(script)
    assert len(seen) == 1 and seen[0]["body"]["input_ids"] == [[1, 2]] * 3 and seen[0]["body"]["rid"] == ["a", "b", "c"]
    assert seen[0]["body"]["sampling_params"] == {"max_new_tokens": 4}  # one dict for all items
    assert order == [0, 2, 1]
    assert [r.rid for r in out] == ["a", "b", "c"] and [r.finish_reason for r in out] == ["stop", "stop", "length"]
    assert out[1].output_ids == [7, 9] and out[1].token_versions == [3, 4] and out[0].output_logprobs == [-0.2, -0.3]
    assert all(n == 0 for n in in_flight.values())


def test_an_aborted_item_ends_the_batch_and_the_rest_come_back_aborted_with_their_tokens():
    """One item aborted: the client hangs up (the engine aborts the rest), the finished item keeps its
    result and the unfinished ones end aborted with what they had."""
    def script(body):
        yield 0, chunk([5], [-0.2], "3", {"type": "stop"})
        yield 2, chunk([8], [-0.4], "3")
        yield 1, chunk([], [], "3", {"type": "abort", "message": "engine paused"}, completion=0)
        for k in range(2, 52):
            yield 2, chunk([8], [-0.4], "3", completion=k)

    out, order, seen, _ = _run_batch(script)
    assert [r.finish_reason for r in out] == ["stop", "abort", "abort"] and order == [0, 1, 2]
    assert out[2].output_ids == [8] and "another request of its group was aborted" in out[2].abort_message
    assert seen[0]["hung_up"]
    out, _, seen, _ = _run_batch(script, abort_rest=False)  # asked to keep the rest going
    assert [r.finish_reason for r in out] == ["stop", "abort", "abort"] and len(out[2].output_ids) == 51
    assert not seen[0]["hung_up"]


def test_a_batch_cut_short_keeps_the_finished_items_and_aborts_the_rest():
    def script(body):
        yield 0, chunk([5], [-0.2], "3", {"type": "stop"})
        yield 1, chunk([6], [-0.2], "3")
        yield None

    out, order, _, _ = _run_batch(script)
    assert [r.finish_reason for r in out] == ["stop", "abort", "abort"] and order == [0, 1, 2]
    assert out[1].output_ids == [6] and "without a finish_reason" in out[1].abort_message
