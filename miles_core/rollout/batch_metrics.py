"""Rollout metrics of a consumed batch (docs/metrics.md): its distribution (`batch_metrics`) and who
generated it (`writer_metrics`). Their names, and the producer's, are in miles_core.metrics.names
(`ROLLOUT_METRICS`, `PRODUCER_METRICS`).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter

from miles_core.buffer.objects import TRAINER_HOLDER, holder_of_id
from miles_core.metrics import names as N
from miles_core.samples import Group, Sample, SampleStatus


def batch_metrics(groups: list[Group]) -> dict[str, float]:
    """Distribution metrics of one consumed batch.

    Rewards count scored samples only (failed ones have none). A group has zero std when all its
    scored rewards are equal (GRPO learns nothing from it). Weight versions are per token over the
    batch; the mixed-version ratio is the fraction of samples whose tokens carry more than one.
    """
    samples = [s for g in groups for s in g.samples]
    out: dict[str, float] = {}
    if not samples:
        return out
    rewards = [s.reward for s in samples if s.reward is not None]
    if rewards:
        out[N.REWARD] = sum(rewards) / len(rewards)
    lengths = [len(s.response_ids) for s in samples]
    out[N.RESPONSE_LEN_MEAN] = sum(lengths) / len(lengths)
    out[N.RESPONSE_LEN_MAX] = float(max(lengths))
    out[N.TRUNCATED_RATIO] = sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples)
    scored_groups = [[s.reward for s in g.samples if s.reward is not None] for g in groups]
    scored_groups = [r for r in scored_groups if r]
    if scored_groups:
        out[N.ZERO_STD_RATIO] = sum(statistics.pstdev(r) == 0.0 for r in scored_groups) / len(scored_groups)
    versions = [v for s in samples for v in s.token_versions]
    if versions:
        out[N.WEIGHT_VERSION_MEAN] = sum(versions) / len(versions)
        out[N.WEIGHT_VERSION_MIN] = float(min(versions))
        out[N.WEIGHT_VERSION_MAX] = float(max(versions))
    out[N.MIXED_VERSION_RATIO] = sum(s.mixed_version for s in samples) / len(samples)
    tools = tool_counts(samples)
    if tools:
        out[N.TOOL_EPISODE_SHARE] = sum(t["calls"] > 0 for t in tools) / len(tools)
        out[N.TOOL_CALLS_PER_EPISODE] = sum(t["calls"] for t in tools) / len(tools)
        out[N.TOOL_ERRORS] = float(sum(t["errors"] for t in tools))
        out[N.TOOL_TIMEOUTS] = float(sum(t["timeouts"] for t in tools))
    return out


def tool_counts(samples: list[Sample]) -> list[dict[str, int]]:
    """The `"tool": {calls, errors, timeouts}` counts of the samples whose metadata has them (an agentic
    episode's, docs/agentic.md); samples without them are left out."""
    out = []
    for s in samples:
        try:
            tool = json.loads(s.metadata or "{}").get("tool")
        except (ValueError, AttributeError):
            continue
        if isinstance(tool, dict):
            out.append({k: int(tool.get(k) or 0) for k in ("calls", "errors", "timeouts")})
    return out


def writer_metrics(groups: list[Group]) -> dict[str, float]:
    """Who generated a consumed batch, from its group ids: the groups of producer jobs, in all and per
    producer id, and how many producers fed it. Nothing for a batch of a run without prompt claims (its
    ids name no holder: no producer can feed it)."""
    holders = Counter(holder_of_id(g.group_id) for g in groups)
    if not groups or holders.get("", 0) == len(groups):
        return {}
    producers = {h: n for h, n in holders.items() if h not in ("", TRAINER_HOLDER)}
    out = {N.PRODUCERS_CONSUMED_GROUPS: float(sum(producers.values())), N.PRODUCERS_COUNT: float(len(producers))}
    out.update({N.PRODUCER_CONSUMED_GROUPS.format(producer_id=h): float(n) for h, n in producers.items()})
    return out
