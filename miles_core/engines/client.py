"""One async client for SGLang's native HTTP API, driving real SGLang servers and the CPU engine alike.

`EngineClient` holds several engine URLs and one aiohttp session (connection reuse). `generate`
picks the engine with the fewest requests in flight from this client. Every other call is a control
call fanned out to all engines (or one, where it takes `url`). The engines change with the fleet
(`set_urls`): a client may start with none (a generate then waits, as for refused connections below,
for one to be set); a dropped engine gets no new request and `in_flight` counts its requests until
they end; `served_versions` tells, per engine, the weight versions it generated with.

Failure rules (docs/engines.md):
- a `/generate` that may have reached the engine is never sent again. If the engine dies, drops the
  connection, answers 5xx, or the request times out, the call returns a `GenerateResult` with
  `finish_reason == "abort"` and the tokens streamed so far; it does not raise. Only a connection
  that was refused (the request never left) is tried on another engine; when every engine refused
  (the only one is restarting), the request waits and tries again, backing off 0.05 s doubling to
  1 s, for up to `refused_wait_seconds` (30 s) before it returns aborted: a restarting engine
  is waited for, not answered with a storm of aborted groups.
- a 4xx answer to `/generate` is a bug in the request: `EngineRequestError`.
- control calls (`/model_info`, pause/continue, `/flush_cache`, `/abort_request`) are idempotent and
  retried on connection errors, timeouts and 5xx; when retries run out, `EngineControlError` names the
  engine and the endpoint (`EngineUnavailableError`, a subclass, when the engine never answered:
  connection error, timeout or 5xx). A 4xx answer is final and not retried.
- `/update_weights_from_disk` is retried only when the connection was refused (the request never
  left): a load that timed out or lost its connection may still be running, and a second one would load
  twice (SGLang serializes them); it raises `EngineUnavailableError` at once.
- versions are read from `/model_info`'s `weight_version` (SGLang 0.5.23 answers `/get_weight_version`
  with 404; `/get_model_info` is its deprecated alias, used only when `/model_info` is 404).
- `health(url)` is a liveness probe that does not generate: `GET /model_info`. SGLang's `/health`
  generates a token and answers 503 during a pause; `health_generate(url)` asks it, for a caller that
  wants the model exercised (the launcher, at start).
- the distributed weight-update calls (`/init_weights_update_group`, `/update_weights_from_distributed`,
  `/destroy_weights_update_group`; `miles_core.weights.distributed`) are never retried: the engine
  takes part in a collective, and a second request would wait forever for a peer. Each takes its own
  `timeout_seconds`.

Per-token weight versions: with `stream=True` (the default) the client reads SGLang's SSE stream
(`data: {json}` lines, then `data: [DONE]`). SGLang's default chunks are cumulative (`output_ids`,
`text`, `meta_info.output_token_logprobs` hold the whole output so far); with
`--incremental-streaming-output` (the launcher sets it; the CPU engine's default) they hold only what is
new. The client tells the two apart by `meta_info.completion_tokens` (always cumulative). A token's
version: from `meta_info.weight_versions` ([{version, start, end}] over the output tokens, SGLang 0.5.23,
present once a request straddled an update) when the chunk has it; otherwise the chunk's
`meta_info.weight_version`, which is the server's version when the chunk was assembled (so a token made
just before an update but streamed after it would be credited to the new version; the spans are exact).
Without streaming the spans (or the final version) apply. Versions are integers; an engine that
reports a non-integer version (SGLang's "default" before the first update) is read as version 0.

Routed experts (rollout routing replay): `return_routed_experts=True` sends SGLang's request field; the
finished answer's `meta_info.routed_experts` (base64 int32, [positions, num_hidden_layers, top-k]: every
position but the last, dense layers zeros) becomes `GenerateResult.routed_experts`, the flat id list in
that layout (`moe_layer_routes` keeps the MoE layers). An engine launched without
`--enable-return-routed-experts` omits the field (SGLang does so silently): a finished, not aborted
answer without it raises `EngineRequestError` naming the option, rather than a sample without routes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp

from miles_core.engines.auth import auth_headers

log = logging.getLogger(__name__)


class EngineRequestError(ValueError):
    """The engine refused a /generate request as malformed (HTTP 4xx)."""

    def __init__(self, message: str):
        super().__init__(message)


class EngineControlError(RuntimeError):
    """A control call to an engine failed after its retries."""

    def __init__(self, message: str):
        super().__init__(message)


class EngineUnavailableError(EngineControlError):
    """The engine gave no answer (connection error, timeout or 5xx), as opposed to refusing (4xx)."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]  # the weight version that produced each output token
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int | None  # the engine's version at the last chunk
    prompt_tokens: int
    completion_tokens: int
    rid: str
    engine_url: str = ""
    abort_message: str = ""
    seconds: float = 0.0
    first_token_seconds: float | None = None  # from the request to its first streamed token
    routed_experts: list[int] | None = None  # asked for: SGLang's [positions, num_hidden_layers, top-k], flat

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclass
class _Engine:
    url: str
    in_flight: int = 0
    suspect_until: float = 0.0  # after a refused connection, avoid this engine for a while


@dataclass
class _Stream:
    """Accumulates a streamed (or single) /generate answer."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: dict | None = None
    version: int | None = None
    prompt_tokens: int = 0
    first_token_at: float | None = None  # time.monotonic() of the first chunk with a token
    want_routes: bool = False  # the request asked for routed experts
    routed_experts: list[int] | None = None

    def result(self, rid: str, url: str, t0: float) -> "GenerateResult":
        """The finished answer (`finish` set)."""
        kind = self.finish.get("type", "abort")
        if self.want_routes and self.routed_experts is None and kind != "abort":
            raise EngineRequestError(f"{url}/generate: request {rid} asked for return_routed_experts but the answer "
                                     "has no meta_info.routed_experts; launch the engine with "
                                     "--enable-return-routed-experts (a mixture-of-experts model)")
        return GenerateResult(self.output_ids, self.logprobs, self.versions, kind, self.version, self.prompt_tokens,
                              len(self.output_ids), rid, url, self.finish.get("message", "") if kind == "abort" else "",
                              time.monotonic() - t0, None if self.first_token_at is None else self.first_token_at - t0,
                              self.routed_experts)

    def absorb(self, chunk: dict) -> None:
        meta = chunk.get("meta_info") or {}
        if self.first_token_at is None and chunk.get("output_ids"):
            self.first_token_at = time.monotonic()
        ids = chunk.get("output_ids") or []
        done = int(meta.get("completion_tokens", len(self.output_ids) + len(ids)))
        have = len(self.output_ids)
        new_ids = ids[have:] if len(ids) == done else ids  # cumulative (default) or incremental chunks
        lps = meta.get("output_token_logprobs") or []
        new_lps = lps[have:] if len(lps) == done else lps
        self.version = parse_version(meta.get("weight_version"))
        self.output_ids.extend(int(t) for t in new_ids)
        self.logprobs.extend(float(e[0]) for e in new_lps)
        self.versions.extend([self.version if self.version is not None else 0] * len(new_ids))
        self._apply_spans(meta.get("weight_versions"))
        self.prompt_tokens = int(meta.get("prompt_tokens", self.prompt_tokens))
        if meta.get("routed_experts") is not None:
            self.routed_experts = decode_routed_experts(meta["routed_experts"])
        if meta.get("finish_reason") is not None:
            self.finish = meta["finish_reason"]

    def _apply_spans(self, spans: list | None) -> None:
        """SGLang's exact per-token versions ([{version, start, end}], absolute token indices) override
        the per-chunk attribution for the tokens they cover."""
        for span in spans or ():
            v = parse_version(span.get("version"))
            for i in range(max(0, int(span["start"])), min(int(span["end"]), len(self.versions))):
                self.versions[i] = v if v is not None else 0


class _Batch:
    """The items of one /generate request: their streams, and each result once it finished (handed to
    `on_result` at once). A single request (`rid` a string: one flat `input_ids`, one answer object) is
    a batch of one."""

    def __init__(self, payload: dict, t0: float, note: Callable, on_result: Callable | None = None,
                 abort_rest: bool = False):
        self.payload, self.t0, self._note, self._on_result, self._abort_rest = payload, t0, note, on_result, abort_rest
        self.single = not isinstance(payload["rid"], list)
        self.rids: list[str] = [payload["rid"]] if self.single else payload["rid"]
        inputs = [payload["input_ids"]] if self.single else payload["input_ids"]
        routes = bool(payload.get("return_routed_experts"))
        self.streams = [_Stream(prompt_tokens=len(ids), want_routes=routes) for ids in inputs]
        self._results: list[GenerateResult | None] = [None] * len(self.rids)

    def absorb(self, i: int, chunk: dict, url: str) -> bool:
        """Fold one answer or chunk of item i in; True when it ended the item aborted and the rest should
        end too."""
        if not 0 <= i < len(self.rids) or self._results[i] is not None:
            return False
        st = self.streams[i]
        st.absorb(chunk)
        if st.finish is None:
            return False
        self._end(i, st.result(self.rids[i], url, self.t0))
        return self._abort_rest and self._results[i].aborted and bool(self.unfinished_rids())

    def end_rest(self, client: "EngineClient", url: str, message: str) -> None:
        for i, rid in enumerate(self.rids):
            if self._results[i] is None:
                self._end(i, client._aborted(rid, self.streams[i], url, message, self.t0))

    def unfinished_rids(self) -> list[str]:
        return [rid for rid, r in zip(self.rids, self._results) if r is None]

    def results(self) -> list["GenerateResult"]:
        return list(self._results)

    def _end(self, i: int, result: "GenerateResult") -> None:
        self._results[i] = self._note(result)
        if self._on_result is not None:
            self._on_result(i, result)


async def _sse_data(content: aiohttp.StreamReader):
    """The payloads of `data:` lines. Split by hand: a cumulative chunk of a long answer can be longer
    than aiohttp's line limit (128 KiB), which `async for line in content` would refuse."""
    buf = b""
    async for piece in content.iter_any():
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip()


def _routes_field(wanted: bool) -> dict:
    return {"return_routed_experts": True} if wanted else {}


def decode_routed_experts(b64: str) -> list[int]:
    """SGLang's `meta_info.routed_experts` (base64 of int32, native little-endian) as a flat list of ids."""
    raw = base64.b64decode(b64)
    if len(raw) % 4:
        raise EngineRequestError(f"meta_info.routed_experts holds {len(raw)} bytes, not whole int32s")
    return memoryview(raw).cast("i").tolist()


def moe_layer_routes(ids: list[int], num_layers: int, moe_layers: tuple[int, ...], topk: int) -> list[int]:
    """SGLang's flat [positions, num_hidden_layers, top-k] routed experts restricted to the MoE layers
    (in `moe_layers` order): the flat [positions, MoE layers, top-k] a sample keeps."""
    per = num_layers * topk
    if per == 0 or len(ids) % per:
        raise EngineRequestError(f"{len(ids)} routed expert ids are not a whole number of positions x "
                                 f"{num_layers} layers x top-{topk}")
    return [ids[p * per + layer * topk + j] for p in range(len(ids) // per) for layer in moe_layers
            for j in range(topk)]


def parse_version(v: Any) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class EngineClient:
    """Async client over N engines. Use inside one event loop; `async with` or `await close()`."""

    def __init__(self, urls: list[str], *, request_timeout_seconds: float = 600.0,
                 connect_timeout_seconds: float = 10.0, control_timeout_seconds: float = 120.0,
                 control_retries: int = 3, retry_backoff_seconds: float = 0.5, refused_wait_seconds: float = 30.0):
        self._engines = [_Engine(u.rstrip("/")) for u in urls]  # none: generate waits for `set_urls`
        self._leaving: list[_Engine] = []  # dropped by set_urls with requests still in flight
        self._served: dict[str, list[int]] = {}  # url -> [lowest, highest token version, requests]
        self.request_timeout_seconds = request_timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        self.control_timeout_seconds = control_timeout_seconds
        self.control_retries = control_retries
        self.retry_backoff_seconds = retry_backoff_seconds
        self.refused_wait_seconds = refused_wait_seconds
        self._session: aiohttp.ClientSession | None = None
        self._rr = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: no client-side cap; the producer's submission budget bounds concurrency.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                                  headers=auth_headers())
        return self._session

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self._engines]

    def set_urls(self, urls: list[str]) -> None:
        """Replace the engine list (e.g. after the fleet changed); in-flight counts of kept URLs stay. A
        dropped engine gets no new request; its requests in flight finish (or abort) and `in_flight`
        counts them until they do."""
        old = {e.url: e for e in [*self._leaving, *self._engines]}
        self._engines = [old.pop(u.rstrip("/"), None) or _Engine(u.rstrip("/")) for u in dict.fromkeys(urls)]
        self._leaving = [e for e in old.values() if e.in_flight > 0]

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per engine, engines dropped by `set_urls` included while they have any."""
        self._leaving = [e for e in self._leaving if e.in_flight > 0]
        return {e.url: e.in_flight for e in [*self._engines, *self._leaving]}

    def served_versions(self) -> dict[str, dict[str, int]]:
        """Per engine URL ever answered: the lowest and highest weight version of the tokens it generated,
        and how many answers had tokens (what a joining engine served: never below its joining version)."""
        return {u: {"min_version": lo, "max_version": hi, "requests": n} for u, (lo, hi, n) in self._served.items()}

    def _note_served(self, result: "GenerateResult") -> "GenerateResult":
        if result.token_versions and result.engine_url:
            lo, hi = min(result.token_versions), max(result.token_versions)
            seen = self._served.setdefault(result.engine_url, [lo, hi, 0])
            seen[0], seen[1], seen[2] = min(seen[0], lo), max(seen[1], hi), seen[2] + 1
        return result

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, *, rid: str | None = None,
                       return_logprob: bool = True, stream: bool = True, url: str | None = None,
                       return_routed_experts: bool = False) -> GenerateResult:
        """Generate on the least-loaded engine (or `url`). Never raises for engine failures: see module doc."""
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                   "rid": rid or uuid.uuid4().hex, "return_logprob": return_logprob, "stream": stream,
                   **_routes_field(return_routed_experts)}
        return (await self._generate(url, _Batch(payload, time.monotonic(), self._note_served)))[0]

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: dict | list[dict] | None = None, *,
                             rids: list[str] | None = None, return_logprob: bool = True, stream: bool = True,
                             url: str | None = None, on_result: Callable[[int, GenerateResult], None] | None = None,
                             abort_rest: bool = True, return_routed_experts: bool = False) -> list[GenerateResult]:
        """Generate several inputs in one request to one engine (SGLang's batched `/generate`: lists of
        `input_ids` and `rid`; each streamed chunk carries its item's `index`). `sampling_params`: one
        dict for every item, or one per item. `on_result(i, result)` runs as soon as item i finished.
        The failure rules of `generate` hold per item: an item never raises for an engine failure, it
        ends aborted with its tokens so far. `abort_rest`: when an item ends aborted, the request is
        closed (the engine aborts what is left) and the unfinished items end aborted at once."""
        rids = list(rids) if rids is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != len(input_ids) or not input_ids:
            raise ValueError(f"generate_batch needs one rid per input and at least one input "
                             f"({len(input_ids)} inputs, {len(rids)} rids)")
        params = [dict(p) for p in sampling_params] if isinstance(sampling_params, list) else dict(sampling_params or {})
        payload = {"input_ids": [list(ids) for ids in input_ids], "sampling_params": params, "rid": rids,
                   "return_logprob": return_logprob, "stream": stream, **_routes_field(return_routed_experts)}
        return await self._generate(url, _Batch(payload, time.monotonic(), self._note_served, on_result, abort_rest))

    async def _generate(self, url: str | None, batch: "_Batch") -> list[GenerateResult]:
        """`batch` on an engine (another when one refuses the connection); its results, in order."""
        out = await self._on_an_engine(url, len(batch.rids), lambda eng: self._generate_on(eng, batch), batch.t0)
        if isinstance(out, str):
            batch.end_rest(self, "", out)
        return batch.results()

    async def _on_an_engine(self, url: str | None, size: int, attempt: Callable[[_Engine], Awaitable[Any]],
                            t0: float) -> Any:
        """`attempt` on the least-loaded engine (or `url`), on another when the connection is refused
        (the request never left); when every engine refused, wait for one (backing off) for up to
        `refused_wait_seconds`, then return the reason as a string."""
        tried: set[str] = set()
        rounds = 0
        while True:
            eng = self._pick(url, tried)
            if eng is None:  # every engine refused the connection: wait for one to come back
                wait = min(0.05 * 2 ** rounds, 1.0)
                if time.monotonic() - t0 + wait > self.refused_wait_seconds:
                    return f"no engine accepted the connection within {self.refused_wait_seconds:g} s"
                await asyncio.sleep(wait)
                tried.clear()
                rounds += 1
                continue
            tried.add(eng.url)
            eng.in_flight += size
            try:
                return await attempt(eng)
            except aiohttp.ClientConnectorError as e:  # refused: the request never left, safe elsewhere
                eng.suspect_until = time.monotonic() + 2.0
                if rounds == 0:
                    log.warning("engine %s refused the connection (%s); trying another", eng.url, e)
            finally:
                eng.in_flight -= size

    def _pick(self, url: str | None, tried: set[str]) -> _Engine | None:
        if url is not None:
            url = url.rstrip("/")
            if url in tried:
                return None
            return next((e for e in self._engines if e.url == url), None) or _Engine(url)
        now = time.monotonic()
        cands = [e for e in self._engines if e.url not in tried]
        if not cands:
            return None
        healthy = [e for e in cands if e.suspect_until <= now] or cands
        low = min(e.in_flight for e in healthy)
        best = [e for e in healthy if e.in_flight == low]
        self._rr += 1
        return best[self._rr % len(best)]

    async def _generate_on(self, eng: _Engine, batch: "_Batch") -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_seconds, sock_connect=self.connect_timeout_seconds)
        try:
            async with self._sess().post(eng.url + "/generate", json=batch.payload, timeout=timeout) as resp:
                if 400 <= resp.status < 500:
                    raise EngineRequestError(f"{eng.url}/generate answered {resp.status}: {await resp.text()}")
                if resp.status >= 500:
                    return batch.end_rest(self, eng.url, f"HTTP {resp.status}: {await resp.text()}")
                if not batch.payload["stream"]:
                    answers = await resp.json()
                    answers = [answers] if batch.single else answers
                    for i, answer in enumerate(answers if isinstance(answers, list) else []):
                        batch.absorb(i, answer, eng.url)
                    return batch.end_rest(self, eng.url, "the answer had no finish_reason for it")
                async for data in _sse_data(resp.content):
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if batch.absorb(int(chunk.get("index", 0)), chunk, eng.url):
                        resp.close()  # an item aborted: the engine aborts the rest when the connection closes
                        return batch.end_rest(self, eng.url, "another request of its group was aborted")
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, json.JSONDecodeError) as e:
            if isinstance(e, asyncio.TimeoutError):  # the engine may still be working on them
                for rid in batch.unfinished_rids():
                    asyncio.get_running_loop().create_task(self._abort_quietly(eng.url, rid))
            return batch.end_rest(self, eng.url, f"{type(e).__name__}: {e}")
        batch.end_rest(self, eng.url, "the stream ended without a finish_reason")

    def _aborted(self, rid: str, st: _Stream, url: str, message: str, t0: float):
        log.info("request %s on %s aborted: %s", rid, url or "-", message)
        return GenerateResult(st.output_ids, st.logprobs, st.versions, "abort", st.version, st.prompt_tokens,
                              len(st.output_ids), rid, url, message, time.monotonic() - t0)

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            await self.abort_request(rid, url=url)
        except EngineControlError:
            pass

    # ---- control ------------------------------------------------------------------------------
    async def _control(self, url: str, method: str, path: str, body: dict | None = None,
                       retries: int | None = None, timeout_seconds: float | None = None,
                       only_refused: bool = False) -> Any:
        """One control call with retries; returns parsed JSON (or text, or None). `only_refused`: retry
        only a refused connection (the request never left), never a timeout, a dropped connection or a
        5xx (the engine may be doing it)."""
        retries = self.control_retries if retries is None else retries
        total = self.control_timeout_seconds if timeout_seconds is None else timeout_seconds
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=min(self.connect_timeout_seconds, total))
        last, answered = "", False
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_seconds * 2 ** (attempt - 1))
            try:
                async with self._sess().request(method, url + path, json=body, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status < 400:
                        try:
                            return json.loads(text) if text else None
                        except json.JSONDecodeError:
                            return text
                    last = f"HTTP {resp.status}: {text[:500]}"
                    if resp.status < 500:
                        answered = True
                        break  # the engine said no; asking again will not change that
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if only_refused and not isinstance(e, aiohttp.ClientConnectorError):
                    break
            if only_refused and not answered and last.startswith("HTTP 5"):
                break
        error = EngineControlError if answered else EngineUnavailableError
        raise error(f"{method} {url}{path} failed: {last}")

    async def _all(self, method: str, path: str, body: dict | None = None, retries: int | None = None,
                   only_refused: bool = False) -> dict:
        urls = self.urls
        res = await asyncio.gather(*(self._control(u, method, path, body, retries, only_refused=only_refused)
                                     for u in urls))
        return dict(zip(urls, res))

    async def health(self, url: str, timeout_seconds: float = 5.0) -> bool:
        """Liveness, one probe, no retries, no generation: True when GET /model_info answers 200 (it does
        during a pause, unlike SGLang's /health)."""
        return await self._probe(url, "/model_info", timeout_seconds)

    async def health_generate(self, url: str, timeout_seconds: float = 30.0) -> bool:
        """SGLang's /health: True when the engine generated (or was generating) within its health-check
        timeout. False while generation is paused."""
        return await self._probe(url, "/health", timeout_seconds)

    async def _probe(self, url: str, path: str, timeout_seconds: float) -> bool:
        try:
            async with self._sess().get(url.rstrip("/") + path,
                                        timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            return False

    async def health_all(self) -> dict[str, bool]:
        urls = self.urls
        return dict(zip(urls, await asyncio.gather(*(self.health(u) for u in urls))))

    async def model_info(self, url: str) -> dict:
        """GET /model_info (retried like every idempotent call); `/get_model_info` when it is 404."""
        url = url.rstrip("/")
        try:
            return await self._control(url, "GET", "/model_info")
        except EngineControlError as e:
            if isinstance(e, EngineUnavailableError) or "HTTP 404" not in str(e):
                raise
            return await self._control(url, "GET", "/get_model_info")

    async def get_weight_version(self) -> dict[str, int | None]:
        """Each engine's served version: `/model_info`'s `weight_version`."""
        urls = self.urls
        infos = await asyncio.gather(*(self.model_info(u) for u in urls))
        return {u: parse_version((r or {}).get("weight_version")) for u, r in zip(urls, infos)}

    async def pause_generation(self, mode: str) -> None:
        if mode not in ("retract", "in_place", "abort"):
            raise ValueError(f"pause mode {mode!r}; expected one of retract, in_place, abort")
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._all("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache")

    async def update_weights_from_disk(self, model_path: str, weight_version: int, *, flush_cache: bool = False,
                                       abort_all_requests: bool = False) -> None:
        """Every engine loads `model_path` and reports `weight_version` from then on. `flush_cache`: SGLang
        flushes after loading and fails the call when requests are running (or waiting while not
        paused); `WeightSync` sends false (see miles_core.weights.sync). Never re-sent after a timeout."""
        body = {"model_path": model_path, "weight_version": str(weight_version), "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests}
        res = await self._all("POST", "/update_weights_from_disk", body, only_refused=True)
        bad = {u: r for u, r in res.items() if isinstance(r, dict) and r.get("success") is False}
        if bad:
            raise EngineControlError(f"update_weights_from_disk({model_path}) failed on {bad}")

    async def stage_weights_from_disk(self, model_path: str) -> list[str]:
        """Before a pause: every engine that can reads `model_path` and builds the model beside the one it
        serves, so the `update_weights_from_disk` of the same path that follows only swaps it in. The CPU
        engine's own endpoint; an engine without it (SGLang: 404) loads from disk when asked, as before.
        Changes nothing an engine serves. Returns the URLs that staged; raises EngineControlError when
        an engine that has the endpoint failed to read the path (its load would fail the same way)."""
        async def one(url: str) -> bool:
            try:
                self._success(await self._control(url, "POST", "/stage_weights_from_disk",
                                                   {"model_path": model_path}, retries=0))
            except EngineControlError as e:
                if not isinstance(e, EngineUnavailableError) and "HTTP 404" in str(e):
                    return False
                raise
            return True

        urls = self.urls
        return [u for u, staged in zip(urls, await asyncio.gather(*(one(u) for u in urls))) if staged]

    # The distributed weight push (miles_core.weights.distributed; SGLang's protocol, NCCL on GPU and gloo
    # on the CPU engine). Never retried (see module doc). A 4xx answer (success false, or a request
    # validation error) raises EngineControlError with the engine's message; no answer raises
    # EngineUnavailableError.
    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "nccl", *,
                                        timeout_seconds: float | None = None) -> dict:
        """Join the engine at `rank_offset` (each engine has its own, so the client must hold one engine:
        `EngineClient([url])`). Blocks until every rank has joined, so send it concurrently with the
        trainer's own join."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return self._success(await self._control(self._single("init_weights_update_group"), "POST",
                                                 "/init_weights_update_group", body, retries=0,
                                                 timeout_seconds=timeout_seconds))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, *, flush_cache: bool = False,
                                              weight_version: int | str | None = None,
                                              load_format: str | None = None,
                                              timeout_seconds: float | None = None) -> list[dict]:
        """Every engine receives `names` by broadcast from rank 0, in order; send it concurrently with the
        broadcast. `weight_version` (sent as a string) is set by the engine only when given;
        `load_format="flattened_bucket"`: one broadcast of all their bytes (SGLang's FlattenedTensorBucket)."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        res = await asyncio.gather(*(self._control(u, "POST", "/update_weights_from_distributed", body, retries=0,
                                                   timeout_seconds=timeout_seconds) for u in self.urls))
        return [self._success(r) for r in res]

    async def begin_weight_update(self, *, timeout_seconds: float | None = None) -> list[dict]:
        """SGLang 0.5.23: every engine opens the weight-update session that `update_weights_from_distributed`
        must run in (400 when one is open already)."""
        return await self._session_call("/begin_weight_update", {"selector": "all"}, timeout_seconds)

    async def end_weight_update(self, *, timeout_seconds: float | None = None) -> list[dict]:
        """Every engine closes its weight-update session (400 when none is open)."""
        return await self._session_call("/end_weight_update", {}, timeout_seconds)

    async def _session_call(self, path: str, body: dict, timeout_seconds: float | None) -> list[dict]:
        res = await asyncio.gather(*(self._control(u, "POST", path, body, retries=0, timeout_seconds=timeout_seconds)
                                     for u in self.urls))
        return [self._success(r) for r in res]

    async def destroy_weights_update_group(self, group_name: str, *,
                                           timeout_seconds: float | None = None) -> list[dict]:
        """Every engine leaves and destroys the group (an engine without it answers 400: EngineControlError)."""
        res = await asyncio.gather(*(self._control(u, "POST", "/destroy_weights_update_group",
                                                   {"group_name": group_name}, retries=0,
                                                   timeout_seconds=timeout_seconds) for u in self.urls))
        return [self._success(r) for r in res]

    def _single(self, what: str) -> str:
        if len(self._engines) != 1:
            raise ValueError(f"{what} needs a client over one engine (each engine has its own rank offset); "
                             f"this client has {len(self._engines)}")
        return self._engines[0].url

    @staticmethod
    def _success(res: Any) -> Any:
        if isinstance(res, dict) and res.get("success") is False:
            raise EngineControlError(f"engine answered success=false: {res.get('message')}")
        return res

    async def abort_request(self, rid: str, url: str | None = None) -> None:
        if url is not None:
            await self._control(url.rstrip("/"), "POST", "/abort_request", {"rid": rid})
        else:
            await self._all("POST", "/abort_request", {"rid": rid})
