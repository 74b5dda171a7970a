"""One dependency set for CPU and GPU, checked without a GPU.

The GPU image (images/__init__.py) installs requirements.lock minus `images.GPU_OWN` (torch: SGLang
pins torch==2.14.1, whose linux x86_64 wheel on PyPI is a CUDA 13.0 build; no CPU wheel of it can be
installed on the project's machines, which keep torch 2.13.0's) plus `images.GPU_EXTRAS` (SGLang).
Two checks:

- `check(python)`: every requirement that the pinned SGLang and megatron-core wheels declare
  (their METADATA's Requires-Dist, markers evaluated for linux x86_64 and CPython `python`) on a
  package the lock pins must admit the lock's version; for a GPU_OWN package, the version the GPU
  image gets (SGLang's own pin). megatron-core runs in both images, so it is checked against both
  sets. The wheels are fetched once with `pip download --no-deps` into `wheel_cache()`.
- `resolve_gpu_set(python)`: uv's resolver over the GPU image's whole set (`uv pip compile
  --python-platform x86_64-manylinux_2_NN --only-binary :all:`, NN = the glibc of the image's
  Ubuntu; only `images.SOURCE_BUILT`, Transformer Engine's PyTorch part, may come from source). uv
  reads the distributions' metadata only (nothing is installed or built, ~60 MB of cache for ~320
  packages). It reaches torch's CUDA runtime wheels (nvidia-*, cuda-toolkit) too: PyPI holds them.

`python -m tests.support.gpu_pins [--resolve]` prints both; tests/integration/test_gpu_pins.py is the CI check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

PIP_SECONDS = 600  # one pip download or uv resolve over the network

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LOCK = PROJECT_ROOT / "requirements.lock"
PYTHONS = ("3.11", "3.12")
# glibc of the GPU base image's Ubuntu: the manylinux level its wheels may need (SGLang 0.5.23's: 2_34).
UBUNTU_GLIBC = {"20.04": 31, "22.04": 35, "24.04": 39}

# What pip or uv says when the registry cannot be reached at all (DNS, refused, timeouts), as opposed
# to "no such version", which is a real failure.
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Name or service not known|"
    r"Temporary failure in name resolution|Network is unreachable|Connection refused|ConnectTimeout|"
    r"Read timed out|ProxyError|Max retries exceeded|dns error|tcp connect error|error sending request|"
    r"operation timed out|failed to lookup address"
)


class RegistryUnreachable(RuntimeError):
    """The package registry could not be reached (the test skips, saying so)."""


# ---------------------------------------------------------------- the pins


def read_lock(path: Path = LOCK) -> dict[str, Version]:
    """requirements.lock as {canonical name: pinned version}."""
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = exact_pin(req)
    return pins


def exact_pin(req: Requirement) -> Version:
    specs = list(req.specifier)
    if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
        raise ValueError(f"{req} is not an exact pin")
    return Version(specs[0].version)


@dataclass(frozen=True)
class GpuSet:
    """What images/ says the GPU image installs."""

    lock: dict[str, Version]
    requirements: tuple[str, ...]  # images.gpu_requirements(): the lock minus GPU_OWN, GPU_EXTRAS, Transformer Engine
    sglang: Requirement  # the SGLang line of images.GPU_EXTRAS
    own: tuple[str, ...]  # images.GPU_OWN, canonical names
    base_image: str
    source_built: tuple[str, ...] = ()  # images.SOURCE_BUILT: resolved from their source distribution

    @property
    def cuda(self) -> tuple[int, int]:
        m = re.search(r":(\d+)\.(\d+)", self.base_image)
        if not m:
            raise ValueError(f"no CUDA version in the GPU base image tag {self.base_image!r}")
        return int(m[1]), int(m[2])

    @property
    def glibc_minor(self) -> int:
        m = re.search(r"ubuntu(\d+\.\d+)", self.base_image)
        if not m or m[1] not in UBUNTU_GLIBC:
            raise ValueError(f"unknown Ubuntu in the GPU base image tag {self.base_image!r}")
        return UBUNTU_GLIBC[m[1]]


def load_gpu_set() -> GpuSet:
    if str(PROJECT_ROOT) not in sys.path:
        sys.path.insert(0, str(PROJECT_ROOT))
    import images

    sglang = [Requirement(r) for r in images.GPU_EXTRAS if canonicalize_name(Requirement(r).name) == "sglang"]
    if len(sglang) != 1:
        raise ValueError(f"images.GPU_EXTRAS names SGLang {len(sglang)} times: {images.GPU_EXTRAS}")
    return GpuSet(
        lock=read_lock(images.LOCK),
        requirements=tuple(images.gpu_requirements()),
        sglang=sglang[0],
        own=tuple(canonicalize_name(n) for n in images.GPU_OWN),
        base_image=images.gpu_image.base_image,
        source_built=tuple(images.SOURCE_BUILT),
    )


# ---------------------------------------------------------------- markers and wheels


def marker_env(python: str, extra: str = "") -> dict[str, str]:
    """Marker variables of CPython `python` (X.Y) on linux x86_64, whatever machine evaluates them."""
    env = dict(default_environment())
    env.update(
        implementation_name="cpython",
        implementation_version=f"{python}.0",
        os_name="posix",
        platform_machine="x86_64",
        platform_python_implementation="CPython",
        platform_system="Linux",
        platform_release="",
        platform_version="",
        python_full_version=f"{python}.0",
        python_version=python,
        sys_platform="linux",
        extra=extra,
    )
    return env


def applies(req: Requirement, python: str, extras: tuple[str, ...] = ()) -> bool:
    """Whether a Requires-Dist line is in force on linux x86_64 / CPython `python` with `extras` asked for."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(marker_env(python, extra)) for extra in ("", *extras))


def pip_target(python: str, glibc_minor: int) -> list[str]:
    """pip download's options for CPython `python` on manylinux x86_64 up to glibc 2.`glibc_minor` (pip does not
    widen one --platform to the older manylinux levels on its own)."""
    abi = "cp" + python.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", abi]
    for minor in range(glibc_minor, 4, -1):
        args += ["--platform", f"manylinux_2_{minor}_x86_64"]
    return [
        *args,
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux2010_x86_64",
        "--platform",
        "manylinux1_x86_64",
    ]


def _fits(wheel: Path, python: str, glibc_minor: int) -> bool:
    """Whether a wheel file installs on CPython `python`, linux x86_64, glibc 2.`glibc_minor`."""
    abi = "cp" + python.replace(".", "")
    minor = int(python.split(".")[1])
    interps = {abi, "py3", f"py3{minor}"} | {f"cp3{m}" for m in range(2, minor + 1)}
    legacy = {"manylinux1_x86_64": 5, "manylinux2010_x86_64": 12, "manylinux2014_x86_64": 17}
    for tag in parse_wheel_filename(wheel.name)[3]:
        if tag.interpreter not in interps or tag.abi not in {abi, "abi3", "none"}:
            continue
        if tag.platform == "any" or legacy.get(tag.platform, 99) <= glibc_minor:
            return True
        m = re.fullmatch(r"manylinux_2_(\d+)_x86_64", tag.platform)
        if m and int(m[1]) <= glibc_minor:
            return True
    return False


def wheel_cache() -> Path:
    path = Path(os.environ.get("MILES_WHEEL_CACHE") or Path.home() / ".cache" / "miles-flyte" / "wheels")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise RegistryUnreachable(f"no answer in {timeout:.0f} s: {' '.join(cmd[:6])} ...") from e
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and UNREACHABLE.search(out):
        line = next(ln for ln in out.splitlines() if UNREACHABLE.search(ln))
        raise RegistryUnreachable(f"package registry unreachable: {line.strip()[:240]}")
    return proc


def fetch_wheel(name: str, version: Version, python: str, glibc_minor: int, cache: Path | None = None) -> Path:
    """The wheel of name==version for CPython `python` on linux x86_64: from the cache, else `pip download --no-deps`."""
    cache = cache or wheel_cache()
    prefix = f"{canonicalize_name(name).replace('-', '_')}-{version}-"

    def cached() -> Path | None:
        hits = [
            w
            for w in sorted(cache.glob("*.whl"))
            if w.name.lower().startswith(prefix) and _fits(w, python, glibc_minor)
        ]
        return hits[0] if hits else None

    if wheel := cached():
        return wheel
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"{name}=={version}",
        "--no-deps",
        *pip_target(python, glibc_minor),
        "-d",
        str(cache),
        "--retries",
        "1",
        "--timeout",
        "30",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
    ]
    proc = _run(cmd, timeout=PIP_SECONDS)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-5:])
        raise RuntimeError(f"pip download {name}=={version} (CPython {python}) failed:\n{tail}")
    if wheel := cached():
        return wheel
    raise RuntimeError(f"pip download {name}=={version} left no wheel for CPython {python} linux x86_64 in {cache}")


@dataclass(frozen=True)
class WheelMeta:
    name: str
    version: Version
    requires: tuple[Requirement, ...]  # Requires-Dist
    extras: tuple[str, ...]  # Provides-Extra, canonical
    wheel: str


def wheel_metadata(wheel: Path) -> WheelMeta:
    with zipfile.ZipFile(wheel) as zf:
        (member,) = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        msg = Parser().parsestr(zf.read(member).decode("utf-8"))
    return WheelMeta(
        name=msg["Name"],
        version=Version(msg["Version"]),
        requires=tuple(Requirement(r) for r in msg.get_all("Requires-Dist") or []),
        extras=tuple(canonicalize_name(e) for e in msg.get_all("Provides-Extra") or []),
        wheel=wheel.name,
    )


def expand_extras(meta: WheelMeta, python: str, extras: tuple[str, ...]) -> tuple[str, ...]:
    """`extras` plus those they name through the package itself (SGLang's `all` is `sglang[diffusion,...]`)."""
    own = canonicalize_name(meta.name)
    seen = {canonicalize_name(e) for e in extras}
    while True:
        more = {
            canonicalize_name(x)
            for r in meta.requires
            if canonicalize_name(r.name) == own and applies(r, python, tuple(seen))
            for x in r.extras
        } - seen
        if not more:
            return tuple(sorted(seen))
        seen |= more


# ---------------------------------------------------------------- check 1: the wheels' own requirements


@dataclass(frozen=True)
class Finding:
    source: str  # "sglang 0.5.23 on CPython 3.11"
    requirement: str
    package: str
    pinned: Version
    where: str  # "requirements.lock" or "GPU image (SGLang's pin)"
    ok: bool

    def __str__(self) -> str:
        verdict = "ok      " if self.ok else "CONFLICT"
        return f"{verdict} {self.source} requires {self.requirement!r}; {self.where} has {self.package}=={self.pinned}"


def shared_findings(
    meta: WheelMeta, python: str, pins: dict[str, Version], where: dict[str, str], extras: tuple[str, ...] = ()
) -> list[Finding]:
    """One Finding per requirement of `meta` in force on linux x86_64 / `python` (with `extras`) on a package in `pins`."""
    out = []
    for req in meta.requires:
        name = canonicalize_name(req.name)
        if name in pins and applies(req, python, extras):
            pinned = pins[name]
            out.append(
                Finding(
                    f"{meta.name} {meta.version} on CPython {python}",
                    str(req),
                    name,
                    pinned,
                    where.get(name, "requirements.lock"),
                    req.specifier.contains(pinned, prereleases=True),
                )
            )
    return out


@dataclass
class Check:
    python: str
    findings: list[Finding]
    sglang: WheelMeta
    megatron: WheelMeta
    extras_asked: tuple[str, ...]
    gpu_own: dict[str, Version]  # what the GPU image gets for GPU_OWN: SGLang's pins
    seconds: float

    @property
    def conflicts(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]


def check(python: str, cache: Path | None = None) -> Check:
    t0 = time.monotonic()
    gpu = load_gpu_set()
    sglang = wheel_metadata(fetch_wheel("sglang", exact_pin(gpu.sglang), python, gpu.glibc_minor, cache))
    megatron = wheel_metadata(fetch_wheel("megatron-core", gpu.lock["megatron-core"], python, gpu.glibc_minor, cache))
    extras = expand_extras(sglang, python, tuple(gpu.sglang.extras))
    gpu_own = {
        canonicalize_name(r.name): exact_pin(r)
        for r in sglang.requires
        if canonicalize_name(r.name) in gpu.own and applies(r, python, extras)
    }
    gpu_pins = {n: v for n, v in gpu.lock.items() if n not in gpu.own} | gpu_own
    where = {n: "GPU image (SGLang's pin)" for n in gpu_own}
    findings = [
        *shared_findings(sglang, python, gpu_pins, where, extras),
        *shared_findings(megatron, python, gpu.lock, {}),  # the CPU image
        *[f for f in shared_findings(megatron, python, gpu_pins, where) if f.package in gpu_own],  # the GPU image
    ]
    return Check(python, findings, sglang, megatron, extras, gpu_own, time.monotonic() - t0)


# ---------------------------------------------------------------- check 2: a resolver over the GPU set


@dataclass
class Resolution:
    python: str
    platform: str
    ok: bool
    seconds: float
    pins: dict[str, Version] = field(default_factory=dict)  # the resolution: name -> version
    output: str = ""
    command: str = ""


def uv_bin() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def resolve_gpu_set(python: str, workdir: Path | None = None, timeout: float = PIP_SECONDS) -> Resolution:
    """uv's resolver over images.gpu_packages() for CPython `python` on linux x86_64 at the base image's glibc."""
    gpu = load_gpu_set()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="gpu-set-"))
    workdir.mkdir(parents=True, exist_ok=True)
    req_file = workdir / f"gpu-set-py{python}.txt"
    req_file.write_text("\n".join(gpu.requirements) + "\n")
    out_file = workdir / f"gpu-resolved-py{python}.txt"
    platform = f"x86_64-manylinux_2_{gpu.glibc_minor}"
    cmd = [
        uv_bin(),
        "pip",
        "compile",
        str(req_file),
        "--python-version",
        python,
        "--python-platform",
        platform,
        # wheels only, but for what the image builds from source (Transformer Engine's PyTorch part)
        "--only-binary",
        ":all:",
        *(a for name in gpu.source_built for a in ("--no-binary", name)),
        "--no-config",
        "--no-header",
        "--no-annotate",
        "--quiet",
        "-o",
        str(out_file),
    ]
    env = dict(os.environ)
    if os.environ.get("PIP_INDEX_URL") and not (os.environ.get("UV_DEFAULT_INDEX") or os.environ.get("UV_INDEX_URL")):
        env["UV_DEFAULT_INDEX"] = os.environ["PIP_INDEX_URL"]  # the same registry pip uses
    env.setdefault("UV_HTTP_TIMEOUT", "60")
    t0 = time.monotonic()
    proc = _run(cmd, timeout=timeout, env=env)
    res = Resolution(
        python,
        platform,
        proc.returncode == 0,
        time.monotonic() - t0,
        output=(proc.stdout + proc.stderr).strip(),
        command=" ".join(cmd[1:]),
    )
    if res.ok:
        res.pins = read_lock(out_file)
    return res


def main(argv: list[str]) -> int:
    rc = 0
    for python in PYTHONS:
        c = check(python)
        print(f"== CPython {python}: {c.sglang.wheel}, {c.megatron.wheel} ({c.seconds:.1f} s)")
        print(f"   SGLang extras asked {list(c.extras_asked)}, defined {list(c.sglang.extras)}")
        print(f"   GPU image's own pins (from SGLang): {', '.join(f'{n}=={v}' for n, v in c.gpu_own.items())}")
        for f in c.findings:
            print("  ", f)
        rc |= bool(c.conflicts)
    if "--resolve" in argv:
        for python in PYTHONS:
            r = resolve_gpu_set(python)
            print(
                f"== resolve the GPU set, CPython {python}, {r.platform}: {'ok' if r.ok else 'FAILED'} ({r.seconds:.1f} s)"
            )
            print("   uv " + r.command)
            if r.ok:
                keys = [
                    "sglang",
                    "torch",
                    "transformers",
                    "tokenizers",
                    "huggingface-hub",
                    "numpy",
                    "cuda-toolkit",
                    "nvidia-nccl-cu13",
                    "megatron-core",
                    "transformer-engine-torch",
                    "transformer-engine-cu13",
                ]
                print(
                    "   " + ", ".join(f"{k}=={r.pins[k]}" for k in keys if k in r.pins) + f" ({len(r.pins)} packages)"
                )
            else:
                print(r.output[-4000:])
            rc |= not r.ok
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
