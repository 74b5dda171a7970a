"""The import graph of a package, read from its source with `ast` (nothing is imported).

    graph = ImportGraph.of(Path("miles_core"))
    graph.module_cycles()        # [[mod, mod, ...], ...]: modules that import each other
    graph.part_cycles()          # the same between the package's top-level parts
    graph.hidden()               # (module, target) dependencies that exist only inside functions
    graph.part_edges()           # {(part, part)}: which top-level part imports which

The same reading as the layering figures quoted in docs/architecture.md: an import names the module
it resolves to (a package's `__init__` when the name is the package), imports inside functions
count, and `from pkg import mod` counts both the package and the module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, modname: str, is_pkg: bool) -> list[tuple[str, bool]]:
    """(imported name, inside a function?) for every import statement."""
    out: list[tuple[str, bool]] = []

    def visit(node, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, fn) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = modname.split(".") if is_pkg else modname.split(".")[:-1]
                    pkg = pkg[: len(pkg) - child.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                out.append((base, fn))
                out.extend((f"{base}.{a.name}", fn) for a in child.names)
            visit(child, fn)

    visit(tree, False)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@dataclass
class ImportGraph:
    package: str
    modules: set[str]
    top_level: set[tuple[str, str]] = field(default_factory=set)
    in_functions: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def of(cls, package_dir: Path) -> "ImportGraph":
        root = package_dir.resolve()
        files = {module_name(root, p): p for p in root.rglob("*.py")}
        graph = cls(root.name, set(files))
        for name, path in files.items():
            for target, in_fn in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith(root.name):
                    (graph.in_functions if in_fn else graph.top_level).add((name, target))
        return graph

    def edges(self) -> set[tuple[str, str]]:
        return self.top_level | self.in_functions

    def hidden(self) -> set[tuple[str, str]]:
        return self.in_functions - self.top_level

    def module_cycles(self) -> list[list[str]]:
        graph: dict[str, set[str]] = {}
        for a, b in self.edges():
            graph.setdefault(a, set()).add(b)
        return _cycles(graph)

    def part_edges(self) -> set[tuple[str, str]]:
        """(part, part) for every import between two top-level parts (`pkg.part`), the root excluded."""
        out = set()
        for a, b in self.edges():
            pa, pb = a.split(".")[:2], b.split(".")[:2]
            if len(pa) > 1 and len(pb) > 1 and pa != pb:
                out.add((pa[1], pb[1]))
        return out

    def part_cycles(self) -> list[list[str]]:
        graph: dict[str, set[str]] = {}
        for a, b in self.part_edges():
            graph.setdefault(a, set()).add(b)
        return _cycles(graph)

    def parts(self) -> set[str]:
        return {m.split(".")[1] for m in self.modules if "." in m}
