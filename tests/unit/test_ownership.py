"""Who owns what, held in the source (docs/architecture.md, "The driver is the only switchboard" and
"Who owns what"), in the spirit of the layering test.

Pins: no role is called by a string name (`x.call("method", ...)`, `getattr(actor, name).remote(...)`)
and no driver module is a `__getattr__` proxy; the weight version is assigned only by its owner and by
the parts the table says are told it; engine liveness is asked of the fleet alone; the driver package
starts no thread but the Prometheus HTTP server's; what the redesign removed stays removed.

Guards: the runtime this replaced (30 string-named calls behind two layers of proxies, nine holders of
the weight version kept in step by hand, two owners of engine liveness, a polling thread per duty).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import miles_core
import miles_core.config

PACKAGE = Path(miles_core.__file__).resolve().parent
ROOT = PACKAGE.parent
DOC = ROOT / "docs" / "architecture.md"
SOURCES = {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
VERSION_ATTRS = {"version", "weight_version", "exported", "delivered", "_version"}
DRIVER_THREADS_ALLOWED = {"miles_core/driver/prometheus.py"}  # the HTTP server's own


def ownership_table() -> dict[str, tuple[set[str], set[str]]]:
    """fact -> (owner modules, told modules), from the table in docs/architecture.md."""
    text = DOC.read_text()
    section = text[text.index("### Who owns what"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("Fact", "---"):
            continue
        paths = [set(re.findall(r"`(miles_core/[\w/]+\.py)`", c)) for c in cells[1:]]
        rows[cells[0]] = (paths[0], paths[1])
    return rows


def _string_named_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append(f"line {node.lineno}: .call({node.args[0].value!r})")
        if (isinstance(node, ast.Attribute) and node.attr in ("remote", "options") and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "getattr"):
            found.append(f"line {node.lineno}: getattr(...).{node.attr}")
    return found


def test_no_role_is_called_by_a_string_name():
    found = {path: calls for path, tree in SOURCES.items() if (calls := _string_named_calls(tree))}
    assert found == {}


def test_the_structural_check_finds_a_string_named_call():
    tree = ast.parse("def f(h, a):\n    h.call('push_weights', 1).result()\n    getattr(a, 'x').remote()\n")
    assert len(_string_named_calls(tree)) == 2


def test_no_driver_module_is_a_proxy():
    proxies = [path for path, tree in SOURCES.items() if path.startswith("miles_core/driver/")
               for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert proxies == []


def _annotations(fn: ast.AST) -> dict[str, str]:
    args = fn.args.args + fn.args.kwonlyargs if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
    return {a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in args}


def _version_assignments(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of every `self.<version attribute> = value` that stores a number, not a reference
    to the owner (a parameter annotated `WeightVersion`)."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        owner_refs = {name for name, ann in _annotations(fn).items() if ann.endswith("WeightVersion")}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += list(zip(target.elts, node.value.elts))
                    elif isinstance(target, ast.Tuple):
                        pairs += [(t, node.value) for t in target.elts]
                    else:
                        pairs.append((target, node.value))
            elif isinstance(node, ast.AugAssign):
                pairs = [(node.target, node.value)]
            else:
                continue
            for target, value in pairs:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self" and target.attr in VERSION_ATTRS
                        and not (isinstance(value, ast.Name) and value.id in owner_refs)):
                    out.append((node.lineno, target.attr))
    return out


def test_the_weight_version_is_assigned_only_by_its_owner_and_those_told():
    owners, told = ownership_table()["the weight version"]
    assert owners == {"miles_core/driver/pushes.py"}
    holders = {path: found for path, tree in SOURCES.items() if (found := _version_assignments(tree))}
    outside = {path: found for path, found in holders.items() if path not in owners | told
               and path != "miles_core/storage/lease.py"}  # the lease object's version: another fact
    assert outside == {}, f"the weight version stored outside its owner: {outside}"


def test_the_version_check_sees_a_copy_kept_in_step_and_accepts_a_reference_to_the_owner():
    copy = ast.parse("class R:\n    def set(self, v: int):\n        self.version = v\n")
    ref = ast.parse("class R:\n    def __init__(self, version: WeightVersion):\n        self.a, self.version = 1, version\n")
    assert _version_assignments(copy) == [(3, "version")] and _version_assignments(ref) == []


def test_only_the_weight_pusher_sets_the_owner_s_fields():
    setters = set()
    for path, tree in SOURCES.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if (isinstance(el, ast.Attribute) and el.attr in ("exported", "delivered", "delivering",
                                                                       "delivered_snapshot")
                            and isinstance(el.value, ast.Attribute) and el.value.attr == "version"):
                        setters.add(path)
    assert setters == {"miles_core/driver/pushes.py"}


def test_engine_liveness_is_asked_of_the_fleet_alone():
    owners, _ = ownership_table()["engine liveness"]
    askers = {path for path, tree in SOURCES.items() for node in ast.walk(tree)
              if isinstance(node, ast.Call) and (
                  (isinstance(node.func, ast.Name) and node.func.id == "lost_actors")
                  or (isinstance(node.func, ast.Attribute) and node.func.attr in ("lost", "lost_actors")))}
    assert askers <= owners | {"miles_core/engines/launcher.py"}  # the fleet's own helper


def test_the_driver_starts_no_thread_of_its_own():
    threads = {path for path, tree in SOURCES.items() if path.startswith("miles_core/driver/")
               for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "Thread"}
    threads -= {"miles_core/driver/clients.py"}  # RolloutClient.in_process: benchmarks and tests, not a run
    assert threads <= DRIVER_THREADS_ALLOWED


def test_what_the_redesign_removed_stays_removed():
    names = ("version_box", "check_delivery", "WATCH_SECONDS", "publish_version", "staged_weights",
             "_drop_lost_engines", "set_rollout")
    text = {path: ast.unparse(tree) for path, tree in SOURCES.items()}
    assert {n: [p for p, t in text.items() if re.search(rf"\b{n}\b", t)] for n in names} == {n: [] for n in names}


def test_the_table_names_files_that_exist():
    for fact, (owners, told) in ownership_table().items():
        assert owners, fact
        for path in owners | told:
            assert (ROOT / path).is_file(), (fact, path)


def test_the_rollout_side_is_built_once_and_nothing_is_wired_into_a_producer_afterwards():
    """One builder (miles_core/rollout/assembly.py) for the trainer's cluster and for producer jobs;
    a producer's sink and gates are given at construction, never assigned or appended later."""
    later = []
    for path, tree in SOURCES.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in ("sink", "gates") and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    later.append(f"{path}: {ast.unparse(t)} = ...")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "gates"):
                later.append(f"{path}: {ast.unparse(node)}")
    assert later == []
    builders = {path for path, tree in SOURCES.items() for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("DataSource", "PromptClaims", "make_producer")}
    assert builders == {"miles_core/rollout/assembly.py"}, builders


SECTIONS = {f.name for f in dataclasses.fields(miles_core.config.RunConfig)}


def _config_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters of `fn` that take a whole RunConfig: annotated so, or the unannotated `cfg`."""
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return [a.arg for a in args if (a.annotation is not None and "RunConfig" in ast.unparse(a.annotation))
            or (a.annotation is None and a.arg in ("cfg", "config"))]


def one_section_takers(sources: dict[str, ast.AST]) -> list[str]:
    """Functions taking the whole RunConfig that read exactly one of its sections and nothing else of it
    (neither a derived value nor the config itself handed on): they should take that section."""
    found = []
    for path, tree in sources.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
            for name in _config_params(fn):
                uses = [parents.get(n) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name]
                read = {u.attr for u in uses if isinstance(u, ast.Attribute)}
                whole = any(not isinstance(u, ast.Attribute) for u in uses)
                if len(read) == 1 and read <= SECTIONS and not whole:
                    found.append(f"{path}:{fn.lineno} {fn.name}({name}) reads only .{read.pop()}")
    return found


def test_components_receive_their_own_config_section():
    """A function that needs one section of the config takes that section, not the whole RunConfig
    (measured: 20 such functions before, among 155 that took the whole config; 126 take it now)."""
    assert one_section_takers(SOURCES) == []


def test_the_section_check_sees_a_whole_config_read_for_one_section():
    tree = ast.parse("def f(cfg: RunConfig):\n    return cfg.train.lr\n"
                     "def g(cfg):\n    return cfg.train.lr + cfg.rollout.n\n"
                     "def h(cfg):\n    return helper(cfg) + cfg.train.lr\n"
                     "def k(cfg):\n    return cfg.sequence_parallel\n")
    assert one_section_takers({"m.py": tree}) == ["m.py:1 f(cfg) reads only .train"]
