"""miles' off-policy corrections (`--custom-tis-function-path`: icepop, vanilla TIS, MIS with rejection
sampling and veto) against hand computations, through the policy loss and from miles' command line
(docs/algorithms.md#off-policy-corrections---custom-tis-function-path).

The fixed batch: sample A, 3 response tokens, all trained, ratios exp(old - rollout) = 2, 0.5, 1;
sample B, 2 response tokens, the second not trained (a tool's), ratios 3 and 1. In the loss they lie
in one packed row after a prompt token each: segments [0, 1, 1, 1, 0, 2, 2], mask [0, 1, 1, 1, 0, 1, 0],
advantages +1 on A, -1 on B, 4 loss tokens. At the first forward logp = old, so the PPO ratio is 1
and each token's clipped term is -advantage: -1 on A, +1 on B.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles_core.config import ConfigError, parse_flags
from miles_core.config.plugins import PluginError, correction_path, load_plugin
from miles_core.train import corrections as C
from miles_core.train.losses import LossConfig, policy_loss, sum_keys

ln = math.log
OLD = [[ln(0.5), ln(0.4), ln(0.9)], [ln(0.3), ln(0.2)]]
ROLLOUT = [[ln(0.25), ln(0.8), ln(0.9)], [ln(0.1), ln(0.2)]]
MASKS = [[1.0, 1.0, 1.0], [1.0, 0.0]]
MIS_PATH = "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def _lists():
    return ([torch.tensor(x) for x in OLD], [torch.tensor(x) for x in ROLLOUT], [torch.tensor(x) for x in MASKS])


def _args(**kw):
    base = dict(tis_clip=2.0, tis_clip_low=0.5, use_tis=True, tis_level="token", tis_mode="truncate",
                tis_lower_bound=None, tis_upper_bound=2.0, use_rs=False, rs_level="token", rs_lower_bound=None,
                rs_upper_bound=None, rs_veto_threshold=None, tis_batch_normalize=False)
    return SimpleNamespace(**{**base, **kw})


def _call(fn, **kw):
    train, rollout, masks = _lists()
    return fn(_args(**kw), pg_loss=torch.ones(5), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)


def test_icepop_and_vanilla_tis_by_hand():
    """icepop, bounds [0.5, 2]: A's ratios 2, 0.5, 1 are inside (kept as they are), B's 3 is popped to 0,
    B's untrained token (ratio 1) keeps 1. Vanilla TIS clamps instead: B's 3 -> 2."""
    pg, masks, metrics = _call(C.icepop_function)
    assert pg.tolist() == pytest.approx([2.0, 0.5, 1.0, 0.0, 1.0])
    assert [m.tolist() for m in masks] == MASKS
    assert metrics["tis_clipfrac"].tolist() == [0, 0, 0, 1, 0]
    pg, _, metrics = _call(C.vanilla_tis_function)
    assert pg.tolist() == pytest.approx([2.0, 0.5, 1.0, 2.0, 1.0])
    assert metrics["tis"].tolist() == pytest.approx([2.0, 0.5, 1.0, 3.0, 1.0])


@pytest.mark.parametrize("level, weights", [
    ("token", [2.0, 0.5, 1.0, 2.0, 0.0]),       # B's 3 truncated to 2; B's untrained token 0
    ("sequence", [1.0, 1.0, 1.0, 2.0, 0.0]),    # A: 2 x 0.5 x 1 = 1; B: its loss token's 3 -> 2
    ("geometric", [1.0, 1.0, 1.0, 2.0, 0.0]),   # A: (2 x 0.5 x 1)^(1/3) = 1; B: 3 -> 2
])
def test_mis_truncate_levels_by_hand(level, weights):
    pg, masks, metrics = _call(C.compute_mis_weights_with_cp, tis_level=level)
    assert pg.tolist() == pytest.approx(weights)
    assert [m.tolist() for m in masks] == MASKS
    # A's 2 is at the bound, not over it; at sequence level B's untrained token carries B's 3 (outside the loss)
    assert torch.cat(metrics["mis_tis_truncate_fraction"]).tolist() == [0, 0, 0, 1, int(level != "token")]


def test_mis_mask_mode_rejection_and_veto_by_hand():
    """mask mode, bounds [0.5, 2]: B's 3 rejects its token (mask 0), A's are kept, weights unbounded.
    RS, its bounds the IS ones: B's 3 is rejected too. RS bounds [0.5, 5] and a veto of 0.6: A's 0.5 < 0.6
    rejects A whole (catastrophic share of A's tokens 1, of B's 0), B's token is kept."""
    pg, masks, _ = _call(C.compute_mis_weights_with_cp, tis_mode="mask")
    assert pg.tolist() == pytest.approx([2.0, 0.5, 1.0, 3.0, 0.0])
    assert [m.tolist() for m in masks] == [[1, 1, 1], [0, 0]]
    _, masks, _ = _call(C.compute_mis_weights_with_cp, use_rs=True)
    assert [m.tolist() for m in masks] == [[1, 1, 1], [0, 0]]
    _, masks, metrics = _call(C.compute_mis_weights_with_cp, use_rs=True, rs_upper_bound=5.0, rs_veto_threshold=0.6)
    assert [m.tolist() for m in masks] == [[0, 0, 0], [1, 0]]
    assert torch.cat(metrics["mis_rs_catastrophic_seq_fraction"]).tolist() == [1, 1, 1, 0, 0]
    # RS bounds of their own: [0.9, 2.5] rejects A's 0.5 and B's 3, nothing else
    _, masks, _ = _call(C.compute_mis_weights_with_cp, use_rs=True, rs_lower_bound=0.9, rs_upper_bound=2.5)
    assert [m.tolist() for m in masks] == [[1, 0, 1], [0, 0]]


def test_mis_batch_normalize_by_hand():
    """Token level: truncated weights over the 4 loss tokens 2 + 0.5 + 1 + 2 = 5.5, mean 1.375; each
    weight divided by it. Sequence level: A's mean 1, B's 2 -> mean 1.5."""
    pg, _, metrics = _call(C.compute_mis_weights_with_cp, tis_batch_normalize=True)
    assert pg.tolist() == pytest.approx([2 / 1.375, 0.5 / 1.375, 1 / 1.375, 2 / 1.375, 0.0])
    assert torch.cat(metrics["mis_batch_norm_factor"]).tolist() == pytest.approx([1.375] * 5)
    pg, _, _ = _call(C.compute_mis_weights_with_cp, tis_level="sequence", tis_batch_normalize=True)
    assert pg.tolist() == pytest.approx([1 / 1.5, 1 / 1.5, 1 / 1.5, 2 / 1.5, 0.0])


def test_mis_without_use_tis_gives_metrics_only():
    """--get-mismatch-metrics: no weights, the masks as they were, the train-rollout KL of each token
    (rollout - train: ln(0.25/0.5), ln(0.8/0.4), 0 on A)."""
    train, rollout, masks = _lists()
    weights, kept, metrics = C.compute_mis_weights(_args(use_tis=False), train_log_probs=train,
                                                   rollout_log_probs=rollout, loss_masks=masks)
    assert weights is None and kept is masks
    assert metrics["kl"][0].tolist() == pytest.approx([ln(0.5), ln(2.0), 0.0])


def _row_batch():
    """The fixed batch as the trainer packs it: one row, a prompt token before each sample."""
    old = torch.tensor([[0.0, *OLD[0], 0.0, *OLD[1]]])
    rollout = torch.tensor([[0.0, *ROLLOUT[0], 0.0, *ROLLOUT[1]]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0, 1, 0]])
    adv = torch.tensor([[0.0, 1, 1, 1, 0, -1, -1]])
    segments = torch.tensor([[0.0, 1, 1, 1, 0, 2, 2]])
    return old, rollout, mask, adv, segments


def _loss(train_section):
    old, rollout, mask, adv, segments = _row_batch()
    logp = old.clone().requires_grad_(True)
    cfg = LossConfig.from_section(train_section)
    loss, sums = policy_loss(cfg, logp, adv, mask, total_tokens=4.0, rollout_logp=rollout, segments=segments)
    loss.backward()
    return cfg, loss, sums, logp.grad


def _train(*flags):
    return parse_flags(["--preset", "tiny-reverse4", "--no-use-rollout-logprobs", "--use-tis", *flags]).train


def test_the_loss_with_icepop_by_hand():
    """Terms x icepop weights: A -1 x (2, 0.5, 1) = -3.5, B's trained token +1 x 0 -> loss -3.5 / 4 =
    -0.875 (the built-in TIS clamps B's 3 to 2: (-3.5 + 2) / 4 = -0.375). The gradient on A's first
    token is -advantage x ratio x weight / 4 = -0.5; on B's popped token 0."""
    cfg, loss, sums, grad = _loss(_train("--custom-tis-function-path",
                                         "miles.backends.training_utils.loss_hub.corrections.icepop_function"))
    assert cfg.correction is C.icepop_function
    assert float(loss) == pytest.approx(-0.875)
    assert grad[0, 1] == pytest.approx(-0.5) and grad[0, 5] == 0.0
    assert sums["train/tis_clipfrac"] == pytest.approx(1.0)  # summed over the 4 loss tokens: 1 of them
    _, loss, _, _ = _loss(_train("--tis-clip-low", "0.5"))
    assert float(loss) == pytest.approx(-0.375)


def test_the_loss_with_mis_rejection_by_hand():
    """MIS truncate + RS in [0.5, 5] with a veto of 0.6: A rejected whole (its 0.5 < 0.6) leaves only B's token, weight 3
    truncated to 2: loss +1 x 2 / 4 = 0.5; A's tokens get no gradient. The metrics are sums over the
    loss tokens (the trainer divides by the batch's 4): catastrophic sequences 3 of 4 tokens."""
    cfg, loss, sums, grad = _loss(_train("--custom-tis-function-path", MIS_PATH, "--use-rs",
                                         "--rs-upper-bound", "5", "--rs-veto-threshold", "0.6"))
    assert float(loss) == pytest.approx(0.5)
    assert grad[0, 1:4].tolist() == [0.0, 0.0, 0.0] and grad[0, 5] == pytest.approx(0.5)
    assert sums["train/mis_rs_catastrophic_seq_fraction"] == pytest.approx(3.0)
    assert set(sums) >= set(sum_keys(cfg)) and "train/mis_tis_weight_before_bound" in sum_keys(cfg)


def test_get_mismatch_metrics_leaves_the_loss_unchanged():
    """--get-mismatch-metrics without --use-tis: the on-policy loss (-3 + 1) / 4 = -0.5, and the KL
    metrics summed over the loss tokens: ln 0.5 + ln 2 + 0 + ln(1/3)."""
    train = parse_flags(["--preset", "tiny-reverse4", "--no-use-rollout-logprobs", "--get-mismatch-metrics",
                         "--custom-tis-function-path", MIS_PATH]).train
    _, loss, sums, _ = _loss(train)
    assert float(loss) == pytest.approx(-0.5)
    assert sums["train/mis_kl"] == pytest.approx(ln(0.5) + ln(2.0) + ln(1 / 3))


def test_miles_mis_command_line_with_its_yaml(tmp_path):
    """miles' MIS recipe (its README's three flags and its mis.yaml) parses as it is; the file's keys
    override the command line, as in miles."""
    (tmp_path / "mis.yaml").write_text(
        "use_tis: true\nuse_rs: true\ntis_level: \"token\"\nrs_level: \"token\"\ntis_mode: \"truncate\"\n"
        "tis_lower_bound: 0.5\ntis_upper_bound: 2.0\nrs_lower_bound: null\nrs_upper_bound: null\n"
        "rs_veto_threshold: 1.0e-4\ntis_batch_normalize: true\n")
    t = parse_flags(["--preset", "tiny-reverse4", "--no-use-rollout-logprobs", "--tis-upper-bound", "3",
                     "--custom-config-path", str(tmp_path / "mis.yaml"), "--custom-tis-function-path", MIS_PATH]).train
    assert (t.use_tis, t.use_rs, t.tis_upper_bound, t.rs_veto_threshold, t.tis_batch_normalize) == (
        True, True, 2.0, 1e-4, True)
    assert LossConfig.from_section(t).correction is C.compute_mis_weights_with_cp


def test_bad_corrections_are_refused_by_name(tmp_path):
    (tmp_path / "bad.yaml").write_text("use_tis: yes please\nrollout_shuffle_seed: 3\nuse_rs: true\n")
    with pytest.raises(ConfigError) as e:
        parse_flags(["--preset", "tiny-reverse4", "--custom-config-path", str(tmp_path / "bad.yaml")])
    assert "key 'use_tis': expected true or false" in str(e.value)
    assert "key 'rollout_shuffle_seed': unknown flag --rollout-shuffle-seed" in str(e.value)
    with pytest.raises(ConfigError, match="--use-rs: read only by a --custom-tis-function-path"):
        parse_flags(["--preset", "tiny-reverse4", "--use-rs"])
    with pytest.raises(ConfigError, match="called only with --use-tis"):
        parse_flags(["--preset", "tiny-reverse4", "--custom-tis-function-path", MIS_PATH])
    with pytest.raises(ConfigError, match="--use-decoupled-loss has its own behaviour weight"):
        _train("--custom-tis-function-path", MIS_PATH, "--use-decoupled-loss")
    with pytest.raises(ConfigError, match="--tis-batch-normalize needs --tis-level token or sequence"):
        _train("--custom-tis-function-path", MIS_PATH, "--tis-level", "geometric", "--tis-batch-normalize")
    with pytest.raises(PluginError, match="--custom-tis-function-path='nowhere:fn'"):
        load_plugin(correction_path("nowhere.fn"), "--custom-tis-function-path")


def test_a_correction_returning_the_wrong_shape_is_named():
    def broken(args, *, pg_loss, **kw):
        return pg_loss[:2], kw["loss_masks"], {}

    old, rollout, mask, adv, segments = _row_batch()
    cfg = LossConfig(use_tis=True, use_rollout_logprobs=False, correction=broken, correction_args=_args())
    with pytest.raises(ValueError, match=r"broken .*--custom-tis-function-path.* returned pg_loss of shape \(2,\)"):
        policy_loss(cfg, old.clone(), adv, mask, total_tokens=4.0, rollout_logp=rollout, segments=segments)
