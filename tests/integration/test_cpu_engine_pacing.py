"""MILES_CPU_ENGINE_SECONDS_PER_TOKEN: the CPU engine as a latency-bound stand-in (bench/elastic.py).

Pins: with S seconds per token a request of k tokens takes at least k x S, and requests running beside
it take no longer (one token per step for every running request: the batch is not serialised); a
value that is not a number of seconds >= 0 is refused by name. Guards: pacing that blocks the event
loop (time.sleep) or paces each request instead of each step.
"""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
import torch

from miles_core.engines.cpu_server import SECONDS_PER_TOKEN_ENV, CpuEngineServer, serve
from miles_core.models.builtin import materialize_checkpoint

torch.set_num_threads(1)
S, TOKENS, REQUESTS = 0.1, 4, 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("pacing") / "gpt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _generate(session, url: str) -> int:
    body = {"input_ids": [1, 2, 3, 4, 10], "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as r:
        return len((await r.json())["output_ids"])


def _timed(ckpt: str, requests: int) -> tuple[float, list[int]]:
    async def main():
        server = CpuEngineServer(ckpt)
        port = _free_port()
        runner = await serve(server, "127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                lengths = await asyncio.gather(*(_generate(s, f"http://127.0.0.1:{port}") for _ in range(requests)))
                return time.monotonic() - t0, lengths
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_every_request_gets_one_token_per_step_and_steps_last_the_set_seconds(ckpt, monkeypatch):
    monkeypatch.setenv(SECONDS_PER_TOKEN_ENV, str(S))
    seconds, lengths = _timed(ckpt, REQUESTS)
    assert lengths == [TOKENS] * REQUESTS
    assert seconds >= TOKENS * S  # latency-bound: k tokens take k steps of at least S
    assert seconds < REQUESTS * TOKENS * S / 3  # batched: the requests share the steps


def test_unset_means_no_pacing(ckpt, monkeypatch):
    monkeypatch.delenv(SECONDS_PER_TOKEN_ENV, raising=False)
    seconds, _ = _timed(ckpt, 2)
    assert seconds < TOKENS * S


@pytest.mark.parametrize("value", ["fast", "-0.1", "nan"])
def test_a_bad_value_is_refused_by_name(ckpt, monkeypatch, value):
    monkeypatch.setenv(SECONDS_PER_TOKEN_ENV, value)
    with pytest.raises(ValueError, match=SECONDS_PER_TOKEN_ENV):
        CpuEngineServer(ckpt)
