"""EngineClient's reading of SGLang answers (pure logic, no server).

Pins: per-token weight versions from streamed chunks, for SGLang's default cumulative chunks and for
`--incremental-streaming-output` chunks; a finish_reason only from the chunk that carries it; versions
that are not integers (SGLang's "default") read as 0; SGLang 0.5.23's `weight_versions` spans override
the per-chunk version; the client refuses an empty engine list and an unknown pause mode; a weight
load is never re-sent after a timeout; versions come from /model_info and health() does not generate.
A batched request (one per group): one request, each item handed over as it finishes, an aborted item
ends the rest (the client hangs up) unless told otherwise, a stream cut short aborts only what had not
finished.
"""

from __future__ import annotations

import asyncio

import pytest

from miles_core.engines.client import EngineClient, _Stream, parse_version
from tests.support.timeouts import WAIT_SECONDS, await_until


def chunk(ids, lps, version, finish=None, completion=None):
    return {"text": "", "output_ids": ids,
            "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": 5,
                          "completion_tokens": len(ids) if completion is None else completion,
                          "weight_version": version,
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}


def test_cumulative_chunks_attribute_new_tokens_to_the_chunk_version():
    """SGLang's default stream repeats the whole output; only the new tail gets the chunk's version."""
    st = _Stream()
    st.absorb(chunk([4], [-0.1], "1"))
    st.absorb(chunk([4, 5], [-0.1, -0.2], "1"))
    st.absorb(chunk([4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], "2", {"type": "length", "length": 4}))
    assert st.output_ids == [4, 5, 6, 7]
    assert st.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert st.versions == [1, 1, 2, 2]
    assert st.finish == {"type": "length", "length": 4} and st.version == 2 and st.prompt_tokens == 5


def test_incremental_chunks_attribute_each_chunk():
    """With incremental streaming each chunk carries only its new tokens (completion_tokens stays
    cumulative, which tells the two modes apart)."""
    st = _Stream()
    st.absorb(chunk([4, 5], [-0.1, -0.2], "3"))
    st.absorb(chunk([6], [-0.3], "4", completion=3))
    st.absorb(chunk([11], [-0.5], "4", {"type": "stop", "matched": 11}, completion=4))
    assert st.output_ids == [4, 5, 6, 11] and st.versions == [3, 3, 4, 4]
    assert st.logprobs == [-0.1, -0.2, -0.3, -0.5]


def test_finish_only_chunk_adds_no_tokens():
    st = _Stream()
    st.absorb(chunk([4], [-0.1], "1"))
    st.absorb(chunk([4], [-0.1], "1", {"type": "abort", "message": "Abort requested"}))
    assert st.output_ids == [4] and st.versions == [1] and st.finish["type"] == "abort"


def test_parse_version():
    assert parse_version("7") == 7 and parse_version(3) == 3
    assert parse_version("default") == 0 and parse_version(None) is None


def test_client_argument_errors():
    async def bad_mode():
        async with EngineClient(["http://127.0.0.1:9"]) as c:
            await c.pause_generation("sideways")

    with pytest.raises(ValueError, match="retract, in_place, abort"):
        asyncio.run(bad_mode())


def test_weight_version_spans_override_chunk_versions():
    """SGLang 0.5.23's meta_info.weight_versions ([{version, start, end}] over the output) is exact: a
    token made before an update but streamed in a chunk assembled after it keeps the old version."""
    st = _Stream()
    st.absorb(chunk([4, 5], [-0.1, -0.2], "3"))
    late = chunk([6, 7], [-0.3, -0.4], "4", completion=4)
    late["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 3},
                                            {"version": "4", "start": 3, "end": 4}]
    st.absorb(late)
    assert st.versions == [3, 3, 3, 4] and st.version == 4


def _stub(handler):
    """Serve `handler` for every path on 127.0.0.1; returns (url, runner) inside a running loop."""
    from aiohttp import web

    async def start():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", runner

    return start()


def _batch_stub(script, seen):
    """A stub engine answering batched /generate streams: `script(body)` yields (index, chunk) pairs
    (None: end the stream without [DONE]); `seen` gets each body and whether the client hung up."""
    from aiohttp import web

    from miles_core.engines.cpu_server import _sse

    async def handler(request):
        body = await request.json()
        seen.append({"body": body, "hung_up": False})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for item in script(body):
                if item is None:
                    return resp
                await resp.write(_sse({**item[1], "index": item[0]}))
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            seen[-1]["hung_up"] = True
            raise
        finally:
            seen[-1]["ended"] = True
        return resp

    return _stub(handler)


def _run_batch(script, **kw):
    seen, order = [], []

    async def go():
        url, runner = await _batch_stub(script, seen)
        try:
            async with EngineClient([url]) as c:
                out = await c.generate_batch([[1, 2], [1, 2], [1, 2]], {"max_new_tokens": 4}, rids=["a", "b", "c"],
                                             on_result=lambda i, r: order.append(i), **kw)
                # every stream the stub served has ended: finished, or the client's hang-up noticed
                await await_until(lambda: all(s.get("ended") for s in seen), WAIT_SECONDS, "the stub's streams' end",
                                  interval=0.01)
                return out, c.in_flight()
        finally:
            await runner.cleanup()

    out, in_flight = asyncio.run(go())
    return out, order, seen, in_flight


def test_a_batch_refused_by_every_engine_and_a_malformed_batch():
    async def go():
        async with EngineClient(["http://127.0.0.1:9"], refused_wait_seconds=0.2) as c:
            return await c.generate_batch([[1], [2]], {})

    out = asyncio.run(go())
    assert [r.finish_reason for r in out] == ["abort", "abort"] and "no engine accepted" in out[0].abort_message
    with pytest.raises(ValueError, match="one rid per input"):
        asyncio.run(EngineClient([]).generate_batch([[1]], {}, rids=["a", "b"]))
