"""The torch API the code relies on, checked against the GPU image's torch without a GPU.

The CPU venv has torch 2.13.0 (CPU build); the GPU image installs SGLang's pin, torch 2.14.1, whose only
linux x86_64 wheel is a CUDA 13 build (tests/support/gpu_pins.py). This module:

1. `collect()`: reads miles_core/, tasks/, bench/gpu_check.py and tests/gpu/ with `ast` and lists every
   attribute chain rooted at a name bound to torch or to something imported from it (`import torch`,
   `import torch.distributed as dist`, `from torch.utils.checkpoint import checkpoint`, ...), with the
   keyword names and positional count of each call made through one; plus the names that
   `DYNAMIC` tuples feed to `getattr`, and every other `x.name` attribute name (a heuristic for Tensor methods:
   those names that are `torch.Tensor` attributes in the reference torch).
2. `probe()`: resolves each chain inside an interpreter (getattr walk, importlib for submodules) and
   reads its signature: the venv's torch 2.13.0, and a venv with the GPU torch (`target_python()`:
   built once in ~/.cache/miles-flyte, `MILES_TORCH_VENVS` to move it: the wheel with --no-deps plus
   the requirements `import torch` loads, its CUDA runtime wheels; not triton or cuda-bindings). Both
   import torch on CPU; the GPU torch finds the lock's other packages (numpy, tensorboard) on the
   venv's site-packages, as the GPU image has them.
3. `check()`: the verdict. A chain that resolves in 2.13 must resolve in the GPU torch, and a call that
   2.13's signature accepts (keyword names, positional count) must be accepted by the GPU torch's.
   Chains that do not resolve even in 2.13 (a dependency missing, an instance attribute set later) are
   listed apart; signatures that changed are reported, not failed.

What it cannot see: behaviour behind an unchanged name (C++ kernels, CUDA, NCCL semantics, default
values), methods reached through values other than module names (only the Tensor-name heuristic),
names built at run time other than `DYNAMIC`'s (state_tree's and cpu_server's `getattr(torch, dtype)`),
and signatures of C builtins that carry none.

`python -m tests.support.torch_api` prints the surface and the verdict; tests/integration/test_torch_api.py
is the CI check.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# This file is also run as a script (`--probe`) by another Python, with `-I` and without this project:
# it imports nothing from tests/, so its bounds are its own.
PROBE_SECONDS = 300  # one probe: the other Python imports torch and resolves every name
INSTALL_SECONDS = 1200  # one pip install of a torch wheel and its needs

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("miles_core", "tasks", "bench/gpu_check.py", "tests/gpu")
# Names reached with getattr(module, name) over a module-level tuple: (file, tuple's name, module).
# None today: the one such tuple, the device rule's WRAPPED, is the CPU test harness's
# (tests/support/strict_device.py), which never runs on the GPU torch.
DYNAMIC: tuple = ()
# Requirements of the GPU torch that `import torch` does not load (nor does this check): not installed.
NOT_FOR_IMPORT = ("triton", "cuda-bindings")
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


# ---------------------------------------------------------------- 1. the surface, from the sources


@dataclass(frozen=True)
class Use:
    chain: str  # "torch.distributed.all_reduce"
    where: str  # "miles_core/train/collectives.py:58"
    keywords: tuple[str, ...] = ()  # keyword names of a call through the chain
    positional: int | None = None  # positional arguments of that call; None: not a call, or *args


@dataclass
class Surface:
    uses: list[Use]
    attr_names: dict[str, str]  # every other `x.name` in the sources: name -> first place

    @property
    def chains(self) -> list[str]:
        return sorted({u.chain for u in self.uses})

    def where(self, chain: str) -> list[str]:
        return [u.where for u in self.uses if u.chain == chain]


def source_files(root: Path = PROJECT_ROOT, sources=SOURCES) -> list[Path]:
    out: list[Path] = []
    for s in sources:
        p = root / s
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return out


def _is_torch(module: str | None) -> bool:
    return bool(module) and (module == "torch" or module.startswith("torch."))


def _dotted(node: ast.AST) -> list[str] | None:
    """["dist", "group", "WORLD"] for `dist.group.WORLD`; None when not rooted at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _call_shape(call: ast.Call) -> tuple[tuple[str, ...], int | None]:
    keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
    positional = None if any(isinstance(a, ast.Starred) for a in call.args) else len(call.args)
    return keywords, positional


def collect_file(path: Path, root: Path = PROJECT_ROOT) -> tuple[list[Use], dict[str, str]]:
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bound: dict[str, str] = {}  # local name -> torch chain (file-wide: imports in functions count too)
    uses: list[Use] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_torch(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    uses.append(Use(a.name, f"{rel}:{node.lineno}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module):
            for a in node.names:
                if a.name != "*":
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
                    uses.append(Use(f"{node.module}.{a.name}", f"{rel}:{node.lineno}"))
    attr_names: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Name)) or not isinstance(node.ctx, ast.Load):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute):
            continue  # not the whole chain: its parent is
        parts = _dotted(node)
        if parts is None or parts[0] not in bound:
            if isinstance(node, ast.Attribute):
                attr_names.setdefault(node.attr, f"{rel}:{node.lineno}")
            continue
        if isinstance(node, ast.Name) and not (isinstance(parent, ast.Call) and parent.func is node):
            continue  # a bare imported name: its import is already a use
        chain = ".".join([bound[parts[0]], *parts[1:]])
        if isinstance(parent, ast.Call) and parent.func is node:
            keywords, positional = _call_shape(parent)
            uses.append(Use(chain, f"{rel}:{node.lineno}", keywords, positional))
        else:
            uses.append(Use(chain, f"{rel}:{node.lineno}"))
    return uses, attr_names


def dynamic_uses(root: Path = PROJECT_ROOT, dynamic=DYNAMIC) -> list[Use]:
    out = []
    for rel, name, module in dynamic:
        tree = ast.parse((root / rel).read_text())
        found = [
            n
            for n in tree.body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        ]
        if len(found) != 1:
            raise ValueError(f"{rel}: {len(found)} module-level assignments to {name}")
        value = ast.literal_eval(found[0].value)
        out += [Use(f"{module}.{v}", f"{rel}:{found[0].lineno} ({name})") for v in value]
    return out


def collect(root: Path = PROJECT_ROOT, sources=SOURCES, dynamic=DYNAMIC) -> Surface:
    uses: list[Use] = []
    attr_names: dict[str, str] = {}
    for path in source_files(root, sources):
        u, a = collect_file(path, root)
        uses += u
        for k, v in a.items():
            attr_names.setdefault(k, v)
    uses += dynamic_uses(root, dynamic)
    return Surface(uses, attr_names)


# ---------------------------------------------------------------- 2. the probe, inside an interpreter


def _describe(chain: str) -> dict:
    """Runs in the probed interpreter (stdlib and torch only)."""
    import importlib
    import inspect
    import re
    import types

    parts = chain.split(".")
    try:
        obj = importlib.import_module(parts[0])
        path = parts[0]
        for p in parts[1:]:
            path = f"{path}.{p}"
            if isinstance(obj, types.ModuleType) and not hasattr(obj, p):
                try:
                    obj = importlib.import_module(path)
                    continue
                except ModuleNotFoundError as e:
                    if e.name and not path.startswith(e.name) and not e.name.startswith(path):
                        return {"ok": False, "error": f"importing {path} needs {e.name}, not installed"}
                    return {"ok": False, "error": f"{path[: -len(p) - 1]} has no attribute or submodule {p!r}"}
            obj = getattr(obj, p)
    except AttributeError as e:
        return {"ok": False, "error": f"AttributeError: {e}"}
    except Exception as e:  # an import that fails for another reason
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    out: dict = {"ok": True, "type": type(obj).__name__, "sig": None, "params": None}
    if callable(obj):
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            pass
        else:
            out["sig"] = re.sub(r" at 0x[0-9a-f]+", "", str(sig))  # <function f at 0x7f...> defaults
            out["params"] = [
                [n, p.kind.name, p.default is not inspect.Parameter.empty] for n, p in sig.parameters.items()
            ]
    return out


def _probe_main() -> None:
    request = json.load(sys.stdin)
    sys.path.extend(request.get("extra_paths", []))
    import warnings

    warnings.simplefilter("ignore")
    t0 = time.monotonic()
    import torch

    imported = time.monotonic() - t0
    out = {
        "version": torch.__version__,
        "torch_file": torch.__file__,
        "import_s": imported,
        "chains": {c: _describe(c) for c in request["chains"]},
        "tensor_attrs": sorted(
            n for n in request.get("attr_names", []) if not n.startswith("__") and hasattr(torch.Tensor, n)
        ),
    }
    json.dump(out, sys.stdout)


def _start_probe(python: str | Path, chains: list[str], attr_names: list[str], extra_paths: list[str]):
    request = json.dumps({"chains": chains, "attr_names": attr_names, "extra_paths": extra_paths})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # both torches run their CPU side, GPU or not
    proc = subprocess.Popen(
        [str(python), "-I", str(Path(__file__).resolve()), "--probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stdin.write(request)
    proc.stdin.close()
    return proc


def _finish_probe(proc, python, timeout: float = PROBE_SECONDS) -> dict:
    try:
        stdout = proc.stdout.read()
        stderr = proc.stderr.read()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"probe in {python} failed ({proc.returncode}):\n{stderr[-4000:]}")
    return json.loads(stdout)


def probe(python: str | Path, chains: list[str], attr_names: list[str] = (), extra_paths: list[str] = ()) -> dict:
    """{"version", "chains": {chain: {"ok", "type", "sig", "params"} or {"ok": False, "error"}}, "tensor_attrs"}."""
    proc = _start_probe(python, list(chains), list(attr_names), list(extra_paths))
    return _finish_probe(proc, python)


# ---------------------------------------------------------------- the GPU torch, in a venv of its own


@functools.cache
def gpu_torch_version():
    """The torch the GPU image gets: SGLang's pin (gpu_pins)."""
    from tests.support import gpu_pins

    return gpu_pins.check(PYTHON).gpu_own["torch"]


def venvs_root() -> Path:
    from tests.support import gpu_pins

    path = Path(os.environ.get("MILES_TORCH_VENVS") or gpu_pins.wheel_cache().parent / "torch-venvs")
    path.mkdir(parents=True, exist_ok=True)
    return path


def target_python(version=None, log=lambda msg: None) -> Path:
    """A CPython `PYTHON` with torch==`version` (default: the GPU image's) and what `import torch` needs,
    built once under venvs_root() (~4.3 GB for 2.14.1, ~45 s here); raises gpu_pins.RegistryUnreachable."""
    from packaging.utils import canonicalize_name

    from tests.support import gpu_pins

    version = version or gpu_torch_version()
    venv = venvs_root() / f"torch-{version}-py{PYTHON}"
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    gpu = gpu_pins.load_gpu_set()
    t0 = time.monotonic()
    wheel = gpu_pins.fetch_wheel("torch", version, PYTHON, gpu.glibc_minor)
    meta = gpu_pins.wheel_metadata(wheel)
    needs = [
        str(r)
        for r in meta.requires
        if gpu_pins.applies(r, PYTHON) and canonicalize_name(r.name) not in NOT_FOR_IMPORT
    ]
    building = venv.with_name(f"{venv.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(building)], check=True)
        pip = [sys.executable, "-m", "pip", "--python", str(building / "bin" / "python"), "install"]
        pip += ["--no-compile", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
        pip += ["--retries", "1", "--timeout", "30"]
        for args in ([*pip, "--no-deps", str(wheel)], [*pip, *needs]):
            proc = gpu_pins._run(args, timeout=INSTALL_SECONDS)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(args[3:8])} ... failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        (building / ".complete").write_text(f"torch {version}; {' '.join(needs)}\n")
        try:
            building.rename(venv)
        except OSError:  # another process finished first
            shutil.rmtree(building, ignore_errors=True)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    log(f"built {venv} in {time.monotonic() - t0:.0f} s")
    return python


def reference_site_packages() -> list[str]:
    """The running venv's site-packages: the lock's packages, for the GPU torch's optional imports."""
    import site

    return [p for p in site.getsitepackages() if Path(p).is_dir()]


# ---------------------------------------------------------------- 3. the verdict


def call_problem(params: list | None, use: Use) -> str | None:
    """Why a signature refuses the call `use` (None: accepts it, or nothing to check)."""
    if params is None or (not use.keywords and use.positional is None):
        return None
    kinds = {p[0]: p[1] for p in params}
    if use.keywords and "VAR_KEYWORD" not in kinds.values():
        unknown = [k for k in use.keywords if kinds.get(k) not in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")]
        if unknown:
            return f"no parameter {', '.join(unknown)}"
    if use.positional is not None and "VAR_POSITIONAL" not in kinds.values():
        room = sum(k in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD") for k in kinds.values())
        if use.positional > room:
            return f"{use.positional} positional arguments, takes at most {room}"
    return None


@dataclass
class Verdict:
    reference: str  # the torch versions compared
    target: str
    surface: Surface
    resolved: list[str]  # chains that resolve in the reference torch (the checked surface)
    unresolved_in_reference: dict[str, str]  # chain -> why (not checked further)
    missing: dict[str, str]  # resolve in the reference, not in the target: the failures
    call_problems: list[str]  # call sites the reference's signature accepts and the target's refuses
    calls_checked: int  # call sites with keywords or positionals checked against both signatures
    calls_unchecked: int  # call sites where either torch gives no signature
    calls_refused_by_reference: list[str]  # call sites 2.13's signature refuses (a misread call): not checked
    signature_changes: dict[str, tuple[str, str]]  # parameters differ (informational): chain -> both signatures
    tensor_attrs: list[str]  # attribute names used in the code that torch.Tensor has in the reference
    tensor_attrs_missing: list[str]  # ... and not in the target
    seconds: dict[str, float] = field(default_factory=dict)
    probes: tuple[dict, dict] = ({}, {})  # what each torch said (probe()'s answers)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.call_problems or self.tensor_attrs_missing)

    def report(self, verbose: bool = True) -> str:
        s = self.surface
        lines = [
            f"torch API surface: {len(s.chains)} chains ({len(s.uses)} uses); "
            f"reference torch {self.reference}, target torch {self.target}",
        ]
        if verbose:
            for c in s.chains:
                places = s.where(c)
                mark = "  " if c in self.resolved else "? "
                lines.append(f"  {mark}{c}  [{places[0]}{f' +{len(places) - 1}' if len(places) > 1 else ''}]")
        lines.append(
            f"resolve in {self.reference}: {len(self.resolved)}; not even there: {len(self.unresolved_in_reference)}"
        )
        lines += [f"  ? {c}: {why}" for c, why in sorted(self.unresolved_in_reference.items())]
        lines.append(
            f"checked in {self.target} (imported, getattr/importlib): "
            f"{len(self.resolved) - len(self.missing)} present, {len(self.missing)} missing"
        )
        lines += [f"  MISSING {c} [{', '.join(s.where(c)[:3])}]: {why}" for c, why in sorted(self.missing.items())]
        lines.append(
            f"call sites checked against both signatures: {self.calls_checked} (no signature in one torch: "
            f"{self.calls_unchecked}); refused by {self.reference}: {len(self.calls_refused_by_reference)}, "
            f"by {self.target}: {len(self.call_problems)}"
        )
        lines += [f"  ? {p}" for p in self.calls_refused_by_reference]
        lines += [f"  REFUSED {p}" for p in self.call_problems]
        lines.append(f"Tensor attribute names used (heuristic): {len(self.tensor_attrs)}; missing in {self.target}: "
                     f"{len(self.tensor_attrs_missing)} {self.tensor_attrs_missing or ''}".rstrip())
        lines.append(f"parameters that differ ({len(self.signature_changes)}, not failures):")
        for c, (a, b) in sorted(self.signature_changes.items()):
            lines += [f"  {c}", f"    {self.reference}: {a}", f"    {self.target}: {b}"]
        lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        lines.append("verdict: " + ("ok" if self.ok else "FAILED"))
        return "\n".join(lines)


def compare(surface: Surface, ref: dict, tgt: dict, seconds: dict | None = None) -> Verdict:
    resolved = [c for c in surface.chains if ref["chains"][c]["ok"]]
    unresolved = {c: ref["chains"][c]["error"] for c in surface.chains if not ref["chains"][c]["ok"]}
    missing = {c: tgt["chains"][c]["error"] for c in resolved if not tgt["chains"][c]["ok"]}
    problems, refused, checked, unchecked = [], [], 0, 0
    for u in surface.uses:
        if u.chain not in resolved or u.chain in missing or (not u.keywords and u.positional is None):
            continue
        a, b = ref["chains"][u.chain]["params"], tgt["chains"][u.chain]["params"]
        if a is None or b is None:
            unchecked += 1
            continue
        if why := call_problem(a, u):  # the reference refuses it too (or the call is misread): not this check's
            refused.append(f"{u.where}: {u.chain}: {why}")
            continue
        checked += 1
        why = call_problem(b, u)
        if why:
            problems.append(f"{u.where}: {u.chain}(..., {', '.join(u.keywords)}): {why}")
    changes = {  # parameters (name, kind, has a default) that differ; annotations alone do not count
        c: (ref["chains"][c]["sig"], tgt["chains"][c]["sig"])
        for c in resolved
        if c not in missing and ref["chains"][c]["params"] != tgt["chains"][c]["params"]
    }
    attrs = ref["tensor_attrs"]
    return Verdict(
        reference=ref["version"],
        target=tgt["version"],
        surface=surface,
        resolved=resolved,
        unresolved_in_reference=unresolved,
        missing=missing,
        call_problems=problems,
        calls_checked=checked,
        calls_unchecked=unchecked,
        calls_refused_by_reference=refused,
        signature_changes=changes,
        tensor_attrs=attrs,
        tensor_attrs_missing=sorted(set(attrs) - set(tgt["tensor_attrs"])),
        seconds=dict(seconds or {}),
        probes=(ref, tgt),
    )


def probe_both(chains: list[str], attr_names: list[str], target: Path) -> tuple[dict, dict]:
    """probe() in the running interpreter (the reference torch) and in `target`, side by side."""
    procs = [
        (sys.executable, _start_probe(sys.executable, chains, attr_names, [])),
        (target, _start_probe(target, chains, attr_names, reference_site_packages())),
    ]
    ref, tgt = [_finish_probe(p, py) for py, p in procs]
    if Path(tgt["torch_file"]).resolve().is_relative_to(Path(sys.prefix).resolve()):
        raise RuntimeError(f"the target interpreter imported the reference torch: {tgt['torch_file']}")
    return ref, tgt


def check(surface: Surface | None = None, target: Path | None = None, log=lambda msg: None) -> Verdict:
    """The surface (default: `collect()`) against the running torch and the GPU image's (`target_python()`)."""
    seconds = {}
    t0 = time.monotonic()
    surface = surface or collect()
    seconds["collect"] = time.monotonic() - t0
    t0 = time.monotonic()
    target = target or target_python(log=log)
    seconds["target venv"] = time.monotonic() - t0
    t0 = time.monotonic()
    ref, tgt = probe_both(surface.chains, sorted(surface.attr_names), target)
    seconds["probes"] = time.monotonic() - t0
    return compare(surface, ref, tgt, seconds)


def main(argv: list[str]) -> int:
    if "--probe" in argv:
        _probe_main()
        return 0
    v = check(log=print)
    print(v.report(verbose="-q" not in argv))
    return 0 if v.ok else 1


if __name__ == "__main__":
    if "--probe" not in sys.argv and str(PROJECT_ROOT) not in sys.path:
        sys.path.insert(0, str(PROJECT_ROOT))
    sys.exit(main(sys.argv[1:]))
