"""Eval datasets and eval sampling settings, read from the config's eval section.

`--eval-prompt-data name=uri ...` names each dataset; builtin URIs (builtin:reverse4-heldout, ...)
come with their verifiable reward. Other URIs go through the same normalization as the training
prompts (miles_core.prepare.dataset) and are scored by `--custom-rm-path`, or by the builtin reward of the
task a row names.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from miles_core.models.source import tokenizer_source
from miles_core.prepare.dataset import prepare_dataset
from miles_core.rollout.builtin_tasks import TEXT_BUILTIN_DATASETS, builtin_rows
from miles_core.rollout.episodes import GenerateArgs, load_generate_function
from miles_core.rollout.assembly import tokenizer_decode
from miles_core.rollout.prompts import load_prompts
from miles_core.rollout.rewards import BUILTIN_REWARD_TASKS, Rewarder, load_reward, task_reward
from miles_core.samples import Group, Sample
from miles_core.storage import Store

# A reward scores a list of finished samples (rows' labels are in sample.label): one float each.
RewardFn = Callable[[list[Sample]], "list[float] | Awaitable[list[float]]"]


class EvalDataError(ValueError):
    """An eval dataset that cannot be loaded; the message names the flag, dataset and cause."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class EvalSampling:
    """How eval responses are sampled (one request per sample)."""

    n_samples_per_prompt: int = 1
    max_response_len: int = 5
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_prompts: int | None = None  # the first N rows of each dataset; None = all
    pass_threshold: float = 1.0     # a sample counts as correct for pass@k when reward >= this

    def sampling_params(self) -> dict:
        """SGLang `sampling_params` of one request."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_response_len}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EvalSampling":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class EvalRow:
    prompt_ids: list[int]
    label: str  # a string, or JSON for structured labels
    task: str = ""


@dataclass(frozen=True)
class EvalDataset:
    name: str
    uri: str
    rows: list[EvalRow]
    reward: RewardFn
    # --custom-generate-function-path run with evaluation=True: (engine client, sample, sampling
    # params) -> samples; None: one /generate call per sample
    episode: Callable[[Any, Sample, dict], Awaitable[list[Sample]]] | None = None


def sampling_from_config(cfg) -> EvalSampling:
    """EvalSampling from a RunConfig (eval section, falling back on the rollout section)."""
    e, r = cfg.eval, cfg.rollout
    return EvalSampling(
        n_samples_per_prompt=e.n_samples_per_eval_prompt,
        max_response_len=e.eval_max_response_len or r.rollout_max_response_len,
        temperature=r.rollout_temperature if e.eval_temperature is None else e.eval_temperature,  # miles' fallback
        max_prompts=e.eval_max_prompts,
        pass_threshold=e.eval_pass_threshold,
    )


def parse_dataset_specs(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`name=uri` items -> [(name, uri)] (validate() has already checked them)."""
    out = []
    for item in specs:
        name, sep, uri = item.partition("=")
        if not sep or not name or not uri:
            raise EvalDataError(f"--eval-prompt-data {item!r}: expected name=uri (e.g. heldout=builtin:reverse4-heldout).")
        out.append((name, uri))
    return out


def load_eval_datasets(cfg, specs: Sequence[str] | None = None, reward: RewardFn | None = None,
                       run_uri: str | None = None) -> list[EvalDataset]:
    """The eval datasets of `cfg` (or of `specs`, name=uri items) with their rewards.

    `reward` overrides the reward of every dataset; otherwise `--custom-rm-path` if set, else the
    builtin reward of each row's task. Non-builtin sources are normalized into `run_uri`'s data/.
    """
    specs = list(cfg.eval.eval_prompt_data if specs is None else specs)
    custom = reward if reward is not None else _custom_reward(cfg)
    builtin = None
    episode = eval_episode(cfg)
    max_prompts = cfg.eval.eval_max_prompts
    datasets = []
    for name, uri in parse_dataset_specs(specs):
        rows = _load_rows(cfg, name, uri, run_uri or cfg.run_uri)
        if max_prompts is not None:
            rows = rows[:max_prompts]
        if not rows:
            raise EvalDataError(f"--eval-prompt-data {name}={uri}: the dataset has no rows.")
        if custom is None:
            unscored = sorted({r.task for r in rows if r.task not in BUILTIN_REWARD_TASKS})
            if unscored:
                raise EvalDataError(
                    f"--eval-prompt-data {name}={uri}: rows of task(s) {unscored} have no builtin reward; "
                    "set --custom-rm-path module:function.")
        if custom is None and builtin is None:
            builtin = builtin_reward(cfg)
        datasets.append(EvalDataset(name=name, uri=uri, rows=rows, reward=custom or builtin, episode=episode))
    return datasets


def eval_episode(cfg) -> Callable[[Any, Sample, dict], Awaitable[list[Sample]]] | None:
    """The run's custom generate function as eval runs it (evaluation=True, on the eval engines), or None."""
    fn = load_generate_function(cfg.rollout.custom_generate_function_path, cfg.rollout.custom_generate_timeout_seconds)
    if fn is None:
        return None

    async def run(client: Any, sample: Sample, params: dict) -> list[Sample]:
        return await fn(GenerateArgs(engine=client, config=cfg), sample, params, evaluation=True)

    return run


def _load_rows(cfg, name: str, uri: str, run_uri: str) -> list[EvalRow]:
    if uri.startswith("builtin:") and uri not in TEXT_BUILTIN_DATASETS:  # token ids; text ones are tokenized below
        try:
            return [EvalRow(list(r["prompt"]), r["label"], r.get("task", "")) for r in builtin_rows(uri)]
        except ValueError as e:
            raise EvalDataError(f"--eval-prompt-data {name}={uri}: {e}") from e

    # Non-builtin sources go through the training prompts' normalization (tokenization, label
    # keys, bad-row errors), cached in the run root under data/eval-{name}.arrow.
    source = dataclasses.replace(cfg.data, prompt_data=uri)  # the training prompts' keys, template, max_seq_len
    store = Store(run_uri)
    try:
        prepare_dataset(source, store, tokenizer_source=tokenizer_source(cfg), name=f"eval-{name}")
        rows = load_prompts(store, name=f"eval-{name}")
    except Exception as e:  # noqa: BLE001 - named and chained for the user
        raise EvalDataError(f"--eval-prompt-data {name}={uri}: {e}") from e
    return [EvalRow(list(r["prompt"]), _label(r.get("label", "")), r.get("task", "")) for r in rows]


def _label(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _custom_reward(cfg) -> RewardFn | None:
    if not cfg.rollout.custom_rm_path and not cfg.rollout.rm_type:
        return None

    r = cfg.rollout
    return reward_from_function(load_reward(r.custom_rm_path, r.rm_type, r.rm_url, _decoder(cfg)), _decoder(cfg))


def _decoder(cfg):
    """Token ids -> text for rewards that need text: the rollout's decoder, so eval and training
    give a reward function the same text (digits for a builtin model, else the run's tokenizer)."""
    return tokenizer_decode(cfg)


def reward_from_function(fn, decode=None) -> RewardFn:
    """Score eval samples with a reward function of the --custom-rm-path contract (rollout.rewards).

    Scoring goes through the rollout's `Rewarder`, so eval and training read a reward function
    the same way; a sample whose reward raises scores 0 (and is logged), it does not stop the eval.
    """
    rewarder = Rewarder(fn, decode)

    async def score(samples: list[Sample]) -> list[float]:
        await rewarder.score_group(Group("eval", 0, samples))
        return [float(s.reward) if s.reward is not None else 0.0 for s in samples]

    return score


def builtin_reward(cfg) -> RewardFn:
    """The builtin reward of each sample's task (rollout.rewards.task_reward), text tasks (arith)
    reading the response through the run's tokenizer."""
    return reward_from_function(task_reward, _decoder(cfg))
