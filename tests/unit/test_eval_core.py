"""Eval core logic without engines: pass@k, aggregation, datasets and sampling from the config,
result records (docs/evaluation.md). Engine-backed behaviour is pinned in tests/integration/test_eval_modes.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from math import comb

import pytest

from miles_core.config import ConfigError, embedded_default, parse_flags
from miles_core.eval import aggregate, evaluate, pass_at_k, pass_ks
from miles_core.eval.datasets import EvalDataError, EvalDataset, EvalRow, EvalSampling, load_eval_datasets, sampling_from_config
from miles_core.eval.results import EvalResult, evaluated, read_result, record_skip, settled_steps, write_result
from miles_core.metrics.names import EVAL_METRIC_PATTERNS, SKIP_REASONS, eval_skipped_metric
from miles_core.samples import Sample
from miles_core.storage import Store


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one correct among k drawn without replacement), by enumeration."""
    items = [1] * c + [0] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(items[i] for i in d) for d in draws) / len(draws)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (6, 0, 4), (6, 5, 2), (8, 3, 8)])
def test_pass_at_k_matches_enumeration(n, c, k):
    """The unbiased estimator 1 - C(n-c,k)/C(n,k) equals the exact draw probability (guards an
    off-by-one in the product form)."""
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k))
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_ks_powers_of_two_and_n():
    """k reported: powers of two up to n, plus n itself."""
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]


def _sample(p: int, j: int, reward: float, n_tokens: int, finish: str) -> Sample:
    return Sample(f"g{p}", p, j, [1], list(range(n_tokens)), reward=reward, finish_reason=finish)


def test_aggregate_metric_names_and_values():
    """§7.3 metrics of one dataset: mean reward, pass@k per prompt averaged, truncated ratio, mean length."""
    samples = [_sample(0, 0, 1.0, 5, "stop"), _sample(0, 1, 0.2, 3, "length"),
               _sample(1, 0, 0.0, 4, "length"), _sample(1, 1, 0.0, 2, "stop")]
    m = aggregate("held", samples, n=2)
    assert m["eval/held"] == pytest.approx(0.3)
    assert m["eval/held/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/held/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/held/truncated_ratio"] == pytest.approx(0.5)
    assert m["eval/held/response_len/mean"] == pytest.approx(3.5)


def test_tool_use_of_agentic_episodes_is_aggregated_batches_and_evals_alike():
    """Episodes that report `"tool"` counts (the calculator's) give the share that called a tool and the
    calls per episode, in an eval and in a trained batch (with errors and timeouts); samples without
    counts are left out of both, and a run without any logs no tool metric."""
    from miles_core.rollout.batch_metrics import batch_metrics
    from miles_core.samples import Group

    def episode(p, j, calls, errors=0, timeouts=0):
        s = _sample(p, j, 1.0, 4, "stop")
        s.metadata = json.dumps({"task": "arith", "tool": {"calls": calls, "errors": errors, "timeouts": timeouts}})
        return s

    samples = [episode(0, 0, 0), episode(0, 1, 2, errors=1), episode(1, 0, 1, timeouts=1), _sample(1, 1, 0.0, 3, "stop")]
    m = aggregate("held", samples, n=2)
    assert m["eval/held/tool/episode_share"] == pytest.approx(2 / 3)
    assert m["eval/held/tool/calls_per_episode"] == pytest.approx(1.0)
    b = batch_metrics([Group("g0", 0, samples[:2]), Group("g1", 1, samples[2:])])
    assert b["rollout/tool/episode_share"] == pytest.approx(2 / 3) and b["rollout/tool/calls_per_episode"] == 1.0
    assert (b["rollout/tool/errors"], b["rollout/tool/timeouts"]) == (1.0, 1.0)
    plain = [_sample(0, 0, 1.0, 4, "stop")]
    assert not [k for k in aggregate("held", plain, n=1) if "/tool/" in k]
    assert not [k for k in batch_metrics([Group("g0", 0, plain)]) if "/tool/" in k]


def test_metric_patterns_are_the_interface():
    """The exported patterns (checked by the docs) cover every name the code emits."""
    assert set(EVAL_METRIC_PATTERNS) == {
        "eval/{ds}", "eval/{ds}/pass@{k}", "eval/{ds}/truncated_ratio", "eval/{ds}/response_len/mean",
        "eval/{ds}/tool/episode_share", "eval/{ds}/tool/calls_per_episode", "eval/lag_steps", "eval/duration_seconds", "eval/export_seconds", "eval/skipped_{reason}"}
    assert set(SKIP_REASONS) == {"busy", "export_failed", "ckpt_missing", "crashed", "unhealthy", "pin_violation"}
    with pytest.raises(ValueError):
        eval_skipped_metric("tired")


class ScriptedClient:
    """An engine client stand-in answering from a script: (output_ids, finish_reason) per call."""

    def __init__(self, answers, version=3):
        self.answers, self.version, self.calls = list(answers), version, 0

    async def generate(self, input_ids, sampling_params):
        ids, finish = self.answers[self.calls % len(self.answers)]
        self.calls += 1
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": finish}, "weight_version": str(self.version)}}


def test_evaluate_scores_with_the_dataset_reward_and_reports_versions():
    """evaluate() sends n requests per prompt, scores them with the dataset's reward, and reports
    the engine's weight version (used for the pin check)."""
    rows = [EvalRow([1, 2, 3, 4, 10], "4321", "reverse4"), EvalRow([5, 6, 7, 8, 10], "8765", "reverse4")]
    from miles_core.eval.datasets import builtin_reward

    ds = EvalDataset("held", "builtin:x", rows, builtin_reward(embedded_default()))
    client = ScriptedClient([([4, 3, 2, 1, 11], "stop"), ([0, 0, 0, 0, 0], "length")])
    out = asyncio.run(evaluate(client, ds, EvalSampling(n_samples_per_prompt=2, max_response_len=5)))
    assert client.calls == 4
    assert out.weight_versions == [3]
    assert out.metrics["eval/held/truncated_ratio"] == pytest.approx(0.5)
    assert out.metrics["eval/held/pass@2"] == pytest.approx(0.5)  # only the first prompt is ever solved


def test_evaluate_retries_aborts_then_gives_up():
    """A request that keeps coming back aborted fails the eval (it becomes eval/skipped_crashed),
    it never counts as a zero-reward sample."""
    from miles_core.eval.datasets import builtin_reward
    from miles_core.eval.evaluate import EvalAborted

    ds = EvalDataset("held", "builtin:x", [EvalRow([1, 10], "1", "reverse4")], builtin_reward(embedded_default()))
    with pytest.raises(EvalAborted):
        asyncio.run(evaluate(ScriptedClient([([], "abort")]), ds, EvalSampling()))


def test_datasets_and_sampling_from_flags():
    """--eval-prompt-data name=uri, --n-samples-per-eval-prompt, --eval-max-response-len,
    --eval-temperature and --eval-max-prompts reach the eval datasets and sampling."""
    cfg = parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", "held=builtin:reverse4-heldout", "copy=builtin:copy4",
                       "--n-samples-per-eval-prompt", "4", "--eval-max-response-len", "6",
                       "--eval-temperature", "0.7", "--eval-max-prompts", "10", "--eval-interval", "5"])
    ds = load_eval_datasets(cfg)
    assert [d.name for d in ds] == ["held", "copy"]
    assert all(len(d.rows) == 10 for d in ds)
    assert ds[0].rows[0].label == ds[0].rows[0].label[::-1][::-1]
    s = sampling_from_config(cfg)
    assert (s.n_samples_per_prompt, s.max_response_len, s.temperature) == (4, 6, 0.7)
    assert s.sampling_params() == {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6}
    # the eval length falls back on the rollout length
    assert sampling_from_config(parse_flags(["--preset", "tiny-reverse4", "--rollout-max-response-len", "7"])).max_response_len == 7


def test_heldout_is_disjoint_from_training_prompts():
    from miles_core.rollout.builtin_tasks import builtin_rows

    held = {tuple(r["prompt"]) for r in builtin_rows("builtin:reverse4-heldout")}
    train = {tuple(r["prompt"]) for r in builtin_rows("builtin:reverse4")}
    assert held and not held & train


def test_eval_flags_validated():
    """validate() owns the eval rules: a dataset without name, --eval-interval without datasets,
    and the reuse-mode constraint (eval_interval % save_interval == 0) name their flags."""
    with pytest.raises(ConfigError, match="name=uri"):
        parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", "builtin:reverse4-heldout"])
    with pytest.raises(ConfigError, match="--eval-interval needs eval datasets"):
        parse_flags(["--preset", "tiny-reverse4", "--eval-interval", "5", "--eval-prompt-data"])
    with pytest.raises(ConfigError, match=r"--eval-interval % --save-interval == 0"):
        parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", "h=builtin:reverse4-heldout", "--eval-interval", "5",
                     "--save-interval", "2", "--save-hf", "/tmp/hf"])
    parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", "h=builtin:reverse4-heldout", "--eval-interval", "4",
                 "--save-interval", "2", "--save-hf", "/tmp/hf"])


def test_unscored_dataset_needs_a_reward(tmp_path):
    """A dataset whose rows have no builtin reward fails at load time naming --custom-rm-path."""
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": [1, 2, 3], "label": "x"}) + "\n")
    cfg = parse_flags(["--preset", "tiny-reverse4", "--eval-prompt-data", f"mine={src}", "--storage-root", str(tmp_path / "store")])
    with pytest.raises(EvalDataError, match="--custom-rm-path"):
        load_eval_datasets(cfg)


def test_results_and_skips_settle_steps(tmp_path):
    """A step is settled when every dataset has a result or the step has a skip marker."""
    store = Store(str(tmp_path))
    write_result(store, EvalResult(step=4, dataset="a", metrics={"eval/a": 0.5}))
    assert settled_steps(store, ["a", "b"]) == set()
    write_result(store, EvalResult(step=4, dataset="b", metrics={"eval/b": 0.25}))
    got = []

    class Sink:
        def log(self, step, metrics):
            got.append((step, metrics))

    record_skip(store, 9, "crashed", "boom", Sink())
    assert settled_steps(store, ["a", "b"]) == {4, 9}
    assert got == [(9, {"eval/skipped_crashed": 1.0})]
    assert read_result(store, 4, "b").to_row()["mean_reward"] == 0.25
    assert evaluated(store)[4] == {"a", "b"}


def test_evaluation_guide_covers_every_eval_flag_and_metric():
    """docs/evaluation.md names every eval flag, metric pattern and skip reason the code defines.
    Guards: a new eval flag or metric shipped without a word in the user guide."""
    from pathlib import Path

    from miles_core.config import flag_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    for s in flag_table():
        if s.section == "eval":
            assert s.flag in text, s.flag
    for pattern in EVAL_METRIC_PATTERNS:
        assert f"`{pattern}`" in text, pattern
    for reason in SKIP_REASONS:
        assert f"eval/skipped_{reason}" in text, reason
