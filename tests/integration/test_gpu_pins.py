"""One dependency set for CPU and GPU, proved without a GPU (tests/support/gpu_pins.py).

The CPU venv and image install requirements.lock; the GPU image installs the same lock, except the
CUDA torch that SGLang pins, plus SGLang. These tests read the pinned SGLang and megatron-core
wheels' own requirements (fetched once into ~/.cache/miles-flyte/wheels, or MILES_WHEEL_CACHE) and
check the lock against them, and run uv's resolver over the GPU image's whole set for linux x86_64.
They skip only when the package registry cannot be reached.
"""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import images
from tests.support import gpu_pins

PYPROJECT = gpu_pins.PROJECT_ROOT / "pyproject.toml"


def _or_skip(fn, *args):
    try:
        return fn(*args)
    except gpu_pins.RegistryUnreachable as e:
        pytest.skip(f"needs the package registry: {e}")


def test_pyproject_pins_are_the_locks_and_the_gpu_extra_is_the_images():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lock = gpu_pins.read_lock()
    direct = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    for line in direct:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in lock, f"{line}: not in requirements.lock"
        assert req.specifier.contains(lock[name], prereleases=True), f"pyproject {line} vs lock {name}=={lock[name]}"
    assert project["optional-dependencies"]["gpu"] == images.GPU_EXTRAS
    # GPU_OWN packages come from SGLang in the GPU image; nothing else may differ from the lock.
    assert images.GPU_OWN == ("torch",)


@pytest.mark.parametrize("python", gpu_pins.PYTHONS)
def test_the_lock_satisfies_what_the_sglang_and_megatron_core_wheels_require(python):
    gpu = gpu_pins.load_gpu_set()
    check = _or_skip(gpu_pins.check, python)
    assert check.sglang.version == gpu_pins.exact_pin(gpu.sglang)
    assert check.megatron.version == gpu.lock["megatron-core"]
    assert not check.conflicts, "the lock contradicts the pinned wheels:\n" + "\n".join(map(str, check.conflicts))
    # The check saw the pins that matter (SGLang pins all three), and every extra the image asks for exists.
    seen = {f.package for f in check.findings}
    assert {"transformers", "tokenizers", "torch", "numpy"} <= seen
    assert set(check.extras_asked) <= set(check.sglang.extras), f"extras SGLang {check.sglang.version} lacks"
    # The GPU image differs from the lock in torch alone, and that torch is SGLang's exact pin.
    assert set(check.gpu_own) == set(gpu.own) == {"torch"}


@pytest.mark.slow
@pytest.mark.parametrize("python", gpu_pins.PYTHONS)
def test_the_gpu_image_set_resolves_for_linux_x86_64(python, tmp_path):
    gpu = gpu_pins.load_gpu_set()
    res = _or_skip(gpu_pins.resolve_gpu_set, python, tmp_path)
    assert res.ok, f"uv {res.command}\n{res.output[-6000:]}"
    pins = res.pins
    # The resolution keeps every lock pin (but the GPU image's own torch) and SGLang's pins.
    changed = {n: (str(v), str(pins.get(n))) for n, v in gpu.lock.items() if n not in gpu.own and pins.get(n) != v}
    assert not changed, f"the resolver moved lock pins: {changed}"
    assert pins["sglang"] == gpu_pins.exact_pin(gpu.sglang)
    check = _or_skip(gpu_pins.check, python)
    assert {n: pins[n] for n in gpu.own} == check.gpu_own
    # torch's CUDA runtime layer resolved too, and its CUDA is the base image's (major.minor).
    assert "nvidia-nccl-cu13" in pins, sorted(pins)
    toolkit = pins["cuda-toolkit"]
    assert (toolkit.major, toolkit.minor) == gpu.cuda, (
        f"torch brings CUDA {toolkit}, the base image is {gpu.base_image}"
    )
    # Transformer Engine resolved with the rest: its PyTorch part (built in the image) and its core
    # library for the same CUDA major as torch, at one version, inside megatron-core's range.
    te = pins["transformer-engine-torch"]
    assert pins[f"transformer-engine-cu{gpu.cuda[0]}"] == te == pins["transformer-engine"], sorted(pins)
    (admitted,) = [r for r in map(Requirement, importlib.metadata.requires("megatron-core"))
                   if r.name == "transformer-engine" and r.marker and r.marker.evaluate({"extra": "dev"})]
    assert admitted.specifier.contains(te, prereleases=True), f"megatron-core admits {admitted}, not {te}"
