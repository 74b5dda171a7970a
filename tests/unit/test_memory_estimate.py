"""The trainer's memory per GPU, estimated before anything starts (miles_core.prepare.memory).

Guards: a run whose trainer cannot fit its GPUs starting engines and a cluster first and dying at its
first step with CUDA out of memory; parameter counts that drift from the real models'.
"""

from __future__ import annotations

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import validate
from miles_core.models.families import spec_of
from miles_core.prepare.memory import GIB, estimate, memory_problems

SMOLLM2_135M = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                "max_position_embeddings": 8192, "tie_word_embeddings": True}
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
GPU = ["--engine-backend", "sglang"]


def cfg(*flags):
    return parse_flags(["--preset", "tiny-reverse4", *list(flags)], check=False)


def test_parameter_counts_are_the_real_models():
    assert spec_of(SMOLLM2_135M).parameters() == 134_515_008
    assert spec_of(LLAMA_7B).parameters() == 6_738_415_616


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
    assert 60 * GIB < est.total < 80 * GIB  # 56.5 GiB of states + ~14.2 GiB of activations + logits + 1 GiB


def test_smollm2_fits_a_small_gpu_unless_the_micro_batch_is_huge():
    """SmolLM2-135M: 2.3 GiB of states; the default 256 samples of 8192 padded tokens would not fit,
    and the advice names the micro-batch size that does."""
    small = cfg(*GPU, "--max-seq-len", "512", "--micro-batch-size", "8")
    est = estimate(SMOLLM2_135M, small)
    assert 2.2 * GIB < est.weights + est.grads + est.optimizer < 2.3 * GIB
    assert memory_problems(SMOLLM2_135M, small, 24) == []
    huge = memory_problems(SMOLLM2_135M, cfg(*GPU, "--max-seq-len", "1024", "--rollout-batch-size", "64",
                                             "--n-samples-per-prompt", "8"), 24)
    assert len(huge) == 1 and "Would fit: " in huge[0] and "--micro-batch-size 8" in huge[0], huge


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
        check_memory(parse_flags(["--preset", "tiny-reverse4", *GPU, "--actor-num-gpus-per-node", "8", "--gpu-memory-gb", "40"], check=False),
                     f"file://{tmp_path}")


SEVEN_B_8 = [*GPU, "--actor-num-gpus-per-node", "8", "--max-seq-len", "2048", "--micro-batch-size", "1"]


def test_the_distributed_optimizer_shards_the_adam_state_over_dp():
    """bf16 weights (2) + fp32 main grads (4) on every rank, the 12 B/param of Adam and the master
    copy over the DP ranks: at TP 2 x DP 4, 6 + 12 / 4 = 9 B per parameter of the TP shard."""
    params = 6_738_415_616
    est = estimate(LLAMA_7B, cfg(*SEVEN_B_8, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"))
    assert est.weights + est.grads + est.optimizer == pytest.approx((6 + 12 / 4) * params / 2)


def test_cpu_trainer_widths_follow_bf16():
    """On CPU: fp32 weights and Adam m, v (4 + 4 + 8); --bf16: the GPU's 2 + 4 + 12."""
    params = spec_of(SMOLLM2_135M).parameters()
    fp32 = estimate(SMOLLM2_135M, cfg("--max-seq-len", "64"), gpu=False)
    bf16 = estimate(SMOLLM2_135M, cfg("--max-seq-len", "64", "--bf16"), gpu=False)
    assert fp32.weights + fp32.grads + fp32.optimizer == pytest.approx(16 * params)
    assert bf16.weights + bf16.grads + bf16.optimizer == pytest.approx(18 * params)
    assert fp32.overhead == bf16.overhead == 0


def test_recompute_and_sequence_parallel_cut_activations_in_the_right_order():
    """Full recompute of every layer keeps L layer inputs + one layer: far below all L layers;
    block recompute of half the layers lies between; selective drops the s^2 scores of all but one
    layer; sequence parallel divides the norms' activations by TP."""
    tp2 = [*SEVEN_B_8, "--tensor-model-parallel-size", "2"]
    act = lambda *flags: estimate(LLAMA_7B, cfg(*tp2, *flags)).activations
    none = act()
    full = act("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    block = act("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "16")
    selective = act("--recompute-granularity", "selective")
    sp = act("--sequence-parallel")
    assert full < none / 8 and full < block < none
    assert selective < none and sp < none
    # 32 layers + the one layer of gradients backward holds, then the embedding/final-norm term
    assert none - sp == pytest.approx(33 * 2 * 2048 * (4 * 4096 - 4 * 4096 / 2) + 2 * 2048 * 3 * 4096 / 2)


def test_token_budget_replaces_samples_times_length():
    """--use-dynamic-batch-size: one packed row of --max-tokens-per-gpu tokens, its unfused attention
    over the whole row (n^2, not b s^2) plus the row's n x n bool mask."""
    base = [*GPU, "--max-seq-len", "512", "--micro-batch-size", "4"]
    padded = estimate(SMOLLM2_135M, cfg(*base)).activations
    packed = estimate(SMOLLM2_135M, cfg(*base, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048")).activations
    assert packed > padded  # 4 x 512 tokens either way; the packed row's scores are 4x
    small = estimate(SMOLLM2_135M, cfg(*base, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512")).activations
    assert small < padded


def test_advice_names_each_single_change_that_fits():
    """7B on 8 GPUs at TP 1 with 80 GiB: TP 2 fits; recompute alone does not (18 B/param of states is
    113 GiB), nor does the distributed optimizer alone (83 GiB: the unfused attention's 2,048 x 2,048
    planes of 32 heads keep 6 bytes each per layer in bf16)."""
    problems = memory_problems(LLAMA_7B, cfg(*SEVEN_B_8), 80)
    assert len(problems) == 1
    assert "Would fit: --tensor-model-parallel-size 2." in problems[0]
    assert "--recompute-granularity" not in problems[0] and "--use-distributed-optimizer" not in problems[0]


def test_the_seven_b_figures_of_docs_training_md_are_the_estimate():
    """Pins: the `miles validate` output docs/training.md quotes for 7B on 8 GPUs (TP 2 fits 80 GiB, TP 1 is
    refused naming what fits) is what the estimate prints. Guards: a doc figure left behind when the
    estimate changes (the doc's own command runs with an empty stand-in model, so it cannot see it)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    shown = " ".join(doc.split("## Memory per GPU", 1)[1].split("```", 2)[1].split())
    tp2 = estimate(LLAMA_7B, cfg(*SEVEN_B_8, "--tensor-model-parallel-size", "2"))
    assert f"trainer memory per GPU (estimate): {tp2.describe()}" in shown, shown
    refused = memory_problems(LLAMA_7B, cfg(*SEVEN_B_8, "--tensor-model-parallel-size", "1"), 80)
    assert len(refused) == 1 and refused[0] in shown, (refused, shown)


def test_the_estimate_is_an_upper_bound_so_only_a_run_that_cannot_fit_is_refused():
    """Pins: refused when even LOWER_BOUND x the estimate exceeds the memory, a warning naming the same
    flags when only the estimate does (7B TP 1 on 8 GPUs: 149.1 GiB, 0.75x of it 111.8). Guards: a run
    the estimate's own error bars say may fit being refused."""
    from miles_core.prepare.memory import LOWER_BOUND, budget_fit

    total = estimate(LLAMA_7B, cfg(*SEVEN_B_8)).total / GIB
    assert LOWER_BOUND * total < 120 < total
    problems, warnings = budget_fit(LLAMA_7B, cfg(*SEVEN_B_8), 120)
    assert problems == [] and len(warnings) == 1
    assert "--gpu-memory-gb is 120" in warnings[0] and "may run out of GPU memory" in warnings[0]
    assert "Would fit: --use-distributed-optimizer" in warnings[0]
    assert budget_fit(LLAMA_7B, cfg(*SEVEN_B_8), 100)[0] and budget_fit(LLAMA_7B, cfg(*SEVEN_B_8), 150) == ([], [])


def _model_dir(tmp_path, hf_config):
    import json

    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    return f"file://{tmp_path}"


def test_a_trainer_rank_without_gpu_memory_gb_compares_the_estimate_with_its_gpu(tmp_path, monkeypatch, caplog):
    """Pins: `check_device_memory` (TrainerWorker.__init__, before the model is built) refuses a trainer
    that cannot fit the device's memory, naming what it needs, what the GPU has and a flag that fits;
    warns in the upper-bound band; passes a GPU that holds it. Guards: without --gpu-memory-gb nothing
    compared the estimate with the GPU, so the run died at its first step with CUDA out of memory."""
    from miles_core.prepare import memory
    from miles_core.prepare.checks import check_device_memory

    uri = _model_dir(tmp_path, LLAMA_7B)
    seven_b = cfg(*SEVEN_B_8)  # 149.1 GiB per GPU
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 80 * GIB)
    with pytest.raises(ConfigError) as refused:
        check_device_memory(seven_b, uri)
    message = str(refused.value)
    assert "the trainer needs about 149.1 GiB per GPU" in message and "GPU has 80.0 GiB" in message
    assert "Would fit: --tensor-model-parallel-size 2" in message
    check_device_memory(cfg(*SEVEN_B_8, "--tensor-model-parallel-size", "2"), uri)  # 76 GiB fits

    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 120 * GIB)  # the band: 111.8 < 120 < 149.1
    with caplog.at_level("WARNING", logger="miles_core.prepare.checks"):
        check_device_memory(seven_b, uri)
        check_device_memory(seven_b, uri, warn=False)  # the other ranks
    assert [r.getMessage().count("GPU has 120.0 GiB") for r in caplog.records] == [1]

    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 200 * GIB)
    check_device_memory(seven_b, uri)

    def no_probe():
        raise AssertionError("--gpu-memory-gb replaces the device's memory (checked before the run started)")

    monkeypatch.setattr(memory, "device_memory_bytes", no_probe)
    check_device_memory(cfg(*SEVEN_B_8, "--gpu-memory-gb", "40"), uri)


def test_on_cpu_nothing_is_compared(tmp_path, monkeypatch):
    """device_memory_bytes is None without CUDA, and then even a trainer no GPU holds passes."""
    import torch

    from miles_core.prepare import memory
    from miles_core.prepare.checks import check_device_memory

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: tests/gpu/test_device_memory.py")
    assert memory.device_memory_bytes() is None
    check_device_memory(cfg(*SEVEN_B_8), _model_dir(tmp_path, LLAMA_7B))


def test_the_trainer_worker_refuses_before_it_builds_the_model(tmp_path, monkeypatch):
    """Pins: TrainerWorker.__init__ runs the device check first, on every rank (a rank left building its
    model would wait at the rendezvous for one that refused)."""
    import torch

    from miles_core.prepare import memory
    from miles_core.prepare.checks import check_device_memory
    from miles_core.train import trainer, worker

    def no_model(*a, **k):
        raise AssertionError("the model was built before the memory check")

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # __init__ sets them:
        monkeypatch.setenv(name, "")  # recorded, so teardown restores them (a later trainer would rendezvous on them)
    threads = torch.get_num_threads()  # __init__ sets them on CPU
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 80 * GIB)
    monkeypatch.setattr(trainer, "Trainer", no_model)  # imported by __init__
    try:
        for rank in (0, 3):
            with pytest.raises(ConfigError, match="GPU has 80.0 GiB"):
                worker.TrainerWorker(cfg(*SEVEN_B_8), _model_dir(tmp_path, LLAMA_7B), rank, 8, ("127.0.0.1", 1), [],
                                     preflight=check_device_memory)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["builtin:tiny-gpt", "builtin:tiny-llama", "builtin:tiny-qwen2"])
def test_a_builtin_models_config_before_the_run_is_the_one_it_is_built_from(name):
    """The checks read the builtin model's config without transformers; it must be the model's own."""
    from miles_core.models.builtin import builtin_config, builtin_hf_config

    built = builtin_hf_config(name, 3, 64, 4).to_dict()
    light = builtin_config(name, 3, 64, 4)
    assert {k: built[k] for k in light if k in built} == {k: v for k, v in light.items() if k in built}
    assert len(set(light) & set(built)) >= len(light) - 1  # transformers 5 keeps rope_theta in rope_parameters
    assert spec_of(light) == spec_of(built)


QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
             "max_position_embeddings": 32768, "tie_word_embeddings": False}


def test_a_rank_counts_auto_as_the_layers_it_will_build(tmp_path, monkeypatch, caplog):
    """Pins: on a trainer rank `--transformer-impl auto` is estimated as what the rank builds: with
    Transformer Engine installed (the project's GPU image) its fused attention keeps no s x s state, so
    Qwen2.5-7B at 4,096 tokens, TP 2, fits an 80 GiB GPU (~45 GiB) without a word; without it the local
    spec's unfused attention needs ~83 GiB and the rank warns that it may run out. Guards: the rank
    counted auto as local whatever it had, warning about (or refusing) a run the GPU image holds."""
    from miles_core.prepare import memory
    from miles_core.prepare.checks import check_device_memory

    uri = _model_dir(tmp_path, QWEN25_7B)
    flags = [*GPU, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--use-distributed-optimizer", "--micro-batch-size", "1", "--max-seq-len", "4096"]
    run = cfg(*flags)
    assert 80 * GIB < estimate(QWEN25_7B, run).total < 90 * GIB  # counted as local before the run
    assert 40 * GIB < estimate(QWEN25_7B, cfg(*flags, "--transformer-impl", "transformer_engine")).total < 50 * GIB
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 80 * GIB)

    monkeypatch.setattr(memory, "transformer_engine_importable", lambda: False)
    with caplog.at_level("WARNING", logger="miles_core.prepare.checks"):
        check_device_memory(run, uri)
    assert ["about 83.4 GiB" in r.getMessage() and "may run out" in r.getMessage() for r in caplog.records] == [True]
    caplog.clear()
    monkeypatch.setattr(memory, "transformer_engine_importable", lambda: True)
    with caplog.at_level("WARNING", logger="miles_core.prepare.checks"):
        check_device_memory(run, uri)  # fits with Transformer Engine's attention
    assert caplog.records == []
    assert memory.impl_on_this_node(run.train) == "transformer_engine"
    assert memory.impl_on_this_node(cfg(*GPU, "--transformer-impl", "local").train) == "local"  # asked for: kept
