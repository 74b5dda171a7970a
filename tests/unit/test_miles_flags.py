"""miles' training flags with miles' meaning (docs/real-model.md).

Pins: --global-batch-size cuts a rollout into rollout_batch_size x n / it optimizer steps, each
the same as a train step over that slice alone; --ref-load gives the initial and the KL reference
weights (an HF directory or a checkpoint location); --load from another location gives weights
and optimizer state to a run without a checkpoint of its own, and falls back when it holds none;
a miles fully async recipe's command line parses with those meanings, and its flags this project
does not implement are refused by name ("not supported"), never ignored.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles_core.config import ConfigError, parse_flags
from miles_core.config.sections import TrainSection
from miles_core.metrics.names import OPTIMIZER_STEPS
from miles_core.models.builtin import materialize_checkpoint
from miles_core.storage import Store
from miles_core.train.checkpoint import CheckpointError, CheckpointManager
from miles_core.train.initial_weights import apply_load, apply_ref_load
from miles_core.rank_batches import optimizer_batches
from miles_core.train.trainer import Trainer
from tests.unit.test_train import make_groups, params

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("tiny")))


def trainer(hf_dir, steps=1, **kw):
    return Trainer(dataclasses.replace(TrainSection(), lr=1e-2, **kw), hf_dir, seed=3, optimizer_steps=steps)


def same(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_optimizer_batches_cut_in_order():
    assert optimizer_batches(list(range(10)), 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert optimizer_batches(list(range(4)), 1) == [[0, 1, 2, 3]]
    assert optimizer_batches([1, 2], 5) == [[1], [2]]  # never an empty optimizer step
    assert optimizer_batches([], 4) == [[]]


def test_global_batch_size_gives_that_many_optimizer_steps_each_over_its_slice(tiny):
    groups = make_groups(n_groups=4, n=4)
    two = trainer(tiny, steps=2)
    metrics = two.train_step(0, groups)
    assert metrics[OPTIMIZER_STEPS] == 2.0
    one = trainer(tiny, steps=1)  # the same two optimizer steps, one rollout slice at a time
    one.train_step(0, groups[:2])
    one.train_step(1, groups[2:])
    assert same(params(two), params(one)) < 1e-6
    single = trainer(tiny, steps=1)
    single.train_step(0, groups)
    assert same(params(two), params(single)) > 1e-4  # two steps are not one step


def test_global_batch_size_from_the_command_line():
    cfg = parse_flags(["--preset", "tiny-reverse4", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "8"])
    assert cfg.optimizer_steps_per_rollout == 4
    assert parse_flags(["--preset", "tiny-reverse4"]).optimizer_steps_per_rollout == 1
    with pytest.raises(ConfigError, match="must divide"):
        parse_flags(["--preset", "tiny-reverse4", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "12"])


def test_ref_load_from_a_checkpoint_location_sets_initial_and_reference_weights(tiny, tmp_path):
    src = trainer(tiny)
    src.train_step(0, make_groups())
    CheckpointManager(Store(str(tmp_path / "ckpt"))).save(0, src)
    kl = trainer(tiny, use_kl_loss=True, kl_loss_coef=0.0)
    assert same(params(kl), params(src)) > 1e-4
    apply_ref_load(kl, str(tmp_path / "ckpt"))
    assert same(params(kl), params(src)) == 0.0
    ref = {n: p.detach() for n, p in kl.ref_model.named_parameters()}
    assert same(ref, params(src)) == 0.0


def test_ref_load_from_an_hf_directory_and_a_bad_location(tiny, tmp_path):
    other = materialize_checkpoint("builtin:tiny-gpt", 7, str(tmp_path / "other"))
    t = trainer(tiny)
    apply_ref_load(t, other)
    assert same(params(t), params(trainer(other))) == 0.0
    with pytest.raises(CheckpointError, match="--ref-load"):
        apply_ref_load(t, str(tmp_path / "nothing-here"))


def test_load_from_another_location_brings_weights_and_optimizer_state(tiny, tmp_path, caplog):
    src = trainer(tiny)
    src.train_step(0, make_groups())
    CheckpointManager(Store(str(tmp_path / "a"))).save(4, src)
    dst = trainer(tiny)
    own = Store(str(tmp_path / "b"))
    assert apply_load(dst, str(tmp_path / "a"), own) == 4
    assert same(params(dst), params(src)) == 0.0
    src.train_step(1, make_groups(seed=1))  # the optimizer moments came along: the next step agrees
    dst.train_step(1, make_groups(seed=1))
    assert same(params(dst), params(src)) < 1e-6
    assert apply_load(dst, own.uri(), own) is None  # --load == --save: the run's own resume
    with caplog.at_level("WARNING"):
        assert apply_load(dst, str(tmp_path / "empty"), own) is None
    assert "holds no checkpoint" in caplog.text


# slime's examples/fully_async/run-qwen3-4b-fully_async.sh (THUDM/slime 4a2812e), its CKPT_ARGS,
# ROLLOUT_ARGS, GRPO_ARGS, the batch and parallel flags, with its own paths.
RECIPE = """
  --hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/
  --save /root/Qwen3-4B_slime/ --save-interval 20
  --prompt-data /path/to/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
  --rollout-shuffle --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --balance-data
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --entropy-coef 0.00 --eps-clip 0.2
  --eps-clip-high 0.28 --use-tis --no-use-rollout-logprobs --lr 1e-6 --weight-decay 0.1
  --rollout-num-gpus-per-engine 1 --actor-num-nodes 1 --actor-num-gpus-per-node 4
""".split()


def recipe(tmp_path) -> list[str]:
    """RECIPE with its paths under tmp_path, created: validation checks that local inputs exist."""
    for d in ("root/Qwen3-4B", "root/Qwen3-4B_torch_dist", "path/to"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "path/to/dapo-math-17k.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    return [f"{tmp_path}{a}" if a.startswith(("/root/", "/path/")) else a for a in RECIPE]


def test_a_miles_fully_async_recipe_parses_with_miles_meaning(tmp_path):
    cfg = parse_flags(["--preset", "tiny-reverse4", *recipe(tmp_path)])
    root = f"{tmp_path}/root"
    assert (cfg.model.hf_checkpoint, cfg.train.ref_load, cfg.train.load, cfg.train.save, cfg.train.save_interval) == (
        f"{root}/Qwen3-4B", f"{root}/Qwen3-4B_torch_dist", f"{root}/Qwen3-4B_slime/", f"{root}/Qwen3-4B_slime/", 20)
    assert (cfg.data.input_key, cfg.data.label_key, cfg.data.apply_chat_template, cfg.data.rollout_shuffle) == (
        "prompt", "label", True, True)
    assert cfg.optimizer_steps_per_rollout == 32 * 8 // 256 == 1
    assert cfg.train.balance_data and cfg.train.tensor_model_parallel_size == 2
    assert cfg.train.use_kl_loss and cfg.train.kl_loss_coef == 0.0 and cfg.train.eps_clip_high == 0.28


def test_the_recipe_flags_not_implemented_are_refused_by_name(tmp_path):
    flags = recipe(tmp_path)
    extra = ["--lr-decay-style", "cosine", "--optimizer", "sgd", "--adam-beta2", "0.98"]
    with pytest.raises(ConfigError) as e:
        parse_flags(["--preset", "tiny-reverse4", *flags + extra])
    msg = str(e.value)
    for flag in ("--lr-decay-style", "--optimizer", "--adam-beta2"):
        assert f"{flag} (a miles flag) is not supported" in msg
    with pytest.raises(ConfigError, match="--rollout-function-path.*not supported"):
        parse_flags(["--preset", "tiny-reverse4", *flags + ["--rollout-function-path", "fully_async_rollout.generate_rollout_fully_async"]])


def test_preset_sets_its_flags_and_explicit_flags_win():
    cfg = parse_flags(["--preset", "smollm2-arith", "--num-rollout", "3"])
    assert cfg.model.hf_checkpoint == "import:smollm2-135m-instruct" and cfg.data.apply_chat_template
    assert cfg.run.num_rollout == 3 and cfg.rollout.rollout_top_k == 50
    with pytest.raises(ConfigError, match="--preset: invalid choice"):
        parse_flags(["--preset", "nope"])
