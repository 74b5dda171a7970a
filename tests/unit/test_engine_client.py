"""EngineClient's reading of SGLang answers (pure logic, no server).

Pins: per-token weight versions from streamed chunks, for SGLang's default cumulative chunks and for
`--incremental-streaming-output` chunks; a finish_reason only from the chunk that carries it; versions
that are not integers (SGLang's "default") read as 0; the client refuses an empty engine list and an
unknown pause mode.
"""

from __future__ import annotations

import asyncio

import pytest

from miles_core.engines.client import EngineClient, _Stream, parse_version


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
    with pytest.raises(ValueError, match="at least one"):
        EngineClient([])

    async def bad_mode():
        async with EngineClient(["http://127.0.0.1:9"]) as c:
            await c.pause_generation("sideways")

    with pytest.raises(ValueError, match="retract, in_place, abort"):
        asyncio.run(bad_mode())
