"""Waits are on conditions, and timeouts are named constants (tests/support/timeouts.py).

Pins: in the unit, integration, end-to-end, chaos, bad-input and support code, no call passes a numeric
literal as a timeout keyword (`timeout`, `timeout_s`, `timeout_seconds`, or a name ending in one of
them such as `startup_timeout_seconds`), and no function takes one as the default of such a parameter.
The bound is a named constant: shared in tests/support/timeouts.py, or the module's own with a comment.

Guards: ~140 bare numbers that said neither what they bounded nor whether two of them meant the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRS = ("tests/unit", "tests/integration", "tests/e2e", "tests/chaos", "tests/support", "tests/bad_inputs")
SOURCES = {p.relative_to(ROOT).as_posix(): p.read_text() for d in DIRS for p in sorted((ROOT / d).rglob("*.py"))}
SUFFIXES = ("timeout", "timeout_s", "timeout_seconds")


def _is_timeout(name: str | None) -> bool:
    return name is not None and name.endswith(SUFFIXES)


def _is_number(node: ast.AST) -> bool:
    """A numeric literal, or arithmetic of numeric literals only (`-1`, `2 * 60`)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    return False


def literal_timeouts(source: str) -> list[str]:
    """`line N: name=value` for each timeout keyword or parameter default given as a bare number."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            found += [f"line {k.value.lineno}: {k.arg}={ast.unparse(k.value)}" for k in node.keywords
                      if _is_timeout(k.arg) and _is_number(k.value)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            pairs = list(zip(a.posonlyargs + a.args[len(a.posonlyargs + a.args) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            found += [f"line {d.lineno}: {arg.arg}={ast.unparse(d)}" for arg, d in pairs
                      if _is_timeout(arg.arg) and _is_number(d)]
    return sorted(found, key=lambda s: int(s.split(":")[0].split()[1]))


def test_the_test_directories_are_read():
    assert "tests/support/timeouts.py" in SOURCES and any(p.startswith("tests/integration/") for p in SOURCES)


def test_no_timeout_is_a_bare_number():
    found = {path: hits for path, source in SOURCES.items() if (hits := literal_timeouts(source))}
    assert found == {}, "name these bounds (tests/support/timeouts.py, or a module constant with a comment)"


def test_the_structural_check_finds_bare_timeouts():
    source = ("def f(url, proc, timeout=10.0, *, join_timeout: float = 2 * 60):\n"
              "    urlopen(url, timeout=5)\n"
              "    proc.wait(timeout=-1)\n"
              "    Server(startup_timeout_seconds=120, health_check_timeout=0.3)\n"
              "    run(cmd, timeout=RUN_SECONDS, timeout_s=LIMIT * 2, retries=3)\n")
    assert literal_timeouts(source) == ["line 1: timeout=10.0", "line 1: join_timeout=2 * 60", "line 2: timeout=5",
                                        "line 3: timeout=-1", "line 4: startup_timeout_seconds=120",
                                        "line 4: health_check_timeout=0.3"]
