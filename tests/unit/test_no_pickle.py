"""Nothing read from storage goes through pickle (docs/data-path.md; issue 16 item 7).

Storage holds Arrow IPC (buffer, prompts), JSON (manifests, configs, metrics), safetensors and
safetensors + JSON trees (checkpoints, snapshots). This scans every code path that could read it,
the product's modules, tasks and workflows, for the ways Python deserialises with pickle: the
pickle family of modules, `torch.load` without `weights_only=True`, `numpy.load(allow_pickle=True)`,
`pandas.read_pickle`. And a Flyte task whose input or output type flytekit cannot map falls back to
FlytePickle, which pickles through the blob store: every task interface is checked for that too.
(Ray pickles actor arguments between processes of one cluster; that is transport, not storage.)
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("miles_core", "tasks", "workflows", "images")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}


def _sources():
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _violations(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, ast.unparse(node.func.value)
            if attr == "load" and owner == "torch" and not _is_true(_kw(node, "weights_only")):
                found.append("torch.load without weights_only=True")
            elif attr == "load" and owner in ("np", "numpy") and _is_true(_kw(node, "allow_pickle")):
                found.append("numpy.load(allow_pickle=True)")
            elif attr == "read_pickle":
                found.append(f"{owner}.read_pickle")
    return found


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_on_any_code_path(path):
    found = _violations(ast.parse(path.read_text(), filename=str(path)))
    assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_the_scan_catches_what_it_looks_for():
    bad = ("import pickle\nfrom cloudpickle import loads\nimport torch\ntorch.load(f)\n"
           "np.load(f, allow_pickle=True)\npd.read_pickle(f)\n")
    assert len(_violations(ast.parse(bad))) == 5
    assert _violations(ast.parse("torch.load(f, weights_only=True)\nnp.load(f)\n")) == []


def _flyte_entities():
    from flytekit.core.base_task import PythonTask
    from flytekit.core.workflow import WorkflowBase

    for path in _sources():
        if path.parts[-2] not in ("tasks", "workflows") or path.name == "__init__.py":
            continue
        module = importlib.import_module(f"{path.parts[-2]}.{path.stem}")
        for value in vars(module).values():
            if isinstance(value, (PythonTask, WorkflowBase)) and value.__module__ == module.__name__:
                yield value


def test_no_flyte_interface_falls_back_to_pickle():
    from flytekit.core.type_engine import TypeEngine
    from flytekit.types.pickle.pickle import FlytePickleTransformer

    entities = list(_flyte_entities())
    assert len(entities) >= 10, [e.name for e in entities]
    pickled = []
    for entity in entities:
        iface = entity.python_interface
        for name, t in {**iface.inputs, **iface.outputs}.items():
            if isinstance(TypeEngine.get_transformer(t), FlytePickleTransformer):
                pickled.append(f"{entity.name}.{name}: {t}")
    assert not pickled, f"these would be pickled through the blob store: {pickled}"
