"""A remote reward model over HTTP (`--rm-url URL`), miles' request and response shape.

Each sample is one POST of miles' payload, `{"prompt": ..., "response": ..., "label": ...}` (prompt and
response decoded with the run's tokenizer), and the answer's JSON body is the reward: a number (a
JSON object with a numeric "reward" or "score" is read too). A group's samples are sent together,
at most `CONCURRENCY` requests in flight. Every request has its own timeout (`REQUEST_TIMEOUT_SECONDS`)
and is tried again after a connection error, a timeout or a 5xx/429 answer, `RETRIES` times with
exponential backoff (`BACKOFF_SECONDS` doubling); a 4xx answer or a body that is not a number is not
retried. A sample whose request finally fails is a failed reward like any other: marked `failed`,
its reason in its metadata, counted in `rollout/reward_failed` and summarised on the console
(docs/algorithms.md#a-remote-reward-model); `--reward-timeout-seconds` bounds the whole group.

Authentication is the engine API token's style: with `MILES_RM_API_KEY` set in the environment of the
processes that score (on Flyte: a secret), every request carries `Authorization: Bearer <token>`. The
token never travels in flags, configs or logs; the URL is logged without its query string.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from typing import Callable
from urllib.parse import urlsplit

TOKEN_ENV = "MILES_RM_API_KEY"
CONCURRENCY = 32
REQUEST_TIMEOUT_SECONDS = 30.0
RETRIES = 3
BACKOFF_SECONDS = 0.5
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def shown(url: str) -> str:
    """The URL fit for a log or an error: scheme, host, port and path only."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}{u.path}"


def reward_value(body: str) -> float:
    """The reward in an answer's body: a JSON number, or an object's numeric "reward" or "score"."""
    try:
        value = json.loads(body)
    except ValueError:
        raise RemoteRewardError(f"the reward model answered {body[:80]!r}, not JSON") from None
    if isinstance(value, dict):
        value = value.get("reward", value.get("score"))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise RemoteRewardError(f"the reward model answered {body[:80]!r}, not a number")
    return float(value)


class RemoteReward:
    """The batched reward function of `--rm-url` (rollout.rewards' contract: `(samples, texts)`, async):
    one value per sample, or the exception that failed that sample."""

    batched = True
    needs_text = True

    def __init__(self, url: str, decode: Callable[[list[int]], str], *, timeout: float = REQUEST_TIMEOUT_SECONDS,
                 retries: int = RETRIES, backoff: float = BACKOFF_SECONDS, concurrency: int = CONCURRENCY):
        self.url, self.decode = url, decode
        self.timeout, self.retries, self.backoff, self.concurrency = timeout, retries, backoff, concurrency
        self.__qualname__ = f"--rm-url {shown(url)}"

    async def __call__(self, samples, texts) -> list:
        import aiohttp

        token = os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        gate = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            async def one(sample, text):
                payload = {"prompt": self.decode(list(sample.prompt_ids)), "response": text, "label": sample.label}
                async with gate:
                    try:
                        return await self._post(session, payload)
                    except RemoteRewardError as e:
                        return e

            return list(await asyncio.gather(*(one(s, t) for s, t in zip(samples, texts))))

    async def _post(self, session, payload: dict) -> float:
        import aiohttp

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                async with session.post(self.url, json=payload) as resp:
                    body = await resp.text()
                    if resp.status in RETRY_STATUSES:
                        last = f"HTTP {resp.status}"
                        continue
                    if resp.status >= 400:
                        raise RemoteRewardError(f"{shown(self.url)} answered HTTP {resp.status}: {body[:120]!r}")
                    return reward_value(body)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise RemoteRewardError(f"{shown(self.url)} failed {self.retries + 1} times (last: {last})")
