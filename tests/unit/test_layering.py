"""The package's imports run one way (docs/architecture.md): no module cycles, no cycles between the
top-level parts, no import up a layer of `miles_core.LAYERS`, every part in a layer, and few imports
hidden inside functions.

Guards: the tangle this replaced (3 module cycles, a cycle of ten parts, 108 dependencies that existed
only inside functions, 12 loose modules at the root), which grew one convenient import at a time
because nothing measured it.
"""

from __future__ import annotations

from pathlib import Path

import miles_core
from tests.support.import_graph import ImportGraph

PACKAGE = Path(miles_core.__file__).resolve().parent
MAX_HIDDEN = 30  # imports inside functions: only where they keep torch, Megatron or Ray from a caller
MAX_ROOT_MODULES = 3

GRAPH = ImportGraph.of(PACKAGE)
LAYER_OF = {part: i for i, (_, parts, _) in enumerate(miles_core.LAYERS) for part in parts}


def test_no_module_cycles():
    assert GRAPH.module_cycles() == []


def test_no_cycles_between_parts():
    assert GRAPH.part_cycles() == []


def test_every_part_is_in_one_layer_and_every_layer_part_exists():
    """Pins: LAYERS names exactly the parts at the package root, each once (a new package or a loose
    module must be placed in a layer before it lands)."""
    named = [p for _, parts, _ in miles_core.LAYERS for p in parts]
    assert len(named) == len(set(named)), "a part is named in two layers"
    assert set(named) == GRAPH.parts()


def test_imports_never_go_up_a_layer():
    up = sorted(f"{a} ({miles_core.LAYERS[LAYER_OF[a]][0]}) imports {b} ({miles_core.LAYERS[LAYER_OF[b]][0]})"
                for a, b in GRAPH.part_edges() if LAYER_OF[b] > LAYER_OF[a])
    assert up == []


def test_root_holds_packages_and_few_modules():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_ROOT_MODULES, modules


def test_few_dependencies_only_inside_functions():
    hidden = sorted(GRAPH.hidden())
    assert len(hidden) <= MAX_HIDDEN, "\n".join(f"{a} -> {b}" for a, b in hidden)


def test_the_graph_reader_sees_cycles_and_hidden_imports(tmp_path):
    """The checks above can fail: a package with a cycle between parts, made only inside a function."""
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from pkg.b import y\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from pkg.a.x import thing\n")
    g = ImportGraph.of(pkg)
    assert g.module_cycles() == [["pkg.a.x", "pkg.b.y"]]
    assert g.part_cycles() == [["a", "b"]]
    assert g.hidden() == {("pkg.b.y", "pkg.a.x")}
    assert g.part_edges() == {("a", "b"), ("b", "a")}
