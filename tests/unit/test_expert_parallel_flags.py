"""miles' expert-parallel and --moe-* flags: each is read, checked against the checkpoint, or refused by name.

Pins, on tiny configs built with transformers' own config classes (Qwen3-MoE: softmax router, no
shared expert; GLM-4.5: sigmoid router, expert bias, shared experts, the first layer dense, grouped
top-k) read through the shared ModelSpec: the model flags miles' recipes pass (qwen3-30B-A3B.py,
glm4.5-106B-A12B.py in radixark/miles) pass when they describe the checkpoint and are refused naming
the flag's value and the checkpoint's when they do not; the performance flags the trainer does not
implement are refused with "not supported"; --expert-model-parallel-size must divide the experts and,
with the expert TP size, the ranks, and a dense model takes none of these flags; --moe-layer-freq is
read as Megatron reads it (an int or a 0/1 pattern), without eval.

Guards: a flag validated and then ignored (e.g. a --num-experts that disagrees with config.json while
the trainer builds from config.json), and the old blanket refusal of --expert-model-parallel-size.
"""

from __future__ import annotations

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.config.rules import moe_aux_loss_coeff, moe_flag_problems, moe_layer_pattern
from miles_core.models.families import spec_of

# the --moe-* model arguments of miles' recipes, on our tiny models' values
QWEN3_MOE_RECIPE = ["--moe-ffn-hidden-size", "16", "--moe-router-score-function", "softmax",
                    "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "2", "--moe-layer-freq",
                    "[1]*2", "--num-experts", "4", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"]
GLM_RECIPE = ["--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16", "--moe-router-pre-softmax",
              "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
              "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "4", "--moe-layer-freq", "[0]*1+[1]*2",
              "--num-experts", "8", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0",
              "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2", "--moe-router-group-topk", "2"]


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return spec_of(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                  num_experts_per_tok=2, router_aux_loss_coef=0.01, norm_topk_prob=True).to_dict())


def _glm4_moe():
    from transformers import Glm4MoeConfig

    return spec_of(Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8,
                                 num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                 topk_group=2, routed_scaling_factor=2.5).to_dict())


def _llama():
    from transformers import LlamaConfig

    return spec_of(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2).to_dict())


def _train(*flags: str, ranks: int = 1):
    return parse_flags(["--preset", "tiny-reverse4", *flags, "--actor-num-gpus-per-node", str(ranks)]).train


def test_miles_recipes_model_flags_pass_on_the_checkpoints_they_describe():
    assert moe_flag_problems(_qwen3_moe(), _train(*QWEN3_MOE_RECIPE, "--expert-model-parallel-size", "2",
                                                  ranks=2)) == []
    assert moe_flag_problems(_glm4_moe(), _train(*GLM_RECIPE, "--expert-model-parallel-size", "4", ranks=4)) == []
    assert moe_flag_problems(_qwen3_moe(), _train()) == []  # nothing given: everything is the checkpoint's


@pytest.mark.parametrize("flag, value, named", [
    ("--num-experts", "8", "--num-experts=8 does not match the checkpoint's num_experts / n_routed_experts = 4"),
    ("--moe-router-topk", "1", "--moe-router-topk=1 does not match the checkpoint's num_experts_per_tok = 2"),
    ("--moe-ffn-hidden-size", "32", "--moe-ffn-hidden-size=32 does not match the checkpoint's moe_intermediate_size"),
    ("--moe-router-score-function", "sigmoid", "--moe-router-score-function=sigmoid does not match"),
    ("--moe-shared-expert-intermediate-size", "16", "the shared experts' width = 0"),
    ("--moe-router-topk-scaling-factor", "2.5", "routed_scaling_factor = 1.0"),
    ("--moe-router-num-groups", "2", "--moe-router-num-groups=2 does not match the checkpoint's n_group = 0"),
    ("--moe-layer-freq", "2", "gives the MoE layers [0] of 2; the checkpoint's 2 layers have them at [0, 1]"),
    ("--moe-layer-freq", "__import__('os')", "expected an integer N"),
])
def test_a_model_flag_that_disagrees_with_the_checkpoint_is_refused_naming_both(flag, value, named):
    problems = moe_flag_problems(_qwen3_moe(), _train(flag, value))
    assert len(problems) == 1 and named in problems[0], problems


def test_switches_that_describe_another_router_are_refused():
    assert "norm_topk_prob = true" in moe_flag_problems(_qwen3_moe(), _train("--moe-router-pre-softmax"))[0]
    assert "no expert-score correction bias" in moe_flag_problems(
        _qwen3_moe(), _train("--moe-router-enable-expert-bias"))[0]


def test_expert_parallel_size_must_divide_the_experts_and_a_dense_model_takes_no_moe_flag():
    assert "must divide the checkpoint's 4 routed experts" in moe_flag_problems(
        _qwen3_moe(), _train("--expert-model-parallel-size", "3", ranks=3))[0]
    dense = moe_flag_problems(_llama(), _train("--expert-model-parallel-size", "2", "--num-experts", "4", ranks=2))
    assert any("--num-experts=4 describes a mixture-of-experts model" in p for p in dense)
    assert any("--expert-model-parallel-size=2: the checkpoint (llama) has no experts" in p for p in dense)


def test_a_moe_model_under_tensor_parallelism_needs_sequence_parallelism():
    """Megatron's MoELayer raises in training under TP without it; refused before anything starts."""
    problems = moe_flag_problems(_qwen3_moe(), _train("--tensor-model-parallel-size", "2", ranks=2))
    assert len(problems) == 1 and "needs --sequence-parallel" in problems[0]
    assert moe_flag_problems(_qwen3_moe(), _train("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                  ranks=2)) == []
    assert moe_flag_problems(_llama(), _train("--tensor-model-parallel-size", "2", ranks=2)) == []


def test_expert_parallel_layout_rules():
    """Megatron's: EP x expert TP divides the ranks; expert TP is the dense TP (the only one built)."""
    assert _train("--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                  ranks=4).expert_model_parallel_size == 2
    assert _train("--expert-tensor-parallel-size", "1").expert_tensor_parallel_size == 1  # = TP 1: the default
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size=2 x --tensor-model-parallel-size=2 \(the "
                                          r"expert tensor parallel size\) = 4 must divide the trainer's 2 ranks"):
        _train("--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", ranks=2)
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size=1 is not supported with "
                                          "--tensor-model-parallel-size=2"):
        _train("--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2", ranks=2)
    with pytest.raises(ConfigError, match="--use-distributed-optimizer with --expert-model-parallel-size=2 is not "
                                          "supported"):
        _train("--expert-model-parallel-size", "2", "--use-distributed-optimizer", ranks=2)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size=0 must be >= 1"):
        _train("--expert-model-parallel-size", "0")


@pytest.mark.parametrize("flags, refused", [
    (["--moe-grouped-gemm"], "--moe-grouped-gemm (a miles flag) is not supported"),
    (["--moe-permute-fusion"], "--moe-permute-fusion (a miles flag) is not supported"),
    (["--moe-token-drop-policy", "probs"], "--moe-token-drop-policy (a miles flag) is not supported"),
    (["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor (a miles flag) is not supported"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type=flex is not supported"),
    (["--moe-token-dispatcher-type", "allgather"], "--moe-token-dispatcher-type=allgather is not supported"),
    (["--moe-router-dtype", "fp64"], "--moe-router-dtype=fp64 is not supported"),
    (["--moe-router-bias-update-rate", "0.001"], "--moe-router-bias-update-rate=0.001 is not supported"),
])
def test_performance_flags_the_trainer_does_not_implement_are_refused_by_name(flags, refused):
    with pytest.raises(ConfigError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        parse_flags(["--preset", "tiny-reverse4", *flags])


def test_load_balancing_types_other_than_aux_loss_only_without_an_aux_loss():
    """GLM's recipe passes seq_aux_loss with coefficient 0 (no aux loss either way): accepted. With an
    aux loss to compute (Qwen3-MoE's router_aux_loss_coef) it is refused; none builds without one."""
    assert moe_flag_problems(_glm4_moe(), _train("--moe-router-load-balancing-type", "seq_aux_loss")) == []
    problem = moe_flag_problems(_qwen3_moe(), _train("--moe-router-load-balancing-type", "seq_aux_loss"))[0]
    assert "--moe-router-load-balancing-type=seq_aux_loss is not supported with an aux loss coefficient of 0.01" \
        in problem
    assert moe_flag_problems(_qwen3_moe(), _train("--moe-router-load-balancing-type", "seq_aux_loss",
                                                  "--moe-aux-loss-coeff", "0")) == []
    assert moe_aux_loss_coeff(_train()) is None  # the checkpoint's, derived where the model is built
    assert moe_aux_loss_coeff(_train("--moe-aux-loss-coeff", "0.02")) == 0.02
    assert moe_aux_loss_coeff(_train("--moe-aux-loss-coeff", "0.02", "--moe-router-load-balancing-type", "none")) == 0


def test_moe_layer_freq_reads_megatrons_forms_without_eval():
    assert moe_layer_pattern("1", 3) == [1, 1, 1]
    assert moe_layer_pattern("2", 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("[0]*1+[1]*3", 4) == [0, 1, 1, 1]
    assert moe_layer_pattern("[0, 1] * 2", 4) == [0, 1, 0, 1]
    for bad in ("0", "[2]*4", "__import__('os').system('true')", "[0]*", "x"):
        with pytest.raises(ValueError):
            moe_layer_pattern(bad, 4)
