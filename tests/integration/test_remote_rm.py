"""`--rm-type remote_rm --rm-url URL` against a real HTTP reward server this test starts on loopback
(aiohttp), scored through the rollout's Rewarder as a run scores.

Pins: each sample is one POST of miles' {prompt, response, label} with the prompt decoded, the answer's
JSON number (or an object's "reward") is the reward; with MILES_RM_API_KEY set every request carries
it as a bearer token; a 503 is retried with backoff until it answers; a server that stalls past the
request timeout, one that answers garbage and one that refuses (4xx, not retried) each fail only their
own samples, counted and with the reason in the sample's metadata, never the run; the token is never in
an error.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from miles_core.rollout.remote_rm import RemoteReward
from miles_core.rollout.rewards import Rewarder, load_reward
from miles_core.samples import Group, Sample, SampleStatus

REWARD_SECONDS = 60  # the rewarder's bound on one group: far past what the stub server takes
ATTEMPT_TIMEOUT_SECONDS = 0.3  # each attempt of the remote reward: /stall outlasts it, the behaviour under test

TOKEN = "rm-secret-token-123"


class RewardServer:
    """An aiohttp server on its own thread and loop; `seen` holds (path, headers, payload) of every request."""

    def __init__(self):
        self.seen: list[tuple[str, dict, dict]] = []
        self.flaky_left = 2
        self.release = threading.Event()
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.started = threading.Event()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.seen.append((request.path, dict(request.headers), payload))
        if request.path == "/score" and payload["response"] == "bad":
            return web.Response(text="???")  # one garbage answer in a group
        if request.path == "/score":
            return web.json_response(float(payload["response"].strip() == payload["label"]))
        if request.path == "/dict":
            return web.json_response({"reward": 0.25})
        if request.path == "/flaky":
            if self.flaky_left:
                self.flaky_left -= 1
                return web.Response(status=503, text="warming up")
            return web.json_response(1.0)
        if request.path == "/stall":
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
            return web.json_response(1.0)
        if request.path == "/garbage":
            return web.Response(text="<html>oops</html>")
        return web.Response(status=403, text="forbidden")

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.runner = runner
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self):
        self.thread.start()
        assert self.started.wait(30)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decode(ids):
    return "".join(chr(i) for i in ids)


def _score(fn, answers: list[str], label: str = "42") -> tuple[list[Sample], Rewarder]:
    samples = [Sample("g", 0, j, [ord(c) for c in "Q?"], [ord(c) for c in a], label=label, status=SampleStatus.COMPLETED)
               for j, a in enumerate(answers)]
    rewarder = Rewarder(fn, _decode, timeout_seconds=REWARD_SECONDS)
    try:
        asyncio.run(rewarder.score_group(Group("g", 0, samples)))
    finally:
        rewarder.close()
    return samples, rewarder


def test_a_reward_server_scores_miles_payloads_with_the_token(monkeypatch):
    monkeypatch.setenv("MILES_RM_API_KEY", TOKEN)
    with RewardServer() as server:
        fn = load_reward("", "remote_rm", server.url("/score"), _decode)
        assert isinstance(fn, RemoteReward)
        samples, rewarder = _score(fn, ["42", "41", " 42 "])
        dict_samples, _ = _score(RemoteReward(server.url("/dict"), _decode), ["x"])
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0] and rewarder.failed == 0
    assert dict_samples[0].reward == 0.25
    paths = [p for p, _, _ in server.seen]
    assert paths.count("/score") == 3
    for path, headers, payload in server.seen:
        assert headers["Authorization"] == f"Bearer {TOKEN}"
        assert set(payload) == {"prompt", "response", "label"} and payload["prompt"] == "Q?" and payload["label"] == "42"


def test_retries_stalls_garbage_and_refusals_fail_only_their_samples(monkeypatch):
    monkeypatch.setenv("MILES_RM_API_KEY", TOKEN)
    with RewardServer() as server:
        flaky, _ = _score(RemoteReward(server.url("/flaky"), _decode, backoff=0.01), ["42"])
        outcomes = {}
        for path in ("/stall", "/garbage", "/refused"):
            fn = RemoteReward(server.url(path), _decode, timeout=ATTEMPT_TIMEOUT_SECONDS, retries=2, backoff=0.01)
            samples, rewarder = _score(fn, ["42"])
            outcomes[path] = (samples[0], rewarder.failed)
        server.release.set()
    assert flaky[0].reward == 1.0 and [p for p, _, _ in server.seen].count("/flaky") == 3  # two 503s, then 1.0
    for path, (sample, failed) in outcomes.items():
        assert failed == 1 and sample.status == SampleStatus.FAILED and sample.reward is None, path
        reason = json.loads(sample.metadata)["reward_error"]
        assert TOKEN not in reason, reason
        outcomes[path] = reason
    assert "failed 3 times" in outcomes["/stall"] and "TimeoutError" in outcomes["/stall"]
    assert "not JSON" in outcomes["/garbage"]
    assert "HTTP 403" in outcomes["/refused"]
    assert [p for p, _, _ in server.seen].count("/refused") == 1  # a 4xx is not retried


def test_one_bad_answer_fails_one_sample_of_its_group(monkeypatch):
    """A group whose server answers garbage for one sample: the others keep their rewards."""
    monkeypatch.delenv("MILES_RM_API_KEY", raising=False)
    with RewardServer() as server:
        samples, rewarder = _score(RemoteReward(server.url("/score"), _decode), ["42", "bad", "7"])
    assert [s.reward for s in samples] == [1.0, None, 0.0] and rewarder.failed == 1
    assert samples[1].status == SampleStatus.FAILED
    assert all("Authorization" not in h for _, h, _ in server.seen)
