"""A rollout cut into the trainer's data-parallel parts (docs/training.md#data-parallelism).

    parts = split_rollout(groups, DataLayout(dp_size=2), optimizer_steps=1, balance=False, normalize_std=True)
    parts[dp_rank]      # RankBatch: this DP rank's samples per optimizer step, with each step's global token count

The rollout side cuts each batch here and puts one part per DP rank in Ray's object store; the driver
hands the references to the ranks without reading them, and each rank reads only its own part (a
tensor-parallel peer reads the same one). A part carries what a rank needs of the whole rollout: each
optimizer step's global loss-token count (the loss is normalised by it, so DP=N makes the DP=1 update)
and the rollout's count of trainable samples. The rollout side imports no trainer from here (torch only
for the advantages, inside `trainable_samples`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from miles_core.samples import Group, Sample, SampleStatus

EXCLUDED_STATUSES = (SampleStatus.FAILED, SampleStatus.ABORTED, SampleStatus.PENDING)
Item = tuple[Sample, "float | list[float]"]  # a sample and its advantage (one value, or one per response token)
ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
WHITEN_EPS = 1e-8  # miles' distributed_masked_whiten


@dataclass(frozen=True)
class AdvantageSettings:
    """How a rollout's rewards become advantages (docs/algorithms.md): --advantage-estimator,
    --normalize-advantages-std (grpo, gspo), --normalize-advantages (whitening over the rollout's loss
    tokens), --gamma (reinforce_plus_plus's discount)."""
    estimator: str = "grpo"
    normalize_std: bool = True
    whiten: bool = False
    gamma: float = 1.0
    kl_coef: float = 0.0  # --kl-coef: the KL to the reference in the reward (reinforce_plus_plus estimators)

    @classmethod
    def from_section(cls, t) -> "AdvantageSettings":
        return cls(t.advantage_estimator, t.normalize_advantages_std, t.normalize_advantages, t.gamma, t.kl_coef)

    @property
    def kl_in_reward(self) -> bool:
        """The trainer finishes the advantages: each token's KL enters the reward, then the whitening
        (`kl_reward_advantages`), so the rollout's split leaves both to it."""
        return self.kl_coef != 0.0


class RankBatchError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class DataLayout:
    """Which data-parallel part each trainer rank trains: Megatron's rank order (tensor-parallel ranks
    innermost) with pipeline and context parallel size 1, so rank r is in DP rank r // tp."""
    dp_size: int = 1
    tp: int = 1

    @classmethod
    def of(cls, world_size: int, tp: int) -> "DataLayout":
        if world_size % tp:
            raise RankBatchError(f"{world_size} trainer ranks do not divide into tensor-parallel groups of {tp}")
        return cls(world_size // tp, tp)

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp


@dataclass
class RankStep:
    """One optimizer step's share of a DP rank: its items, the step's loss tokens over every DP rank, and
    the step's first item (an idle micro-batch's stand-in on a rank that got none, under expert parallelism)."""
    items: list[Item]
    tokens: float
    first: Item | None


@dataclass
class RankBatch:
    dp_rank: int
    steps: list[RankStep] = field(default_factory=list)
    samples: int = 0  # trainable samples in the whole rollout


def loss_mask(s: Sample) -> list[int]:
    """The sample's loss mask (all 1 without one); one entry per response token."""
    if not s.loss_mask:
        return [1] * len(s.response_ids)
    if len(s.loss_mask) != len(s.response_ids):
        raise RankBatchError(f"sample {s.group_id}/{s.sample_index}: loss_mask has {len(s.loss_mask)} entries "
                             f"for {len(s.response_ids)} response tokens")
    return [int(m) for m in s.loss_mask]


def sequence_length(s: Sample) -> int:
    return len(s.prompt_ids) + len(s.response_ids)


def grpo_advantages(rewards, normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Per-sample advantages of one group (its rewards): r - mean(r), divided by (std + eps) when asked,
    as float32 values. std is unbiased (n - 1), torch's default, as in slime; a group of one sample gets
    0. numpy, not torch: the rollout side computes these, and its process never needs torch (3 CPU-s to
    import); computed in float64 and rounded to float32 once: within a few float32 steps of torch's
    float32 arithmetic."""
    import numpy as np

    r = np.asarray(rewards, dtype=np.float32).astype(np.float64).reshape(-1)
    if r.size < 2:
        return [0.0] * int(r.size)
    adv = r - r.mean()
    if normalize_std:
        adv = adv / (r.std(ddof=1) + np.float64(np.float32(eps)))
    return adv.astype(np.float32).tolist()


def trainable_samples(groups: list[Group], normalize_std: bool = True,
                      settings: AdvantageSettings | None = None) -> list[Item]:
    """(sample, advantage) for every sample that can be trained on (`settings`, default GRPO with
    `normalize_std`):
    - grpo, gspo: r - mean(r) of the sample's group, divided by the group's std with normalize_std;
    - reinforce_plus_plus_baseline: r - mean(r) of the group (never divided by its std);
    - reinforce_plus_plus: the discounted return of the reward placed on the sample's last loss token,
      G_t = gamma^(last - t) r for t <= last, 0 after it (one value per token unless gamma is 1);
    then, with `whiten`, every value minus the rollout's mean over loss tokens, divided by its std
    (unbiased) + 1e-8 under the root, as miles' --normalize-advantages."""
    settings = settings or AdvantageSettings(normalize_std=normalize_std)
    if settings.estimator not in ESTIMATORS:
        raise RankBatchError(f"--advantage-estimator={settings.estimator}: not one of {', '.join(ESTIMATORS)}")
    out: list[Item] = []
    for g in groups:
        kept = [s for s in g.samples if s.status not in EXCLUDED_STATUSES and s.reward is not None and s.response_ids]
        if not kept:
            continue
        rewards = [float(s.reward) for s in kept]
        if settings.estimator in ("grpo", "gspo"):
            adv: list = grpo_advantages(rewards, settings.normalize_std)
        elif settings.estimator == "reinforce_plus_plus_baseline":
            mean = math.fsum(rewards) / len(rewards)
            adv = [r - mean for r in rewards]
        else:
            adv = [discounted_returns(r, loss_mask(s), settings.gamma) for r, s in zip(rewards, kept)]
        out.extend(zip(kept, adv))
    return whiten(out) if settings.whiten and not settings.kl_in_reward else out


def kl_reward_advantages(items: list[Item], kls: list[list[float]], settings: AdvantageSettings) -> list[Item]:
    """`items`' advantages (as `trainable_samples` gives them with the KL in the reward: not whitened)
    with each token's KL to the reference (`kls`, one per response token, 0 off the loss) in the
    reward, as miles' --kl-coef: reinforce_plus_plus, the token rewards -kl_coef x kl_t plus the reward
    on the last loss token, returned as G_t = r_t + gamma G_(t+1); reinforce_plus_plus_baseline,
    (r - group mean) - kl_coef x kl_t. Not whitened (the caller whitens over every DP rank)."""
    out: list[Item] = []
    for (s, a), kl in zip(items, kls):
        c = settings.kl_coef
        if settings.estimator == "reinforce_plus_plus_baseline":
            out.append((s, [float(a) - c * k for k in kl]))
            continue
        mask = loss_mask(s)
        token_rewards = [-c * k for k in kl]
        if any(mask):
            token_rewards[max(i for i, m in enumerate(mask) if m)] += float(s.reward)
        returns, running = [0.0] * len(kl), 0.0
        for t in reversed(range(len(kl))):
            running = token_rewards[t] + settings.gamma * running
            returns[t] = running
        out.append((s, returns))
    return out


def whitening_sums(items: list[Item]) -> tuple[float, float, float]:
    """(sum, sum of squares, count) of the advantages over the loss tokens of `items` (summed over DP
    ranks before `whiten_with`)."""
    total = total_sq = count = 0.0
    for s, a in items:
        for m, v in zip(loss_mask(s), _per_token(a, len(s.response_ids))):
            total, total_sq, count = total + m * v, total_sq + m * v * v, count + m
    return total, total_sq, count


def whiten_with(items: list[Item], total: float, total_sq: float, count: float) -> list[Item]:
    """`items`' advantages minus the mean, divided by the unbiased std (+ 1e-8 under the root), of the
    loss-token values whose `whitening_sums` are given."""
    import math

    if count == 0:
        return items
    mean = total / count
    var = total_sq / count - mean * mean
    if count >= 2:
        var *= count / (count - 1)
    scale = 1.0 / math.sqrt(max(var, 0.0) + WHITEN_EPS)
    return [(s, (a - mean) * scale if isinstance(a, (int, float)) else [(v - mean) * scale for v in a])
            for s, a in items]


def discounted_returns(reward: float, mask: list[int], gamma: float) -> "float | list[float]":
    """REINFORCE++'s per-token return of a terminal reward on the last loss token (miles'
    get_reinforce_plus_plus_returns with no KL in the reward): the reward itself when gamma is 1."""
    if gamma == 1.0 or not any(mask):
        return reward
    last = max(i for i, m in enumerate(mask) if m)
    return [reward * gamma ** (last - t) if t <= last else 0.0 for t in range(len(mask))]


def whiten(items: list[Item]) -> list[Item]:
    """Advantages shifted and scaled by the mean and unbiased std over every loss token of `items`."""
    return whiten_with(items, *whitening_sums(items))


def _per_token(advantage: "float | list[float]", n: int) -> list[float]:
    return [float(advantage)] * n if isinstance(advantage, (int, float)) else list(advantage)


def optimizer_batches(items: list, steps: int) -> list[list]:
    """`items` in order, cut into `steps` global batches as equal as possible (miles: a rollout of
    rollout_batch_size x n samples gives that / --global-batch-size optimizer steps). Samples
    excluded from training leave their batch smaller; an empty rollout still yields one batch."""
    steps = max(1, min(steps, len(items)))
    size, extra = divmod(len(items), steps)
    out, start = [], 0
    for i in range(steps):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def shards(items: list, dp_size: int, balance: bool, tokens=len) -> list[list]:
    """Every DP rank's share of `items` (index = DP rank), each in `items`' order: contiguous slices, or with
    `balance` (--balance-data) the longest first onto the least loaded rank; `tokens(item)` is an item's
    token count."""
    if dp_size == 1:
        return [list(items)]
    if not balance:
        per, extra = divmod(len(items), dp_size)
        starts = [r * per + min(r, extra) for r in range(dp_size + 1)]
        return [list(items[starts[r]:starts[r + 1]]) for r in range(dp_size)]
    loads = [0] * dp_size
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-tokens(items[i]), i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += tokens(items[i])
    return [[item for i, item in enumerate(items) if owner[i] == r] for r in range(dp_size)]


def shard(items: list, dp_size: int, dp_rank: int, balance: bool, tokens=len) -> list:
    """DP rank `dp_rank`'s share of `items` (see `shards`)."""
    return shards(items, dp_size, balance, tokens)[dp_rank]


def split_rollout(groups: list[Group], layout: DataLayout, *, optimizer_steps: int, balance: bool,
                  normalize_std: bool = True, advantages: AdvantageSettings | None = None) -> list[RankBatch]:
    """The rollout's part for each DP rank (index = DP rank)."""
    items = trainable_samples(groups, normalize_std, advantages)
    parts = [RankBatch(r, samples=len(items)) for r in range(layout.dp_size)]
    for batch in optimizer_batches(items, optimizer_steps):
        tokens = float(sum(sum(loss_mask(s)) for s, _ in batch))
        first = batch[0] if batch else None
        for part, mine in zip(parts, shards(batch, layout.dp_size, balance, tokens=lambda it: sequence_length(it[0]))):
            part.steps.append(RankStep(mine, tokens, first))
    return parts


def split_for_run(groups: list[Group], layout: DataLayout, cfg) -> list[RankBatch]:
    """`split_rollout` with the run's settings (`cfg`, a RunConfig): --global-batch-size's optimizer steps,
    --balance-data and the advantage settings (AdvantageSettings.from_section)."""
    t = cfg.train
    return split_rollout(groups, layout, optimizer_steps=cfg.optimizer_steps_per_rollout, balance=t.balance_data,
                         advantages=AdvantageSettings.from_section(t))


@dataclass
class TrainBatch:
    """What the driver receives of a step's batch: the consumed group ids, the rollout's metrics and failure
    tally, and one part per DP rank (a Ray object reference from the rollout manager's actor, or the
    `RankBatch` itself in one process), which the driver hands to the ranks unread."""
    group_ids: list[str]
    metrics: dict[str, float]
    failures: dict
    parts: list


class TrainerShape(Protocol):
    """What a layout reads of the config's train section (this module sits below the config)."""
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    tensor_model_parallel_size: int


def data_layout(t: TrainerShape) -> DataLayout:
    """The run's DataLayout: its trainer ranks and tensor-parallel size."""
    return DataLayout.of(t.actor_num_nodes * t.actor_num_gpus_per_node, t.tensor_model_parallel_size)
