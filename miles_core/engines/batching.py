"""Continuous batching for the CPU engine: requests join and leave the running batch at every step.

`BatchEngine` is synchronous and single-threaded by contract: the server calls every method from one
worker thread, so a weight load, an abort or a pause never interleaves with a forward step.

One `step()` = admit waiting requests into free cache slots (one batched prefill, which also samples
their first token) + one decode step for every request already running. A request leaves the batch
the step it finishes (stop token, max_new_tokens, the model's position limit, or abort); the running
requests are compacted into slots 0..B-1 so decode reads the cache without a gather.

Log-probs: each returned log-prob is `log_softmax(logits)[token]` of the *unmodified* logits
(temperature 1, before penalties and top-k/top-p), whatever the sampling parameters. This is what the RL trainer
recomputes at temperature 1 (SGLang returns the same with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which the
launcher sets).

Pause modes (as SGLang's /pause_generation): `in_place` keeps requests and their cache, `retract`
moves running requests back to the waiting queue (their cache is recomputed from prompt + output when
they are admitted again), `abort` finishes every request with finish_reason abort.

Routed experts (SGLang's `--enable-return-routed-experts` with a request's `return_routed_experts`):
with `capture_routes`, a request that asks for them collects, for every position the model ran
(prefill and decode; a retracted request's are recomputed), the top-k expert ids of each MoE layer,
and its finish event carries those of positions `routed_experts_start_len` .. (prompt + output - 1):
the last output token never went through the model. SGLang's range and its check of the start.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from miles_core.engines.model import CausalLM


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams.max_new_tokens default


@dataclass
class SamplingParams:
    """The sampling parameters RL rollouts send to SGLang, with SGLang's names, defaults and ranges
    (`sglang/srt/sampling/sampling_params.py`). Penalties apply to output tokens only, as SGLang's
    penalizers do: repetition (multiplicative: a positive logit is divided by it, a negative one
    multiplied), frequency (subtracted once per occurrence), presence (subtracted once).
    `min_new_tokens` masks EOS and the stop tokens until that many tokens exist, and no stop (token or
    string) ends a request before then. `stop` strings are matched on the decoded output (the text is
    cut before the match unless `no_stop_trim`). `sampling_seed` gives the request its own generator,
    so its samples do not depend on what else is in the batch. `skip_special_tokens` and
    `spaces_between_special_tokens` only shape `text`."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: up to the position limit (SGLang's null)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sampling_seed: int | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True

    KNOWN = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
             "min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "sampling_seed",
             "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "n", "min_p")

    @staticmethod
    def from_json(d: dict | None) -> "SamplingParams":
        """Parse a /generate `sampling_params` object; ValueError names what SGLang would refuse. A null
        value means the default (SGLang's `__post_init__`), except `max_new_tokens: null`: no limit but
        the position limit (SGLang's `init_req_max_new_tokens`)."""
        unbounded = (d or {}).get("max_new_tokens", 0) is None
        d = {k: v for k, v in (d or {}).items() if v is not None}
        bad = set(d) - set(SamplingParams.KNOWN)
        if bad:
            raise ValueError(f"sampling_params: unsupported keys {sorted(bad)}; supported: {list(SamplingParams.KNOWN)}")
        if d.get("n", 1) != 1 or d.get("min_p", 0.0) != 0.0:
            raise ValueError("sampling_params: the CPU engine supports n=1 and min_p=0 only")
        stop = d.get("stop", ())
        seed = d.get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"sampling_seed must be an integer, got {type(seed).__name__}.")
        p = SamplingParams(
            max_new_tokens=None if unbounded else int(d.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=int(d.get("top_k", -1)),
            stop=(stop,) if isinstance(stop, str) else tuple(str(x) for x in stop),
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
            ignore_eos=bool(d.get("ignore_eos", False)),
            min_new_tokens=int(d.get("min_new_tokens", 0)),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            frequency_penalty=float(d.get("frequency_penalty", 0.0)),
            presence_penalty=float(d.get("presence_penalty", 0.0)),
            sampling_seed=seed,
            no_stop_trim=bool(d.get("no_stop_trim", False)),
            skip_special_tokens=bool(d.get("skip_special_tokens", True)),
        )
        p.verify()
        return p

    def verify(self) -> None:
        """SGLang's `SamplingParams.verify` ranges (messages as SGLang words them)."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                             f"got {self.min_new_tokens}.")

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.min_new_tokens > 0)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V sit in the cache (0 when waiting)
    finish: dict | None = None
    created: float = field(default_factory=time.monotonic)
    gen: torch.Generator | None = None  # its own generator when it carries a sampling_seed
    return_routed_experts: bool = False  # SGLang's request field (recorded when the engine captures routes)
    routed_experts_start_len: int = 0  # the first position whose routed experts are returned
    routes: list[torch.Tensor] = field(default_factory=list)  # [positions, MoE layers, k] pieces, in order


@dataclass
class TokenEvent:
    """What one step produced for one request: a new token, or only a finish (abort)."""

    rid: str
    token: int | None
    logprob: float | None
    version: int
    finish: dict | None
    routed_experts: torch.Tensor | None = None  # on a finish: [positions, MoE layers, k] int32 (see the module doc)


class BatchEngine:
    def __init__(self, model: CausalLM, weight_version: int = 0, max_running: int = 512,
                 max_total_tokens: int = 4096, seed: int = 0, eos_token_ids=None, decode=None,
                 capture_routes: bool = False):
        """`eos_token_ids`: the model's EOS ids (config.json and generation_config.json; default the
        model's). `decode(ids) -> str`: the tokenizer, needed for `stop` strings. `capture_routes`:
        record routed experts for the requests that ask (SGLang's --enable-return-routed-experts; a
        MoE model only, as SGLang's capturer needs num_experts_per_tok)."""
        if capture_routes and not model.spec.moe:
            raise ValueError(f"--enable-return-routed-experts needs a mixture-of-experts model; this "
                             f"{model.spec.family} model is dense and routes no token to experts")
        self.capture_routes = capture_routes
        self.model = model
        self.version = weight_version
        self.max_running = max_running
        self.max_len = min(model.spec.max_positions, max_total_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i] owns cache slot i
        self.requests: dict[str, Request] = {}
        self.paused = False
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = model.new_cache(min(max_running, 64), min(self.max_len, 64))
        self._eos = set(model.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.decode = decode

    # ---- requests -----------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise ValueError for a request this model cannot serve (reads nothing that a step changes)."""
        if not req.input_ids:
            raise ValueError("input_ids is empty")
        vocab = self.model.spec.vocab_size
        if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
            raise ValueError(f"input_ids out of range [0, {vocab})")
        if len(req.input_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(req.input_ids)} tokens leaves no room: the model holds {self.max_len} positions")
        if req.params.stop and self.decode is None:
            raise ValueError("stop strings need a tokenizer (tokenizer.json in the model dir); use stop_token_ids")

    def add(self, req: Request) -> list[TokenEvent]:
        """Queue a request; one that cannot run at all finishes at once (returned as events)."""
        if req.rid in self.requests:
            raise ValueError(f"rid {req.rid!r} is already in flight on this engine")
        self.check(req)
        if req.return_routed_experts and not 0 <= req.routed_experts_start_len <= len(req.input_ids):
            return [TokenEvent(req.rid, None, None, self.version, {"type": "abort", "message": _start_len_error(req)})]
        if req.params.max_new_tokens == 0:
            return [TokenEvent(req.rid, None, None, self.version, {"type": "length", "length": 0})]
        if req.params.sampling_seed is not None and req.gen is None:
            req.gen = torch.Generator().manual_seed(req.params.sampling_seed % 2**63)
        self.requests[req.rid] = req
        self.waiting.append(req)
        return []

    def abort(self, rid: str | None = None, message: str = "Abort requested") -> list[TokenEvent]:
        """Abort one request (unknown rids are ignored: it may have finished) or all when rid is None."""
        victims = list(self.requests.values()) if rid is None else [self.requests[rid]] if rid in self.requests else []
        for r in victims:
            r.finish = {"type": "abort", "message": message}
        return self._reap(victims)

    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- control ------------------------------------------------------------------------------
    def pause(self, mode: str) -> list[TokenEvent]:
        if mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"mode={mode!r}; expected one of abort, retract, in_place")
        self.paused = True
        if mode == "abort":
            return self.abort(None, "Aborted by pause_generation(mode=abort)")
        if mode == "retract":
            self.retract_all()
        return []

    def resume(self) -> None:
        self.paused = False

    def retract_all(self) -> None:
        """Drop every running request's cache and queue it (first) to be prefilled again."""
        for r in reversed(self.running):
            r.cached = 0
            self.waiting.appendleft(r)
        self.running = []

    def load_weights(self, model: CausalLM, version: int | None) -> None:
        if not self.model.same_architecture(model):
            raise ValueError("the new checkpoint's architecture differs from the served model's")
        self.model = model
        if version is not None:
            self.version = version

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        if self.paused:
            return []
        events: list[TokenEvent] = []
        decoding = list(self.running)
        admitted = self._admit()
        if decoding:
            tokens = torch.tensor([r.output_ids[-1] for r in decoding])
            positions = torch.tensor([r.cached for r in decoding])
            logits = self.model.decode(self.cache, tokens, positions)
            for i, r in enumerate(decoding):
                r.cached += 1
                if self._records(r):
                    r.routes.append(self.model.last_routes[i:i + 1].clone())
            events += self._sample(decoding, logits)
        if admitted:
            first = len(self.running) - len(admitted)
            seqs = [r.input_ids + r.output_ids for r in admitted]
            lengths = torch.tensor([len(s) for s in seqs])
            width = int(lengths.max())
            tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # right-padded
            logits = self.model.prefill(self.cache, first, tokens, lengths)
            for i, (r, n) in enumerate(zip(admitted, lengths.tolist())):
                r.cached = n
                if self._records(r):  # every position again (a retracted request's too)
                    r.routes = [self.model.last_routes[i, :n].clone()]
            events += self._sample(admitted, logits)
        events += self._reap([r for r in self.running if r.finish is not None])
        return events

    def _admit(self) -> list[Request]:
        room = self.max_running - len(self.running)
        admitted = []
        while self.waiting and len(admitted) < room:
            admitted.append(self.waiting.popleft())
        if admitted:
            need_len = max(len(r.input_ids) + len(r.output_ids) for r in admitted)
            self._ensure_capacity(len(self.running) + len(admitted), need_len)
            self.running.extend(admitted)
        # decode writes position `cached` for every running request
        if self.running:
            self._ensure_capacity(len(self.running), max(r.cached for r in self.running) + 1)
        return admitted

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[TokenEvent]:
        logprobs = torch.log_softmax(logits, dim=-1)  # of the unmodified logits: what the trainer recomputes
        biased = self._penalize(reqs, logits)
        temps = [r.params.temperature for r in reqs]
        if all(t == 0 for t in temps):
            tokens = biased.argmax(-1)
        else:
            tokens = _sample_rows(biased, reqs, temps, self.gen)
        picked = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        events = []
        for r, tok, lp in zip(reqs, tokens.tolist(), picked):
            r.output_ids.append(tok)
            r.finish = self._finish(r, tok)
            events.append(TokenEvent(r.rid, tok, lp, self.version, None))
        return events

    def _penalize(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling reads: SGLang's penalizers over each request's output tokens."""
        if not any(r.params.penalized for r in reqs):
            return logits
        out = logits.clone()
        vocab = logits.shape[-1]
        for i, r in enumerate(reqs):
            p = r.params
            if not p.penalized:
                continue
            if r.output_ids:
                counts = torch.bincount(torch.tensor(r.output_ids), minlength=vocab)[:vocab].to(out.dtype)
                seen = counts > 0
                if p.repetition_penalty != 1.0:
                    row = out[i]
                    scaled = torch.where(row < 0, row * p.repetition_penalty, row / p.repetition_penalty)
                    out[i] = torch.where(seen, scaled, row)
                out[i] -= p.frequency_penalty * counts + p.presence_penalty * seen.to(out.dtype)
            if len(r.output_ids) < p.min_new_tokens:
                stops = [t for t in {*p.stop_token_ids, *self._eos} if 0 <= t < vocab]
                out[i, stops] = float("-inf")
        return out

    def _finish(self, r: Request, tok: int) -> dict | None:
        """SGLang's finish check after `tok` was appended: no stop before min_new_tokens; then a stop
        token or EOS (unless ignore_eos), a stop string, max_new_tokens, the position limit."""
        p, n = r.params, len(r.output_ids)
        if n >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self._eos):
                return {"type": "stop", "matched": tok}
            matched = self._stop_string(r)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if p.max_new_tokens is not None and n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(r.input_ids) + n >= self.max_len:
            return {"type": "length", "length": n}
        return None

    def _stop_string(self, r: Request) -> str | None:
        """The first `stop` string that the decoded tail of the output now contains."""
        if not r.params.stop:
            return None
        longest = max(len(s) for s in r.params.stop)
        tail = self.decode(r.output_ids[-(longest + 4):])
        return next((s for s in r.params.stop if s and s in tail), None)

    def _reap(self, finished: list[Request]) -> list[TokenEvent]:
        """Remove finished requests from the batch (compacting slots) and the queue; emit finishes."""
        if not finished:
            return []
        gone = {r.rid for r in finished}
        keep = [i for i, r in enumerate(self.running) if r.rid not in gone]
        if len(keep) != len(self.running):
            if keep and keep != list(range(len(keep))):
                span = max(self.running[i].cached for i in keep) + 1
                span = min(span, self.cache.shape[4])
                idx = torch.tensor(keep)
                self.cache[:, :, :len(keep), :, :span] = self.cache[:, :, idx, :, :span]
            self.running = [self.running[i] for i in keep]
        if any(r.rid in gone for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.rid not in gone)
        events = []
        for r in finished:
            self.requests.pop(r.rid, None)
            events.append(TokenEvent(r.rid, None, None, self.version, r.finish, self._routes(r)))
        return events

    def _records(self, r: Request) -> bool:
        return self.capture_routes and r.return_routed_experts

    def _routes(self, r: Request) -> torch.Tensor | None:
        """A finished request's routed experts: positions start .. cached-1 (SGLang's [start, seqlen - 1))."""
        if not self._records(r):
            return None
        spec = self.model.spec
        none = torch.zeros(0, len(spec.moe_layers), spec.moe_topk, dtype=torch.int32)
        ran = torch.cat(r.routes) if r.routes else none
        return ran[min(r.routed_experts_start_len, len(ran)):]

    def _ensure_capacity(self, slots: int, length: int) -> None:
        _, _, s, _, l, _ = self.cache.shape
        if slots <= s and length <= l:
            return
        new_s = min(max(s, _pow2(slots)), max(self.max_running, slots))
        new_l = min(max(l, _pow2(length)), self.max_len)
        grown = self.model.new_cache(new_s, new_l)
        grown[:, :, :s, :, :l] = self.cache
        self.cache = grown


def _start_len_error(req: Request) -> str:
    """SGLang 0.5.23's abort message for a routed_experts_start_len outside [0, prompt tokens]."""
    start = req.routed_experts_start_len
    if start < 0:
        return (f"recv_req.routed_experts_start_len={start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len.")
    return (f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(req.input_ids)}. Please use a smaller routed_experts_start_len.")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _sample_rows(logits: torch.Tensor, reqs: list[Request], temps: list[float], gen: torch.Generator) -> torch.Tensor:
    """Sample one token per row with that row's temperature/top-k/top-p (temperature 0 = greedy)."""
    greedy = torch.tensor([t == 0 for t in temps])
    t = torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None]
    scaled = logits / t
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p)[:, None]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) > ps  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=gen)[:, 0]
    for i, r in enumerate(reqs):  # a seeded request draws from its own generator
        if r.gen is not None and temps[i] > 0:
            tokens[i] = torch.multinomial(probs[i:i + 1], 1, generator=r.gen)[0, 0]
    if greedy.any():
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens
