"""The generated references in docs/reference/ cannot drift from the code (docs/architecture.md, STYLE e).

If a test here fails after you changed a flag, a help text or a metric name, regenerate with
`python -m miles_core.cli.docs_gen` and commit docs/reference/ together with the code change.
"""

from __future__ import annotations

import difflib
import json
import sys
import types
from pathlib import Path

import pytest

from bench import figures
from miles_core.cli import docs_gen
from miles_core.config import flag_table
from miles_core.config.rules import BUILTIN_DATASETS, BUILTIN_MODELS
from miles_core.eval.datasets import BUILTIN_REWARD_TASKS
from miles_core.models.source import PACKAGED

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rel", sorted(docs_gen.REFERENCES))
def test_committed_reference_matches_code(rel):
    """Pins: the committed docs/reference/*.md equal what the code renders now.
    Guards: hand-edited or forgotten references (slime's catalogue missing 3 of 24 `--*-path` flags)."""
    path = ROOT / rel
    assert path.exists(), f"{rel} missing; generate it with `{docs_gen.REGENERATE}`"
    want, have = docs_gen.REFERENCES[rel](), path.read_text()
    if have != want:
        diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), rel, "generated", n=1))
        pytest.fail(f"{rel} is stale; regenerate with `{docs_gen.REGENERATE}`.\n{diff[:3000]}")


def test_flag_reference_lists_every_flag_once():
    """Pins: every flag of flag_table() appears in the flag table exactly once, with its section, and every
    plugin slot's contract is listed. Guards: a renderer that drops flags (e.g. of a newly added section)."""
    text, plugins = docs_gen.render_flags().split("## Plugin slots")
    for flag in docs_gen.PLUGIN_SLOTS:
        assert f"| `{flag}` |" in plugins
    for s in flag_table():
        assert text.count(f"| `{s.flag}` |") == 1, s.flag
        assert f"## {s.section}" in text


def test_flag_rows_escape_pipes():
    """Pins: help text with '|' does not break the markdown table. Guards: a help string splitting a row."""
    assert docs_gen._cell("a | b\nc") == "a \\| b c"


def test_check_mode_names_stale_files(tmp_path, capsys):
    """Pins: `python -m miles_core.cli.docs_gen --check` exits 1 naming each stale file and the command to fix
    it (a generated section inside a hand-written page too); after regeneration it exits 0. Guards: a CI check
    that fails without telling how to fix it."""
    for rel, (name, _) in docs_gen.SECTIONS.items():  # the hand-written page, its generated section emptied
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(docs_gen.with_section((ROOT / rel).read_text(), name, ""))
    assert docs_gen.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "docs/reference/flags.md is stale" in err and docs_gen.REGENERATE in err
    assert "docs/architecture.md is stale" in err
    assert docs_gen.main(["--root", str(tmp_path)]) == 0
    assert docs_gen.main(["--check", "--root", str(tmp_path)]) == 0


def test_every_metric_source_resolves_and_design_names_present():
    """Pins: every registered (module, attribute) source imports, and the names docs/fully-async.md define are exported by some source. Guards: a renamed constant or a metric dropped from the code."""
    names = {m.name for m in docs_gen.collect_metrics()}
    design = {
        "rollout/fully_async/queue_size", "rollout/fully_async/aborted_groups_filtered",
        "rollout/fully_async/stale_groups_filtered", "rollout/fully_async/avg_staleness",
        "rollout/fully_async/max_staleness", "rollout/fully_async/buffer_avg_staleness",
        "rollout/fully_async/buffer_max_staleness", "rollout/fully_async/put_seconds",
        "rollout/fully_async/bytes_written", "rollout/fully_async/quarantined",
        "rollout/dynamic_filter/drop_{reason}",
        "rollout/reward/mean", "rollout/response_len/mean", "rollout/response_len/max", "rollout/truncated_ratio",
        "rollout/zero_std/ratio", "rollout/weight_version/mean", "rollout/weight_version/min",
        "rollout/weight_version/max", "rollout/weight_version/mixed_version_ratio",
        "perf/tokens_per_second", "perf/train_wait_seconds", "perf/producer_blocked_seconds",
        "perf/weight_update_seconds", "perf/step_seconds",
        "train/tis_mean", "train/tis_clipfrac", "train/ppo_kl", "train/pg_clipfrac",
        "train/train_rollout_logprob_abs_diff", "train/grad_norm", "train/entropy", "train/loss",
        "eval/{ds}", "eval/{ds}/pass@{k}", "eval/{ds}/truncated_ratio", "eval/{ds}/response_len/mean",
        "eval/lag_steps", "eval/duration_seconds", "eval/export_seconds", "eval/skipped_{reason}",
    }
    assert not design - names, f"missing from every metric source: {sorted(design - names)}"
    undocumented = [m.name for m in docs_gen.collect_metrics() if not m.meaning]
    assert not undocumented, f"metrics without a meaning (export a {{name: meaning}} mapping): {undocumented}"


@pytest.fixture
def fake_sources(monkeypatch):
    """Registers two in-memory modules as metric sources (how the lead adds a new component)."""
    a = types.ModuleType("miles_test_metrics_a")
    a.NAMES = {"x/b": "meaning of b", "x/a": "meaning of a"}
    b = types.ModuleType("miles_test_metrics_b")
    b.NAMES = ("x/a", "y/c")
    b.CONFLICT = {"x/a": "another meaning"}
    b.BAD = 3
    monkeypatch.setitem(sys.modules, a.__name__, a)
    monkeypatch.setitem(sys.modules, b.__name__, b)
    return [(a.__name__, "NAMES"), (b.__name__, "NAMES")]


def test_metric_sources_merge_mappings_and_sequences(fake_sources):
    """Pins: a source may export {name: meaning} or a sequence of names; a name exported by several sources
    is listed once with every source; output is sorted and grouped by the first path component.
    Guards: duplicate rows or lost meanings when two components log the same metric."""
    metrics = docs_gen.collect_metrics(fake_sources, fallback={"y/c": "fallback c"})
    assert [(m.name, m.meaning, len(m.sources)) for m in metrics] == [
        ("x/a", "meaning of a", 2), ("x/b", "meaning of b", 1), ("y/c", "fallback c", 1)]
    text = docs_gen.render_metrics(metrics)
    assert text.index("## x/") < text.index("## y/") and text.count("`x/a`") == 1


def test_metric_source_errors(fake_sources):
    """Pins: an unresolvable source, a wrong type, conflicting meanings and a fallback meaning for a name
    no source exports are each a DocsSourceError naming the culprit.
    Guards: a reference that silently omits a renamed or removed metric."""
    mod_b = fake_sources[1][0]
    with pytest.raises(docs_gen.DocsSourceError, match="no_such_module_xyz:NAMES"):
        docs_gen.collect_metrics([("no_such_module_xyz", "NAMES")], fallback={})
    with pytest.raises(docs_gen.DocsSourceError, match=f"{mod_b}:MISSING"):
        docs_gen.collect_metrics([(mod_b, "MISSING")], fallback={})
    with pytest.raises(docs_gen.DocsSourceError, match="mapping"):
        docs_gen.collect_metrics([(mod_b, "BAD")], fallback={})
    with pytest.raises(docs_gen.DocsSourceError, match="two different meanings"):
        docs_gen.collect_metrics(fake_sources + [(mod_b, "CONFLICT")], fallback={})
    with pytest.raises(docs_gen.DocsSourceError, match="renamed or removed"):
        docs_gen.collect_metrics(fake_sources, fallback={"gone/metric": "x"})


def test_user_docs_exist_and_link_references():
    """Pins: the quickstart and configuration guides exist and point at the generated flag reference.
    Guards: README links to docs that were never written."""
    for rel in ("docs/quickstart.md", "docs/configuration.md"):
        assert (ROOT / rel).exists(), rel
    assert "reference/flags.md" in (ROOT / "docs/configuration.md").read_text()


def _doc_sessions(rel: str) -> list[tuple[list[str], list[str]]]:
    """(argv after `miles`, expected stderr lines) of every `$ miles ...` session in a doc's code blocks."""
    sessions, current = [], None
    for line in (ROOT / rel).read_text().splitlines():
        if line.startswith("$ miles "):
            current = (line[len("$ miles "):].split(), [])
            sessions.append(current)
        elif line.startswith("```"):
            current = None
        elif current is not None:
            current[1].append(line)
    return sessions


def test_configuration_examples_match_cli(capsys):
    """Pins: each `$ miles validate ...` example in docs/configuration.md prints exactly the lines shown.
    Guards: error messages reworded in the code while the guide keeps quoting the old text."""
    from miles_core.cli import main

    sessions = _doc_sessions("docs/configuration.md")
    assert len(sessions) >= 2
    for argv, expected in sessions:
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines() == expected, " ".join(argv)


def test_benchmark_figures_match_the_results_files():
    """Pins: every figure section of docs/benchmarks.md is what bench/figures.py renders from the committed
    bench/results/*.json. Guards: a figure edited by hand, or a bench rerun without updating the page."""
    stale = figures.stale_sections(ROOT)
    assert not stale, f"stale figures of {stale} (docs/benchmarks.md, docs/quickstart.md); regenerate with `{figures.REGENERATE}`"


def test_benchmark_figures_follow_a_new_results_file(tmp_path):
    """Pins: a changed results file makes its section stale (--check exits 1), and regenerating puts the
    new figure on the page and nothing else changes. Guards: a page that silently keeps old figures."""
    (tmp_path / "docs").mkdir()
    for page in {figures.PAGE, *figures.PAGES.values()}:
        (tmp_path / page).write_text((ROOT / page).read_text())
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    for path in (ROOT / "bench" / "results").glob("*.json"):
        (results / path.name).write_text(path.read_text())
    engine = json.loads((results / "engine.json").read_text())
    engine["rows"][0]["useful_tokens"] = 123457
    (results / "engine.json").write_text(json.dumps(engine))
    assert figures.stale_sections(tmp_path) == ["engine"]
    assert figures.main(["--check", "--root", str(tmp_path)]) == 1
    assert figures.main(["--root", str(tmp_path)]) == 0
    assert figures.stale_sections(tmp_path) == [] and "123,457" in (tmp_path / figures.PAGE).read_text()


def test_docs_list_every_builtin():
    """Pins: the configuration guide names every builtin dataset and model and every packaged model that
    validation accepts, and the evaluation guide every builtin reward task. Guards: stale lists."""
    config = (ROOT / "docs/configuration.md").read_text()
    names = (*BUILTIN_DATASETS, *BUILTIN_MODELS, *(f"import:{k}" for k in PACKAGED))
    missing = [n for n in names if f"`{n}`" not in config]
    assert not missing, f"docs/configuration.md does not list {missing}"
    evaluation = (ROOT / "docs/evaluation.md").read_text()
    assert not [t for t in BUILTIN_REWARD_TASKS if f"`{t}`" not in evaluation]


def test_user_docs_stand_alone():
    """Pins: no user doc (docs/, docs/reference/, README.md) cites the design notes or a path outside the
    repository. Guards: "see DESIGN §5" in a page whose reader has only the repository."""
    outside = ("DESIGN", "§", "../shared", "/work/shared")
    pages = [*sorted(ROOT.glob("docs/**/*.md")), ROOT / "README.md"]
    cited = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in pages
             for n, line in enumerate(p.read_text().splitlines(), 1) if any(o in line for o in outside)]
    assert not cited, "\n".join(cited)


def test_the_code_cites_pages_a_reader_has():
    """Pins: no product file (miles_core/, tasks/, workflows/, images/, bench/, dev) cites the design
    notes ("DESIGN §5.2", a bare "§5.2"), which are not in the repository: it links a page in docs/.
    Guards: 91 such references a reader of the code could not follow."""
    files = [p for d in ("miles_core", "tasks", "workflows", "images", "bench") for p in sorted((ROOT / d).rglob("*.py"))]
    files.append(ROOT / "dev")
    cited = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN" in line or "§" in line]
    assert not cited, "\n".join(cited[:20])
