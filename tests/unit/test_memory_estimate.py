"""The trainer's memory per GPU, estimated before anything starts (miles_core.prepare.memory).

Guards: a run whose trainer cannot fit its GPUs starting engines and a cluster first and dying at its
first step with CUDA out of memory; parameter counts that drift from the real models'.
"""

from __future__ import annotations

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import validate
from miles_core.prepare.memory import GIB, Shape, estimate, memory_problems

SMOLLM2_135M = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                "max_position_embeddings": 8192, "tie_word_embeddings": True}
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
GPU = ["--engine-backend", "sglang"]


def cfg(*flags):
    return parse_flags(list(flags), check=False)


def test_parameter_counts_are_the_real_models():
    assert Shape.from_hf_config(SMOLLM2_135M).parameters() == 134_515_008
    assert Shape.from_hf_config(LLAMA_7B).parameters() == 6_738_415_616


def test_seven_b_states_are_eighteen_bytes_per_parameter_per_tp_rank():
    """bf16 weights (2) + fp32 main grads (4) + Adam m, v and the fp32 master copy (12)."""
    params = 6_738_415_616
    for tp in (1, 2, 4):
        est = estimate(LLAMA_7B, cfg(*GPU, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", str(tp)))
        assert est.weights + est.grads + est.optimizer == pytest.approx(18 * params / tp)


def test_seven_b_on_80_gib_needs_tensor_parallelism_and_says_so():
    """The unfused attention of the local layer spec keeps b x heads x s^2 scores per layer: at 2048 tokens
    even one sample per micro-batch needs TP 2 on 80 GiB."""
    flags = [*GPU, "--actor-num-gpus-per-node", "8", "--max-seq-len", "2048", "--micro-batch-size", "1"]
    problems = memory_problems(LLAMA_7B, cfg(*flags), 80)
    assert len(problems) == 1 and "--gpu-memory-gb is 80" in problems[0]
    assert "--tensor-model-parallel-size 2" in problems[0]
    assert memory_problems(LLAMA_7B, cfg(*flags, "--tensor-model-parallel-size", "2"), 80) == []
    est = estimate(LLAMA_7B, cfg(*flags, "--tensor-model-parallel-size", "2"))
    assert 60 * GIB < est.total < 80 * GIB  # 56.5 GiB of states + ~14 GiB of activations + logits


def test_smollm2_fits_a_small_gpu_unless_the_micro_batch_is_huge():
    """SmolLM2-135M: 2.3 GiB of states; the default 256 samples of 8192 padded tokens would not fit,
    and the advice names the micro-batch size that does."""
    small = cfg(*GPU, "--max-seq-len", "512", "--micro-batch-size", "8")
    est = estimate(SMOLLM2_135M, small)
    assert 2.2 * GIB < est.weights + est.grads + est.optimizer < 2.3 * GIB
    assert memory_problems(SMOLLM2_135M, small, 24) == []
    huge = memory_problems(SMOLLM2_135M, cfg(*GPU, "--rollout-batch-size", "64", "--n-samples-per-prompt", "8"), 24)
    assert len(huge) == 1 and "--micro-batch-size" in huge[0]


def test_activations_grow_with_tokens_and_shrink_with_tp():
    a = estimate(LLAMA_7B, cfg(*GPU, "--max-seq-len", "1024", "--micro-batch-size", "1")).activations
    assert estimate(LLAMA_7B, cfg(*GPU, "--max-seq-len", "1024", "--micro-batch-size", "2")).activations == pytest.approx(2 * a)
    tp2 = cfg(*GPU, "--max-seq-len", "1024", "--micro-batch-size", "1", "--actor-num-gpus-per-node", "2",
              "--tensor-model-parallel-size", "2")
    assert estimate(LLAMA_7B, tp2).activations < a


def test_validate_checks_gpu_memory_gb_for_a_model_it_can_read(tmp_path):
    """Pins: --gpu-memory-gb with a local HF directory is checked by validate; too small is refused
    naming the flag. Not set: not checked."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    base = [*GPU, "--hf-checkpoint", str(tmp_path), "--actor-num-gpus-per-node", "8", "--max-seq-len", "2048",
            "--micro-batch-size", "1"]
    validate(cfg(*base))
    with pytest.raises(ConfigError, match="--gpu-memory-gb is 80.*--tensor-model-parallel-size 2"):
        validate(cfg(*base, "--gpu-memory-gb", "80"))
    validate(cfg(*base, "--gpu-memory-gb", "80", "--tensor-model-parallel-size", "2"))


def test_the_run_checks_a_model_it_could_not_read_at_validation_once_it_is_present(tmp_path):
    """Pins: `check_memory` (called by run_training after the model is imported, before any role starts)
    reads config.json from the model's URI. Guards: a remote model escaping the check."""
    import json

    from miles_core.prepare.checks import check_memory

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    c = cfg(*GPU, "--actor-num-gpus-per-node", "8", "--max-seq-len", "2048", "--micro-batch-size", "1")
    check_memory(c, f"file://{tmp_path}")  # no --gpu-memory-gb: nothing to compare
    with pytest.raises(ConfigError, match="--gpu-memory-gb is 40"):
        check_memory(parse_flags([*GPU, "--actor-num-gpus-per-node", "8", "--gpu-memory-gb", "40"], check=False),
                     f"file://{tmp_path}")
