"""Generated references in docs/reference/: the flag and metric tables come from the code,
and so does the list of layers in docs/architecture.md (between its `layers` markers; docs/architecture.md).

    python -m miles_core.cli.docs_gen            # rewrite docs/reference/*.md and the layers section
    python -m miles_core.cli.docs_gen --check    # exit 1 and name the stale files (what the tests do)

Flags come from `miles_core.config.flag_table()`. Metric names come from miles_core.metrics.names,
where every component's names live, listed in METRIC_SOURCES as (module, attribute) pairs. An
attribute is either a mapping {name: meaning} (preferred: the meaning lives beside the name) or a
sequence of names; names may be patterns with `{placeholders}`. A new component's names are one
more mapping in miles_core.metrics.names, one more pair in METRIC_SOURCES and a regeneration.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import miles_core
from miles_core.config import flag_table
from miles_core.config.plugins import PLUGIN_SLOTS

REGENERATE = "python -m miles_core.cli.docs_gen"

# (module, attribute) of every metric-name mapping: one per component, all in miles_core.metrics.names.
# Order is irrelevant: the reference is sorted by name. A name two components log is in both mappings.
NAMES = "miles_core.metrics.names"
METRIC_SOURCES: list[tuple[str, str]] = [
    (NAMES, "BUFFER_METRICS"),       # the buffer, docs/data-path.md
    (NAMES, "ROLLOUT_METRICS"),      # the rollout's batch and producer metrics, docs/metrics.md
    (NAMES, "PERF_METRICS"),         # docs/metrics.md perf/*
    (NAMES, "WEIGHTS_METRICS"),      # weight versions written and read, docs/weight-versions.md
    (NAMES, "RUN_METRICS"),          # the random-policy level, the published version, the fleet
    (NAMES, "PRODUCER_METRICS"),     # who generated each step's batch
    (NAMES, "LOSS_METRICS"),         # the policy loss, docs/fully-async.md
    (NAMES, "TRAIN_STEP_METRICS"),   # trainer step counts and time
    (NAMES, "EVAL_METRICS"),         # docs/evaluation.md
]

# Meanings for names whose source exports names only. A source that exports a mapping wins; an
# entry here for a name no source exports is an error (a stale doc). Empty: every source in
# METRIC_SOURCES is a {name: meaning} mapping (prefer that for a new one too).
FALLBACK_MEANINGS: dict[str, str] = {}


@dataclass(frozen=True)
class Metric:
    name: str
    meaning: str
    sources: tuple[str, ...]  # "module:attribute" of every source that exports the name


class DocsSourceError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def _entries(module: str, attribute: str) -> list[tuple[str, str]]:
    try:
        value = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise DocsSourceError(f"metric source {module}:{attribute} does not resolve ({e!r}); fix METRIC_SOURCES "
                              "in miles_core/cli/docs_gen.py") from e
    if isinstance(value, Mapping):
        return [(str(k), str(v)) for k, v in value.items()]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise DocsSourceError(f"metric source {module}:{attribute} must be a mapping name -> meaning or a "
                              f"sequence of names, got {type(value).__name__}")
    return [(str(name), "") for name in value]


def collect_metrics(sources: list[tuple[str, str]] | None = None,
                    fallback: Mapping[str, str] | None = None) -> list[Metric]:
    """Every exported metric name, sorted, with its meaning and the sources exporting it."""
    sources = METRIC_SOURCES if sources is None else sources
    fallback = FALLBACK_MEANINGS if fallback is None else fallback
    meanings: dict[str, str] = {}
    owners: dict[str, list[str]] = {}
    for module, attribute in sources:
        for name, meaning in _entries(module, attribute):
            owners.setdefault(name, []).append(f"{module}:{attribute}")
            if meaning:
                if meanings.get(name, meaning) != meaning:
                    raise DocsSourceError(f"metric {name!r} has two different meanings in {owners[name]}")
                meanings[name] = meaning
    stale = sorted(set(fallback) - set(owners))
    if stale:
        raise DocsSourceError(f"FALLBACK_MEANINGS lists metrics no source exports (renamed or removed?): {stale}")
    return [Metric(n, meanings.get(n) or fallback.get(n, ""), tuple(owners[n])) for n in sorted(owners)]


# ----------------------------------------------------------------------------- rendering


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "" or value == []:
        return '""' if value == "" else "[]"
    return str(value)


def render_flags() -> str:
    lines = [
        "# Flag reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from miles_core.config.flag_table(); do not edit by hand. -->",
        "",
        "Every field of the run config is one flag: the field name in kebab case. Boolean flags also take",
        "a `--no-` form (`--no-fully-async`); optional values take `none`; list flags take several values",
        "(`--eval-prompt-data a=builtin:reverse4-heldout b=s3://bucket/eval.jsonl`). The same names are the",
        "inputs of the Flyte workflows. `miles validate [FLAGS...]` prints the resolved config or every",
        "problem with it; see [configuration](../configuration.md) for the rules.",
        "",
    ]
    specs = flag_table()
    for section in dict.fromkeys(s.section for s in specs):
        lines += [f"## {section}", "", "| Flag | Type | Default | Choices | Help |", "|---|---|---|---|---|"]
        for s in (s for s in specs if s.section == section):
            kind = s.kind + (" (optional)" if s.optional else "")
            choices = ", ".join(f"`{c}`" for c in s.choices) if s.choices else ""
            lines.append(f"| `{s.flag}` | {kind} | `{_cell(_default(s.default))}` | {choices} | {_cell(s.help)} |")
        lines.append("")
    lines += ["## Plugin slots", "",
              "Every `--*-path` flag takes `module:attr` and is imported and checked by `miles validate`, before",
              "anything starts. The object each one must point at:", "",
              "| Flag | Expected object |", "|---|---|"]
    lines += [f"| `{flag}` | {_cell(contract)} |" for flag, contract in PLUGIN_SLOTS.items()]
    lines.append("")
    return "\n".join(lines)


def render_metrics(metrics: list[Metric] | None = None) -> str:
    metrics = collect_metrics() if metrics is None else metrics
    lines = [
        "# Metric reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the metric-name constants in "
        "miles_core.cli.docs_gen.METRIC_SOURCES; do not edit by hand. -->",
        "",
        "Metric events are appended to `metrics/{component}/{part}.jsonl` in the run root (step, wall time,",
        "name, value). Names are interface: dashboards and `miles report` read them. `{placeholders}` stand",
        "for a dataset name (`{ds}`), a pass@k count (`{k}`), a reason (`{reason}`) or a producer job's id",
        "(`{producer_id}`).",
        "",
    ]
    groups: dict[str, list[Metric]] = {}
    for m in metrics:
        groups.setdefault(m.name.split("/", 1)[0], []).append(m)
    for group, items in groups.items():
        lines += [f"## {group}/", "", "| Metric | Meaning | Exported by |", "|---|---|---|"]
        for m in items:
            owners = ", ".join(f"`{s}`" for s in m.sources)
            lines.append(f"| `{m.name}` | {_cell(m.meaning)} | {owners} |")
        lines.append("")
    return "\n".join(lines)


def render_layers() -> str:
    """The table of `miles_core.LAYERS`, from the ground up (top row first, as a reader meets them)."""
    lines = ["| layer | parts (`miles_core/...`) | what it owns |", "|---|---|---|"]
    for name, parts, owns in reversed(miles_core.LAYERS):
        lines.append(f"| {name} | {', '.join(f'`{p}`' for p in parts)} | {_cell(owns)} |")
    return "\n".join(lines) + "\n"


# Generated file (relative to the repository root) -> renderer.
REFERENCES = {
    "docs/reference/flags.md": render_flags,
    "docs/reference/metrics.md": render_metrics,
}
# Hand-written file -> (marker name, renderer) of the one section generated inside it, between
# `<!-- {name}:begin (generated ...) -->` and `<!-- {name}:end -->`.
SECTIONS = {
    "docs/architecture.md": ("layers", render_layers),
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin (generated by `{REGENERATE}`) -->\n", f"<!-- {name}:end -->"


def with_section(text: str, name: str, body: str) -> str:
    """`text` with the section `name` replaced by `body`; ValueError when its markers are missing."""
    begin, end = _markers(name)
    head, found, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"no `{begin.strip()}` ... `{end}` section")
    return head + begin + body + end + tail


def _current(root: Path, rel: str) -> str | None:
    """What `rel` must hold now (None when the file a section lives in is missing or lacks its markers)."""
    if rel in REFERENCES:
        return REFERENCES[rel]()
    name, render = SECTIONS[rel]
    path = root / rel
    try:
        return with_section(path.read_text(), name, render()) if path.exists() else None
    except ValueError:
        return None


def stale_references(root: Path) -> list[str]:
    """The generated files (and sections) under `root` whose content differs from what the code renders now."""
    stale = []
    for rel in [*REFERENCES, *SECTIONS]:
        path, want = root / rel, _current(root, rel)
        if want is None or not path.exists() or path.read_text() != want:
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_core.cli.docs_gen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a reference is stale")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]), help="repository root")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.check:
        stale = stale_references(root)
        for rel in stale:
            print(f"{rel} is stale; regenerate with `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for rel in [*REFERENCES, *SECTIONS]:
        path, want = root / rel, _current(root, rel)
        if want is None:
            print(f"{rel}: missing, or its generated section has no markers; add them", file=sys.stderr)
            return 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(want)
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
