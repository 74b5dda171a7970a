"""The example of docs/gpu-cluster.md validates and fits the train task's default Ray cluster, as the page says.

The page shows one run three times (the `miles validate` line, the Python placement check, the remote
`pyflyte run --flags "..."`); they must be the same flags. Its claims about that run are checked here:
it fits only with the engine API token, 6 trainer ranks instead of 4 are refused with the message it
quotes, the trainer's memory estimate is the figure it gives, and the bigger clusters it describes fit.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import validate
from miles_core.prepare.memory import GIB, estimate
from miles_core.prepare.resources import demand
from tasks.cluster import TRAIN_CLUSTER, train_cluster

DOC = (Path(__file__).resolve().parents[2] / "docs" / "gpu-cluster.md").read_text()
TOKEN = "MILES_ENGINE_API_KEY"
# Qwen2.5-1.5B-Instruct's config.json (the fields the estimate reads), the model of the page's example.
QWEN25_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
               "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
               "max_position_embeddings": 32768, "tie_word_embeddings": True, "hidden_act": "silu"}


def shown_flags() -> dict[str, str]:
    """The example's flags as each of the three places shows them."""
    validate_line = re.search(r"^miles validate (--hf-checkpoint s3://.*)$", DOC, re.M).group(1)
    python = re.search(r'^FLAGS = \("(.*)"\)$', DOC, re.M).group(1)
    remote = re.search(r'--remote.*?--flags "([^"]*)"', DOC, re.S).group(1)
    return {"miles validate": validate_line, "python check": python, "pyflyte run --remote": remote}


def example_flags() -> list[str]:
    return shlex.split(shown_flags()["pyflyte run --remote"])


def test_the_page_shows_one_run():
    """Pins: the validate line, the Python check and the remote run carry the same flags. Guards: three copies of
    an example drifting apart, so that the one a reader submits is not the one that was checked."""
    shown = shown_flags()
    assert len(set(shown.values())) == 1, shown


def test_the_python_check_runs_and_the_run_fits(monkeypatch, capsys):
    """Pins: the page's Python snippet runs from the repository root and finds the run fits the default cluster;
    its GPUs add up to the 8 the page counts. Guards: an example that the first task would refuse."""
    monkeypatch.delenv(TOKEN, raising=False)
    snippet = re.search(r"```python\n(.*?)```", DOC, re.S).group(1)
    exec(snippet, {})  # noqa: S102 - the page's own code
    assert capsys.readouterr().out.startswith("fits ")
    cfg = parse_flags(example_flags())
    assert sum(b.gpus for b in demand(cfg)) == 8 == sum(n.gpus for n in TRAIN_CLUSTER.nodes)


def test_without_the_token_the_run_is_refused_naming_it(monkeypatch):
    """Pins: on the train task's cluster (two nodes) the run needs MILES_ENGINE_API_KEY, and plain validation
    (no cluster) does not ask for it. Guards: the page's reason for the secret no longer being true."""
    monkeypatch.delenv(TOKEN, raising=False)
    cfg = parse_flags(example_flags())
    validate(cfg)
    with pytest.raises(ConfigError, match=TOKEN):
        validate(cfg, cluster=TRAIN_CLUSTER)


def test_six_trainer_ranks_are_refused_with_the_quoted_message(monkeypatch):
    """Pins: the message the page quotes for 6 ranks is what validation says (its parts around `...`).
    Guards: a quoted error that is not what a reader sees."""
    monkeypatch.setenv(TOKEN, "x")
    quoted = re.search(r"`(the run does not fit .*?)`", " ".join(DOC.split())).group(1)
    with pytest.raises(ConfigError) as info:
        validate(parse_flags([*example_flags(), "--actor-num-gpus-per-node", "6"]), cluster=TRAIN_CLUSTER)
    message = " ".join(str(info.value).split())
    assert all(part.strip() in message for part in quoted.split("...")), message


def test_the_memory_figure_is_the_estimate():
    """Pins: the page's "about 43 GiB per GPU" is the estimate for this run (within 10%), under --gpu-memory-gb 80.
    Guards: a figure that drifts from the estimate when either changes; update the page with the estimate."""
    figure = float(re.search(r"trainer needs about (\d+) GiB per GPU", DOC).group(1))
    total = estimate(QWEN25_1_5B, parse_flags(example_flags())).total / GIB
    assert abs(total - figure) <= 0.1 * figure, f"the estimate is {total:.1f} GiB; docs/gpu-cluster.md says {figure}"
    assert total < 80


def test_the_bigger_clusters_of_the_page_fit(monkeypatch):
    """Pins: the page's two-worker layout (4 engines, 12 ranks at TP 2) fills 16 GPUs and fits; a 4-GPU worker is
    32 CPUs. Guards: a scale-out recipe that the placement check refuses."""
    monkeypatch.setenv(TOKEN, "x")
    prose = " ".join(DOC.split())
    assert "`MILES_RAY_GPU_WORKERS=2`" in prose and "`--actor-num-nodes 2 --actor-num-gpus-per-node 6`" in prose
    flags = ("--hf-checkpoint s3://b/m --engine-backend sglang --rollout-num-engines 4 --actor-num-nodes 2 "
             "--actor-num-gpus-per-node 6 --tensor-model-parallel-size 2 --prompt-data s3://b/d.jsonl "
             "--rollout-batch-size 32 --n-samples-per-prompt 8 --num-rollout 100")
    cfg = parse_flags(shlex.split(flags))
    assert sum(b.gpus for b in demand(cfg)) == 16
    validate(cfg, cluster=train_cluster(2, 8))
    assert "`MILES_RAY_GPUS_PER_WORKER=4` (32 CPUs and 256 GiB per worker pod)" in prose
    assert train_cluster(1, 4).nodes[1].cpus == 32
