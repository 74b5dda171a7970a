"""Token-budget micro-batches (--use-dynamic-batch-size --max-tokens-per-gpu; miles_core.train.packing):
packed rows without padding make exactly the update of padded micro-batches.

Pins:
- the plan: every sample once, each micro-batch within the budget except an over-long sample alone,
  no two micro-batches that would fit together (first fit), deterministic;
- a packed row: position ids restart per sample, the mask is block-diagonal causal, and the
  per-target tensors are 0 at the position that predicts the next sample's first token;
- log-probs of a packed row equal the samples' padded log-probs on builtin:tiny-gpt (learned
  positions, read from the position ids) and builtin:tiny-llama (RoPE by the index in the row),
  while the same row under a plain causal mask does not (the mask is what separates samples);
- the real CPU Trainer: loss metrics and every parameter gradient (entropy bonus and KL to a
  perturbed reference included) with the token budget equal those of --micro-batch-size 2, on
  samples of uneven lengths, one of them longer than the budget; the packed micro-batches compute
  no padding (train/padding_fraction 0) where the padded ones do;
- DP=2 over gloo (two processes, the strict device harness): each rank packs its shard and the
  gradients equal the DP=1 padded ones;
- the config rules: the flag pair is needed together, the budget >= 1.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
import torch.distributed as dist

from miles_core.config import ConfigError, parse_flags
from miles_core.config.sections import TrainSection
from miles_core.metrics import names as N
from miles_core.models.builtin import SEP_ID, materialize_checkpoint
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.train.losses import LossConfig
from miles_core.train.megatron_model import masked_token_logprobs, unwrap
from miles_core.train.packing import block_causal_mask, pack_rows, plan_micro_batches
from miles_core.rank_batches import trainable_samples
from miles_core.train.trainer import Trainer, _pack, _pack_row
from tests.support.ranks import exit_launcher, fork_ranks
from tests.support import strict_device as strict

torch.set_num_threads(1)

RTOL, ATOL = 1e-5, 1e-6  # fp32 on CPU; only shapes (summation order) differ between the layouts
BUDGET = 24  # tokens per micro-batch; the longest sample below has 28
PADDED = dataclasses.replace(TrainSection(), lr=0.0, clip_grad=1e9, micro_batch_size=2, entropy_coef=0.01)
PACKED = dataclasses.replace(PADDED, use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET)
LOSS_KEYS = ("train/loss", "train/pg_clipfrac", "train/ppo_kl", "train/train_rollout_logprob_abs_diff",
             "train/entropy", "train/tis_mean", "train/grad_norm")


def _groups() -> list[Group]:
    """3 groups x 4 samples: prompts of 3, 6 and 8 tokens, responses of 1..12 tokens and one of 20
    (8 + 20 = 28 tokens > BUDGET, within tiny-gpt's 32 positions); rollout log-probs vary."""
    rng = random.Random(11)
    groups = []
    for g, plen in enumerate((3, 6, 8)):
        prompt = [rng.randrange(10) for _ in range(plen - 1)] + [SEP_ID]
        samples = []
        for i in range(4):
            n = 20 if (g, i) == (2, 1) else rng.randint(1, 12)
            resp = [rng.randrange(13) for _ in range(n)]
            logp = [-rng.uniform(0.5, 4.0) for _ in resp]
            mask = [0 if (g, i, k) == (1, 2, 1) else 1 for k in range(n)]  # one masked token inside a response
            samples.append(Sample(f"g{g}", g, i, prompt, resp, logp, mask, [1] * n, reward=rng.random(),
                                  status=SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def _grads(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------ the plan and the packed row


@pytest.mark.parametrize("seed", range(20))
def test_plan_keeps_the_budget_and_first_fit(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(0, 30))]
    budget = rng.randint(8, 60)
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for micro in plan for i in micro) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in micro) for micro in plan]
    for micro, load in zip(plan, loads):
        assert load <= budget or len(micro) == 1, (micro, load, budget)
    for a in range(len(plan)):  # first fit: no two micro-batches would have fitted into one
        for b in range(a + 1, len(plan)):
            assert loads[a] + loads[b] > budget, (plan[a], plan[b])
    assert plan == plan_micro_batches(list(lengths), budget)


def test_plan_puts_an_over_long_sample_alone_and_refuses_no_budget():
    assert plan_micro_batches([5, 30, 3, 25, 2], 10) == [[0, 2, 4], [1], [3]]
    assert plan_micro_batches([], 10) == []
    for budget in (0, None):
        with pytest.raises(ValueError, match="--max-tokens-per-gpu"):
            plan_micro_batches([3], budget)


def test_packed_row_layout():
    tokens = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])]
    targets = [{"mask": torch.tensor([0.0, 1.0])}, {"mask": torch.tensor([1.0])},
               {"mask": torch.tensor([0.0, 1.0, 1.0])}]
    row = pack_rows(tokens, targets, "cpu")
    assert row["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # target t predicts token t + 1: 0 where token t + 1 starts the next sample (t = 2 and 4)
    assert row["mask"].tolist() == [[0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    allowed = ~block_causal_mask([3, 2, 4])[0, 0]
    assert allowed.shape == (9, 9) and row["attention_mask"].dtype == torch.bool
    seg = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    for q in range(9):
        assert [k for k in range(9) if allowed[q, k]] == [k for k in range(q + 1) if seg[k] == seg[q]]


def test_packed_rows_have_no_padding_and_padded_ones_do():
    items = trainable_samples(_groups(), True)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s, _ in items]
    packed = sum(_pack_row([items[i] for i in micro], True, "cpu")["tokens"].numel()
                 for micro in plan_micro_batches(lengths, BUDGET))
    padded = sum(_pack(items[k:k + 2], True, "cpu")["tokens"].numel() for k in range(0, len(items), 2))
    assert packed == sum(lengths) < padded, (packed, padded)


# ------------------------------------------------------------------ log-probs of a packed row


@pytest.fixture(scope="module", params=["builtin:tiny-gpt", "builtin:tiny-llama"])
def trainer(request, tmp_path_factory):
    hf_dir = materialize_checkpoint(request.param, 1, str(tmp_path_factory.mktemp(request.param.replace(":", "-"))))
    cfg = dataclasses.replace(PADDED, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    with Trainer(cfg, hf_dir) as tr:
        torch.manual_seed(0)
        with torch.no_grad():  # a reference that differs from the policy: the KL term has gradients
            for p in unwrap(tr.ref_model).parameters():
                p.add_(0.01 * torch.randn_like(p))
        yield tr


def test_packed_logprobs_equal_the_padded_ones(trainer):
    items = trainable_samples(_groups(), True)[:5]
    padded, row = _pack(items, True, "cpu"), _pack_row(items, True, "cpu")
    with torch.no_grad():
        ref, _ = masked_token_logprobs(trainer.model, padded["tokens"], padded["mask"])
        got, _ = masked_token_logprobs(trainer.model, row["tokens"], row["mask"], position_ids=row["position_ids"],
                                       attention_mask=row["attention_mask"])
        causal, _ = masked_token_logprobs(trainer.model, row["tokens"], row["mask"], position_ids=row["position_ids"])
    want, mine = ref[padded["mask"] > 0], row["mask"][0] > 0
    assert want.numel() == int(mine.sum()) > 20
    torch.testing.assert_close(got[0][mine], want, rtol=RTOL, atol=ATOL)
    # under the default (plain causal) mask later samples see earlier ones
    assert (causal[0][mine] - want).abs().max() > 1e-3


def test_trainer_step_with_a_token_budget_is_the_padded_step(trainer):
    """lr=0: both steps take their gradients at the same weights."""
    padded_cfg = trainer.cfg
    m_pad = trainer.train_step(0, _groups())
    g_pad = _grads(trainer)
    trainer.cfg = dataclasses.replace(padded_cfg, use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET)
    try:
        m_pack = trainer.train_step(0, _groups())
    finally:
        trainer.cfg = padded_cfg
    g_pack = _grads(trainer)
    assert m_pad["train/kl_loss"] > 0 and m_pad["train/grad_norm"] > 0
    for key in LOSS_KEYS + ("train/kl_loss",):
        assert m_pack[key] == pytest.approx(m_pad[key], rel=RTOL, abs=1e-7), key
    assert set(g_pack) == set(g_pad)
    for name, g in g_pad.items():
        torch.testing.assert_close(g_pack[name], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert m_pad[N.MICRO_BATCHES] == 6 and m_pad[N.PADDING_FRACTION] > 0.1
    assert m_pack[N.PADDING_FRACTION] == 0.0 and m_pack[N.MICRO_BATCHES] >= 5  # 131 tokens / 24


# ------------------------------------------------------------------ config rules


def test_the_two_flags_go_together():
    cfg = parse_flags(["--preset", "tiny-reverse4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"])
    assert cfg.train.use_dynamic_batch_size and cfg.train.max_tokens_per_gpu == 9216
    with pytest.raises(ConfigError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        parse_flags(["--preset", "tiny-reverse4", "--use-dynamic-batch-size"])
    with pytest.raises(ConfigError, match="--max-tokens-per-gpu=9216 is only used with --use-dynamic-batch-size"):
        parse_flags(["--preset", "tiny-reverse4", "--max-tokens-per-gpu", "9216"])
    with pytest.raises(ConfigError, match="--max-tokens-per-gpu=0 must be >= 1"):
        parse_flags(["--preset", "tiny-reverse4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"])


# ------------------------------------------------------------------ DP=2: each rank packs its shard

DP = 2


def _worker(rank: int, hf_dir: str, tmp: str) -> None:
    """DP rank `rank` of 2: first the padded step as a DP=1 trainer (dp state 1, 0, None), then the
    packed step on its shard at DP=2; lr=0, so both at the same weights."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=DP)
    from miles_core.train import collectives

    with Trainer(PADDED, hf_dir) as tr:
        assert collectives.standing_device(tr.dp_group) == "cuda"  # the DP group stands for NCCL
        dp_state = tr.dp_size, tr.dp_rank, tr.dp_group
        tr.dp_size, tr.dp_rank, tr.dp_group = 1, 0, None
        one = {"metrics": tr.train_step(0, _groups()), "grads": _grads(tr)}
        tr.dp_size, tr.dp_rank, tr.dp_group = dp_state
        tr.cfg = PACKED
        two = {"metrics": tr.train_step(0, _groups()), "grads": _grads(tr)}
    torch.save({"dp1": one, "dp2": two}, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp: str) -> None:
    """Spawned: import Megatron and write the checkpoint once, then fork the ranks (no process group
    before the fork); exits without interpreter teardown."""
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    hf_dir = materialize_checkpoint("builtin:tiny-llama", 1, os.path.join(tmp, "tiny-llama"))
    os.environ.update(strict.ENV)
    fork_ranks(_worker, [(r, hf_dir, tmp) for r in range(DP)])
    exit_launcher(0)


@pytest.mark.parametrize("estimator, extra", [("gspo", {}),
                                              ("reinforce_plus_plus", {"normalize_advantages": True, "gamma": 0.9})])
def test_sequence_ratios_and_per_token_advantages_pack_like_the_padded_step(trainer, estimator, extra):
    """gspo's per-sequence ratio finds its sequence in a packed row as in a padded one, and
    reinforce_plus_plus's per-token discounted advantages travel with their tokens (lr=0)."""
    saved_cfg, saved_loss = trainer.cfg, trainer.loss_cfg
    base = dataclasses.replace(saved_cfg, advantage_estimator=estimator, **extra)
    trainer.loss_cfg = LossConfig.from_section(base)
    try:
        trainer.cfg = base
        m_pad = trainer.train_step(0, _groups())
        g_pad = _grads(trainer)
        trainer.cfg = dataclasses.replace(base, use_dynamic_batch_size=True, max_tokens_per_gpu=BUDGET)
        m_pack = trainer.train_step(0, _groups())
        g_pack = _grads(trainer)
    finally:
        trainer.cfg, trainer.loss_cfg = saved_cfg, saved_loss
    assert m_pad["train/grad_norm"] > 0
    for key in LOSS_KEYS:
        assert m_pack[key] == pytest.approx(m_pad[key], rel=RTOL, abs=1e-7), key
    for name, g in g_pad.items():
        torch.testing.assert_close(g_pack[name], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
