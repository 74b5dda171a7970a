"""docs/errors.md lists every user-facing error class of miles_core.

The rule: an error class is every class defined in a module under miles_core/ whose bases lead (through
other such classes) to a Python exception, found by reading the source (no imports). Every one is
user-facing, so it has a `### ClassName` section in docs/errors.md, unless INTERNAL names it with the
reason it never reaches a user (it is private, always converted into another class before it leaves
its module, recorded as a metric, or never raised). A new error class therefore fails this test until
it is documented or listed here.
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"

INTERNAL = {
    "_RowError": "private to prepare/dataset.py: every bad row is collected into one DatasetError",
    "_AttemptFailed": "private to weights/distributed.py: a failed push attempt is retried, then WeightPushError",
    "_LocalBaseFailed": "private to storage/weight_versions.py: the part is rebuilt from its anchor instead",
    "PresetError": "parse_flags turns it into a ConfigError",
    "MissingWeights": "every caller converts it: ModelLoadError, ConversionError or ModelImportError",
    "EvalSkip": "an eval that did not happen is recorded as eval/skipped_{reason}, never raised out of a task",
    "EvalAborted": "recorded as eval/skipped_crashed like EvalSkip, never raised out of a task",
    "SnapshotError": "defined in weights/snapshot.py but never raised",
    "DocsSourceError": "raised only by the contributors' reference generator (python -m miles_core.cli.docs_gen)",
    "ParserExit": "control flow of the CLI's parsers: ends a command after --help with its status, never printed",
    "BadManifest": "buffer/manifests.py: readers skip and name the manifest, or turn it into a LineageError",
}


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]


def _builtin_exception(name: str) -> bool:
    value = getattr(builtins, name, None)
    return isinstance(value, type) and issubclass(value, BaseException)


@functools.lru_cache(maxsize=None)
def error_classes(root: Path = ROOT / "miles_core") -> dict[str, str]:
    """{class name: defining file} of every exception class defined under `root`, by the rule above."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (str(path.relative_to(ROOT)), _base_names(node))
    found: dict[str, str] = {}
    while True:
        new = {name: where for name, (where, bases) in classes.items() if name not in found
               and any(_builtin_exception(b) or b in found for b in bases)}
        if not new:
            return found
        found.update(new)


def documented(text: str) -> set[str]:
    return set(re.findall(r"^### (\w+)\s*$", text, re.M))


def undocumented(text: str) -> list[str]:
    return sorted(set(error_classes()) - set(INTERNAL) - documented(text))


def test_every_user_facing_error_class_has_a_section():
    """Pins: each error class of miles_core that is not INTERNAL has a `### Name` section in docs/errors.md.
    Guards: a new error a user can meet with no word on what it means or what to do."""
    missing = undocumented(DOC.read_text())
    assert not missing, f"add a `### Name` section to docs/errors.md (or to INTERNAL, with why): {missing}"


def test_a_missing_section_is_caught():
    """Pins: the check fails for a page without LeaseHeld's section. Guards: a check that passes on anything."""
    text = DOC.read_text().replace("### LeaseHeld\n", "")
    assert undocumented(text) == ["LeaseHeld"]


def test_the_rule_follows_bases_through_the_project():
    """Pins: subclasses of project errors count (ModelImportError < ModelSourceError < ValueError; BufferTimeout <
    DataBufferError, TimeoutError), and non-exceptions do not. Guards: a scan that sees direct subclasses only."""
    found = dict(error_classes())
    assert {"ModelImportError", "BufferTimeout", "ObjectNotFound", "EngineUnavailableError", "LeaseHeld"} <= set(found)
    assert found["ModelImportError"] == "miles_core/prepare/model_import.py"
    assert not {"Store", "RunConfig", "Sample", "DurableBuffer"} & set(found)


def test_internal_entries_are_current_and_undocumented_sections_exist():
    """Pins: every INTERNAL name is still an error class, and every section of docs/errors.md names one that is
    not internal. Guards: a stale exemption hiding a renamed class, and a page describing a class that is gone."""
    found, sections = set(error_classes()), documented(DOC.read_text())
    assert set(INTERNAL) <= found, sorted(set(INTERNAL) - found)
    assert all(INTERNAL.values())
    assert sections <= found - set(INTERNAL), sorted(sections - (found - set(INTERNAL)))


def test_the_page_states_the_exit_code_rule():
    """Pins: docs/errors.md gives the CLI's exit codes: 0 ok, 1 runtime failure, 2 usage or configuration.
    Guards: the rule documented nowhere (or dropped from the page)."""
    rows = dict(re.findall(r"^\| ([012]) \| (.+?) \|$", DOC.read_text(), re.M))
    assert set(rows) == {"0", "1", "2"}
    assert "runtime failure" in rows["1"] and "usage or configuration" in rows["2"]
