"""The evaluation core shared by all three modes: generate on engines, score, aggregate.

`evaluate(engines, dataset, sampling)` sends n requests per prompt (round-robin over the given
engine clients, bounded concurrency), scores the finished samples with the dataset's reward, and
returns the docs/evaluation.md metrics of that dataset. With `--custom-generate-function-path` (the dataset's
`episode`), each sample is one episode of that function run with `evaluation=True` instead of one
request; a reward it sets is the eval reward. It knows nothing about where the engines come from
(shared rollout engines, a dedicated pinned fleet, or an engine started on a snapshot) nor about
snapshots: the modes wrap it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from miles_core.eval.datasets import EvalDataset, EvalSampling
from miles_core.eval.pass_at_k import pass_at_k, pass_ks
from miles_core.metrics import names as N
from miles_core.rollout.batch_metrics import tool_counts
from miles_core.samples import Sample, SampleStatus

log = logging.getLogger(__name__)

ABORT_RETRIES = 3


class GenerateClient(Protocol):
    """What evaluation needs from an engine client (miles_core.engines): one /generate call."""

    async def generate(self, input_ids: list[int], sampling_params: dict) -> Any: ...


class EvalAborted(RuntimeError):
    """An eval request kept coming back aborted (the engine was paused or restarting)."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class DatasetEval:
    dataset: str
    metrics: dict[str, float]
    n_prompts: int
    n_samples: int
    duration_seconds: float
    weight_versions: list[int] = field(default_factory=list)  # distinct versions the engines reported
    failed_samples: int = 0  # samples whose reward failed (scored 0)
    error: str = ""  # the first of their errors


def _field(result: Any, *names: str, default=None):
    for name in names:
        if isinstance(result, dict) and name in result:
            return result[name]
        if hasattr(result, name):
            return getattr(result, name)
    meta = result.get("meta_info") if isinstance(result, dict) else getattr(result, "meta_info", None)
    if isinstance(meta, dict):
        for name in names:
            if name in meta:
                return meta[name]
    return default


def _finish_reason(result: Any) -> str:
    fr = _field(result, "finish_reason", default="")
    if isinstance(fr, dict):  # SGLang: {"type": "stop"|"length"|"abort", ...}
        fr = fr.get("type", "")
    return str(fr or "")


async def _generate_one(client: GenerateClient, prompt_ids: list[int], params: dict) -> Any:
    for _ in range(ABORT_RETRIES):
        result = await client.generate(list(prompt_ids), dict(params))
        if _finish_reason(result) != "abort":
            return result
        await asyncio.sleep(0.2)
    raise EvalAborted(f"an eval request was aborted {ABORT_RETRIES} times in a row; the engine is paused or restarting")


async def _episode(dataset: EvalDataset, client: GenerateClient, i: int, j: int, row, params: dict,
                   versions: set[int]) -> list[Sample]:
    """One eval episode of the run's custom generate function (evaluation=True); an aborted one is
    run again, like an aborted request."""
    for _ in range(ABORT_RETRIES):
        sample = Sample(group_id=f"eval-{dataset.name}-{i}", prompt_index=i, sample_index=j,
                        prompt_ids=list(row.prompt_ids), label=row.label,
                        metadata=json.dumps({"task": row.task, "eval": dataset.name}))
        out = await dataset.episode(client, sample, dict(params))
        if not any(s.status == SampleStatus.ABORTED for s in out):
            versions.update(v for s in out for v in s.token_versions)
            return out
        await asyncio.sleep(0.2)
    raise EvalAborted(f"an eval episode was aborted {ABORT_RETRIES} times in a row; the engine is paused or restarting")


async def _score(dataset: EvalDataset, samples: list[Sample]) -> list[float]:
    out = dataset.reward(samples)
    if inspect.isawaitable(out):
        out = await out
    rewards = [float(r) for r in out]
    if len(rewards) != len(samples):
        raise ValueError(f"reward for eval dataset {dataset.name!r} returned {len(rewards)} values for {len(samples)} samples")
    return rewards


async def evaluate(engines: GenerateClient | Sequence[GenerateClient], dataset: EvalDataset,
                   sampling: EvalSampling, *, concurrency: int = 64) -> DatasetEval:
    """Evaluate one dataset on `engines`; returns its metrics (names include the dataset).

    At most `concurrency` requests per engine are in flight.
    """
    clients = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    if not clients:
        raise ValueError("evaluate needs at least one engine client")
    t0 = time.monotonic()
    n = sampling.n_samples_per_prompt
    params = sampling.sampling_params()
    n_engines = sum(len(getattr(c, "urls", None) or [None]) for c in clients)
    gate = asyncio.Semaphore(max(1, concurrency) * n_engines)
    samples: list[Sample] = []
    versions: set[int] = set()

    async def one(i: int, j: int, row) -> list[Sample]:
        if dataset.episode is not None:
            async with gate:
                return await _episode(dataset, clients[(i * n + j) % len(clients)], i, j, row, params, versions)
        async with gate:
            result = await _generate_one(clients[(i * n + j) % len(clients)], row.prompt_ids, params)
        out_ids = list(_field(result, "output_ids", "response_ids", "token_ids", default=[]) or [])
        v = _field(result, "weight_version", default=None)
        if v is not None:
            versions.add(int(v))
        finish = _finish_reason(result)
        return [Sample(group_id=f"eval-{dataset.name}-{i}", prompt_index=i, sample_index=j,
                       prompt_ids=list(row.prompt_ids), response_ids=out_ids, finish_reason=finish,
                       status=SampleStatus.TRUNCATED if finish == "length" else SampleStatus.COMPLETED,
                       label=row.label, metadata=json.dumps({"task": row.task, "eval": dataset.name}))]

    per_request = await asyncio.gather(*(one(i, j, row) for i, row in enumerate(dataset.rows) for j in range(n)))
    samples = [s for out in per_request for s in out]
    unscored = [s for s in samples if s.reward is None]  # a custom generate function may set the reward
    if unscored:
        for s, r in zip(unscored, await _score(dataset, unscored)):
            s.reward = r
    metrics = aggregate(dataset.name, samples, n, sampling.pass_threshold)
    failed, error = failed_samples(samples)
    if samples and failed == len(samples):
        log.error("eval %s: the reward failed on every sample (%d of %d), so its scores of 0 mean nothing; "
                  "first: %s. The eval result is marked failed; training goes on (fix --custom-rm-path)",
                  dataset.name, failed, len(samples), error)
    return DatasetEval(dataset=dataset.name, metrics=metrics, n_prompts=len(dataset.rows), n_samples=len(samples),
                       duration_seconds=time.monotonic() - t0, weight_versions=sorted(versions),
                       failed_samples=failed, error=error)


def failed_samples(samples: list[Sample]) -> tuple[int, str]:
    """(how many samples' reward failed, the first failure's message)."""
    failed = [s for s in samples if s.status == SampleStatus.FAILED]
    error = ""
    for s in failed:
        try:
            error = str(json.loads(s.metadata or "{}").get("reward_error") or "")
        except (ValueError, AttributeError):
            continue
        if error:
            break
    return len(failed), error


def aggregate(ds: str, samples: list[Sample], n: int, pass_threshold: float = 1.0) -> dict[str, float]:
    """docs/evaluation.md metrics of one dataset from scored samples (n per prompt, grouped by prompt_index)."""
    if not samples:
        return {}
    by_prompt: dict[int, list[Sample]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    rewards = [float(s.reward or 0.0) for s in samples]
    metrics = {
        N.eval_reward_metric(ds): sum(rewards) / len(rewards),
        N.eval_truncated_ratio_metric(ds): sum(s.finish_reason == "length" for s in samples) / len(samples),
        N.eval_response_len_metric(ds): sum(len(s.response_ids) for s in samples) / len(samples),
    }
    tools = tool_counts(samples)
    if tools:
        metrics[N.eval_tool_metric(ds, N.EVAL_TOOL_EPISODE_SHARE)] = sum(t["calls"] > 0 for t in tools) / len(tools)
        metrics[N.eval_tool_metric(ds, N.EVAL_TOOL_CALLS_PER_EPISODE)] = sum(t["calls"] for t in tools) / len(tools)
    for k in pass_ks(n):
        vals = []
        for group in by_prompt.values():
            c = sum(float(s.reward or 0.0) >= pass_threshold - 1e-9 for s in group)
            vals.append(pass_at_k(len(group), c, min(k, len(group))))
        metrics[N.eval_pass_at_k_metric(ds, k)] = sum(vals) / len(vals)
    return metrics


async def evaluate_all(engines, datasets: Sequence[EvalDataset], sampling: EvalSampling,
                       *, concurrency: int = 64) -> list[DatasetEval]:
    """Every dataset in turn (datasets share the engines; one at a time keeps latency fair)."""
    return [await evaluate(engines, ds, sampling, concurrency=concurrency) for ds in datasets]
