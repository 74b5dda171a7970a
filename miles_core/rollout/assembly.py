"""The rollout side, built once: for the trainer's cluster (`RolloutManager`) and for producer jobs
(`miles_core.elastic.job`), from the run's config.

    side = build_rollout_side(cfg, store, rows=rows, engine=engine, holder=holder, writer_id=writer,
                              claims=True, sink_for=lambda producer: buffer_for(producer))
    side.producer.start()

What is shared: the prompt claims (when producers may join the run, or always for a producer job),
the data source serving claimed blocks, the producer with its rewards, budget, admission, sampling
settings and custom generate function, and the unused-samples handler that reports each rejected
group back to the producer (`rejection_handler`). What differs is passed in: where finished groups
go (`sink_for`: the trainer's buffer, a producer job's counting writer), the staleness bound (a
producer job's is the feed's room, one of its `gates`) and the driver mode. Everything is composed
at construction; nothing is wired into the producer afterwards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from miles_core.buffer import build_unused_handler
from miles_core.buffer.objects import CommittedPositions
from miles_core.config.sections import RolloutSection
from miles_core.models.source import is_builtin, tokenizer_source
from miles_core.models.tokenizer import load_tokenizer
from miles_core.rollout.admission import StalenessAdmission, SubmissionBudget
from miles_core.rollout.claims import PromptClaims
from miles_core.rollout.data_source import DataSource
from miles_core.rollout.episodes import GenerateArgs, load_generate_function
from miles_core.rollout.producer import Producer, RouteLayout
from miles_core.rollout.rewards import Rewarder, load_reward
from miles_core.samples import Group
from miles_core.storage import Store


@dataclass(frozen=True)
class RolloutSide:
    """What `build_rollout_side` composed: the producer, the sink it puts into, its claims (None when
    the run takes no producers) and its data source."""

    producer: Producer
    sink: Any
    claims: PromptClaims | None
    source: DataSource


def build_rollout_side(cfg, store: Store, *, rows: list[dict], engine, holder: str, writer_id: str, claims: bool,
                       sink_for: Callable[[Producer], Any], decode: Callable[[list[int]], str] | None = None,
                       batch_mode: bool = False, max_staleness: int | None | bool = True,
                       gates: Sequence[Callable[[], bool]] = ()) -> RolloutSide:
    """The rollout side over `rows` and `engine`. `claims`: take prompts in claimed blocks of the run
    root `store` (as `holder`, writing as `writer_id`), so producers elsewhere share them exactly once."""
    r, b = cfg.rollout, cfg.buffer
    held = None
    source_claims: dict = {}
    if claims:
        held = PromptClaims(store, holder, writer=writer_id, num_rows=len(rows),
                            block_size=b.prompt_claim_block_size or r.rollout_batch_size,
                            ttl_seconds=b.prompt_claim_ttl_seconds)
        source_claims = {"claims": held, "committed_by": CommittedPositions(store)}
    source = DataSource(rows, r.n_samples_per_prompt, seed=cfg.run.seed, shuffle=cfg.data.rollout_shuffle,
                        **source_claims)
    producer = make_producer(cfg, source, engine, sink_for, decode, batch_mode=batch_mode,
                             max_staleness=max_staleness, gates=gates)
    return RolloutSide(producer, producer.sink, held, source)


def rejection_handler(mode: str, producer: Producer) -> RejectionNotifier:
    """The `--async-unused-samples-handler` for groups `producer` started: it hears of each rejection
    (its started-groups count and batch quota depend on it); retry serves the prompt group again."""
    inner = build_unused_handler(mode, recycle=producer.recycle if mode == "retry" else None)
    return RejectionNotifier(inner, producer.on_rejected)


def sampling_params(rollout_section) -> dict:
    r = rollout_section
    return {"max_new_tokens": r.rollout_max_response_len, "temperature": r.rollout_temperature,
            "top_p": r.rollout_top_p, "top_k": r.rollout_top_k}


class RejectionNotifier:
    """Wraps the unused-samples handler so the producer hears of every rejected group (its
    started-groups count and batch quota depend on it), then delegates."""

    def __init__(self, inner: Any, on_rejected: Callable[[Group, str], None]):
        self.inner = inner
        self.on_rejected = on_rejected

    def handle(self, group: Group, reason: str) -> None:
        self.on_rejected(group, reason)
        self.inner.handle(group, reason)

    def metrics(self) -> dict[str, float]:
        fn = getattr(self.inner, "metrics", None)
        return fn() if callable(fn) else {}


def notify_filter_drops(buffer: Any, on_rejected: Callable[[Group, str], None]) -> None:
    """The dynamic filter drops groups without the unused-samples handler; wrap it (when the buffer
    exposes it as `dynamic_filter`, as the default buffer does) so drops reach the producer too."""
    fn = getattr(buffer, "dynamic_filter", None)
    if fn is None:
        return

    def counted(group: Group):
        keep, reason = fn(group)
        if not keep:
            on_rejected(group, f"filtered:{reason}")
        return keep, reason

    buffer.dynamic_filter = counted


def digit_decode(ids: list[int]) -> str:
    """Response text for the builtin digit vocabulary: the digits, specials dropped."""
    return "".join(str(t) for t in ids if 0 <= t <= 9)


def tokenizer_decode(cfg) -> Callable[[list[int]], str]:
    """Response ids -> text for the run's model: `digit_decode` for a builtin model, else the
    tokenizer of `tokenizer_source(cfg)` (object storage, an imported GGUF's directory, a path),
    loaded on first use (only text rewards need it). Thread-safe: the Rewarder calls it from its
    worker threads."""
    if is_builtin(cfg.model.hf_checkpoint):
        return digit_decode
    lock, tok = threading.Lock(), []

    def decode(ids: list[int]) -> str:
        with lock:
            if not tok:
                tok.append(load_tokenizer(tokenizer_source(cfg)))
        return tok[0].decode(ids, skip_special_tokens=True)

    return decode


def make_producer(cfg, source: DataSource, engine, sink_for: Callable[[Producer], Any],
                  decode: Callable[[list[int]], str] | None = None, *, batch_mode: bool = False,
                  max_staleness: int | None | bool = True, gates: Sequence[Callable[[], bool]] = ()) -> Producer:
    """The run's producer over `source` and `engine`, putting into `sink_for(producer)`: rewards,
    submission budget, staleness admission (`max_staleness=None`: none; True: the run's), sampling
    settings and the custom generate function, all from the run's config."""
    r = cfg.rollout
    decode = decode or tokenizer_decode(cfg)
    rewarder = Rewarder(load_reward(r.custom_rm_path, r.rm_type, r.rm_url, decode), decode,
                        timeout_seconds=r.reward_timeout_seconds)
    budget = SubmissionBudget(cfg.budget_groups, r.n_samples_per_prompt, cfg.submission_granularity)
    staleness = r.max_weight_staleness if max_staleness is True else max_staleness
    admission = StalenessAdmission(staleness, r.rollout_batch_size * r.update_weights_interval)
    return Producer(source=source, engine=engine, sink_for=sink_for, gates=gates, rewarder=rewarder, budget=budget,
                    admission=admission, sampling_params=sampling_params(r), batch_mode=batch_mode,
                    max_seq_len=cfg.data.max_seq_len,
                    generate_fn=load_generate_function(r.custom_generate_function_path,
                                                       r.custom_generate_timeout_seconds),
                    generate_args=GenerateArgs(engine=engine, config=cfg), routes=route_layout(cfg),
                    generate_failure_limit=generate_failure_limit(cfg.rollout))


def generate_failure_limit(r: RolloutSection) -> int | None:
    """Custom-generate episodes failing in a row that fail the rollout worker: a window's worth of samples
    (--failed-sample-window-steps x --rollout-batch-size x --n-samples-per-prompt), all failed, is above
    any --max-failed-sample-fraction but 1 (never)."""
    if r.max_failed_sample_fraction >= 1:
        return None
    return r.failed_sample_window_steps * r.rollout_batch_size * r.n_samples_per_prompt


def route_layout(cfg) -> RouteLayout | None:
    """What samples keep of the engine's routed experts under --use-rollout-routing-replay (None:
    off): the model's layers, MoE layers and top-k, from its config.json (the builtin model's
    config, else the initial HF directory's, one small read)."""
    if not cfg.train.use_rollout_routing_replay:
        return None
    from miles_core.models.builtin import builtin_config
    from miles_core.models.families import spec_of
    from miles_core.models.source import model_uri

    m = cfg.model
    if is_builtin(m.hf_checkpoint):
        hf_config = builtin_config(m.hf_checkpoint, m.tiny_num_layers, m.tiny_hidden_size, m.tiny_num_heads)
    else:
        hf_config = Store(model_uri(cfg)).get_json("config.json")
    return RouteLayout.from_spec(spec_of(hf_config))
