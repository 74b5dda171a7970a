"""docs/models.md's memory table is the estimate's (miles_core.prepare.memory), recomputed here.

Pins: every row of the page's table (Qwen3-8B and Qwen3-30B-A3B, their published config.json in
tests/support/model_configs/, on 8 x 80 GB with the page's common flags plus the row's) has the
estimate's weights, gradients, optimizer state, activations, logits and total per GPU (GiB, two
decimals) and its verdict against 80 GiB (`memory_fit`: fits, warns, refused); every builtin tiny
model and every family is on the page. Guards: a page that drifts from the estimate it quotes.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from miles_core.config import parse_flags
from miles_core.config.rules import BUILTIN_MODELS
from miles_core.models.families import FAMILIES
from miles_core.prepare.memory import GIB, estimate, memory_fit

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "models.md").read_text()
CONFIGS = {"Qwen3-8B": "qwen3-8b.json", "Qwen3-30B-A3B": "qwen3-30b-a3b.json"}
GPU_GB = 80


def hf_config(model: str) -> dict:
    return json.loads((ROOT / "tests" / "support" / "model_configs" / CONFIGS[model]).read_text())


def common_flags() -> list[str]:
    return shlex.split(re.search(r"^Common flags: `([^`]*)`", DOC, re.M).group(1))


def table_rows() -> list[list[str]]:
    """The memory table's rows as cells (model, flags, weights ... total, verdict)."""
    table = DOC[DOC.index("| model | flags |"):].split("\n\n")[0].splitlines()[2:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]


def computed(model: str, flags: list[str]) -> list[str]:
    """A row's figures and verdict, as the page writes them."""
    cfg = parse_flags(["--preset", "tiny-reverse4", *common_flags(), *flags], check=False)
    est = estimate(hf_config(model), cfg)
    problems, warnings = memory_fit(hf_config(model), cfg, GPU_GB, f"--gpu-memory-gb is {GPU_GB}")
    verdict = "refused" if problems else "warns" if warnings else "fits"
    figures = [est.weights, est.grads, est.optimizer, est.activations, est.logits, est.total]
    return [f"{x / GIB:.2f}" for x in figures] + [verdict]


def test_the_table_has_both_models_and_every_verdict():
    rows = table_rows()
    assert {r[0] for r in rows} == set(CONFIGS) and len(rows) >= 6
    assert {"fits", "refused"} <= {r[-1] for r in rows} <= {"fits", "warns", "refused"}


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: f"{r[0]} {r[1]}")
def test_each_row_is_the_estimate(row):
    model, flags = row[0], shlex.split(row[1].strip("`")) if row[1] != "(none)" else []
    assert row[2:] == computed(model, flags), f"docs/models.md row {row[:2]}: the estimate gives {computed(model, flags)}"


def test_every_family_and_builtin_model_is_on_the_page():
    for name in (*FAMILIES, *BUILTIN_MODELS):
        assert f"`{name}`" in DOC, name
