"""The memory estimate of a MoE model and of Qwen3's attention width (miles_core.prepare.memory),
read through the family's ModelSpec.

Pins: Qwen3-8B's and Qwen3-30B-A3B's parameter counts (the published 8.19 B; 30.53 B total, 3.35 B
active); the routed experts are divided over EP x ETP ranks, the routers are whole on every rank,
and with --use-distributed-optimizer the experts' Adam state is sharded over the expert-DP ranks
(world / (TP x EP)) and the rest over DP; a MoE layer's activations count its top-k token copies
through experts of width moe_ffn (and the router's logits); the attention keeps heads x head_dim
wide tensors (Qwen3's head_dim is not hidden / heads), plus the q/k norms' inputs; the advice names
--expert-model-parallel-size when that is what fits.
Guards: an estimate that read a MoE model's intermediate_size as one dense MLP and held every expert
on every rank, or sized the attention by hidden_size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.config import parse_flags
from miles_core.models.families import spec_of
from miles_core.prepare.memory import estimate, memory_problems

CONFIGS = Path(__file__).resolve().parents[1] / "support" / "model_configs"
QWEN3_8B = json.loads((CONFIGS / "qwen3-8b.json").read_text())
QWEN3_30B = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
EIGHT = ["--actor-num-gpus-per-node", "8", "--max-seq-len", "2048", "--micro-batch-size", "1"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def cfg(*flags):
    return parse_flags(["--preset", "tiny-reverse4", *list(flags)], check=False)


def test_parameter_counts_are_the_published_ones():
    assert spec_of(QWEN3_8B).parameters() == 8_190_735_360
    moe = spec_of(QWEN3_30B)
    assert (moe.parameters(), moe.active_parameters(), moe.expert_parameters()) == \
        (30_532_122_624, 3_353_032_704, 48 * 128 * 3 * 2048 * 768)


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (1, 8), (2, 2), (2, 4)])
def test_routed_experts_are_divided_over_ep_and_routers_kept_whole(tp, ep):
    spec = spec_of(QWEN3_30B)
    experts, routers = spec.expert_parameters(), 48 * 128 * 2048
    dense = (spec.parameters() - experts - routers) / tp + routers
    est = estimate(QWEN3_30B, cfg(*EIGHT, "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size",
                                  str(ep), "--use-distributed-optimizer"))
    assert est.weights == pytest.approx(2 * (dense + experts / (ep * tp)))
    assert est.grads == pytest.approx(4 * (dense + experts / (ep * tp)))
    dp, expert_dp = 8 // tp, 8 // (tp * ep)
    assert est.optimizer == pytest.approx(12 * (dense / dp + experts / (ep * tp) / expert_dp))


def test_moe_activations_count_the_top_k_copies_through_the_experts():
    """Top-8 against top-4 on Qwen3-30B-A3B: 4 more token copies per MoE layer (48, plus the one whose
    gradients backward holds), each keeping 4 x 768 of the gated expert MLP and 2 x 2048 dispatched and
    combined, at 2 bytes, for 2048 tokens."""
    top4 = {**QWEN3_30B, "num_experts_per_tok": 4}
    flags = cfg(*EIGHT, "--expert-model-parallel-size", "8")
    more = estimate(QWEN3_30B, flags).activations - estimate(top4, flags).activations
    assert more == pytest.approx(49 * 2 * 2048 * 4 * (4 * 768 + 2 * 2048))
    # the router's logits and scores: 2 x experts per token and layer
    fewer = {**QWEN3_30B, "num_experts": 64}
    assert estimate(QWEN3_30B, flags).activations - estimate(fewer, flags).activations == \
        pytest.approx(49 * 2 * 2048 * 2 * 64)


def test_attention_width_is_heads_times_head_dim():
    """Qwen3 with head_dim 256 over 32 heads (q 8192 wide over a hidden size of 4096): Q, K and V repeated to
    every head and the context, 4 x 4096 more per token and layer, and the q/k norms' inputs (q and kv),
    4096 + 8 x 128 more."""
    wide = {**QWEN3_8B, "head_dim": 256}
    flags = cfg(*EIGHT)
    more = estimate(wide, flags).activations - estimate(QWEN3_8B, flags).activations
    assert more == pytest.approx(37 * 2 * 2048 * (4 * 4096 + 4096 + 8 * 128))


def test_advice_names_expert_parallelism_when_it_fits():
    problems = memory_problems(QWEN3_30B, cfg(*EIGHT, *FULL, "--use-distributed-optimizer"), 80)
    assert len(problems) == 1 and "--expert-model-parallel-size 8" in problems[0], problems
    assert memory_problems(QWEN3_30B, cfg(*EIGHT, *FULL, "--use-distributed-optimizer",
                                          "--expert-model-parallel-size", "8"), 80) == []
    # a TP size the expert-parallel groups leave no room for is not advised (TP x EP > 8 ranks)
    ep8 = memory_problems(QWEN3_30B, cfg(*EIGHT, "--use-distributed-optimizer", "--expert-model-parallel-size",
                                         "8", "--max-seq-len", "8192"), 80)
    assert ep8 and "--tensor-model-parallel-size" not in ep8[0], ep8
