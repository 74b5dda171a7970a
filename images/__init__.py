"""Container images of the project, each defined once (docs/deployment.md).

- `cpu_image`: Python 3.11 + torch (CPU wheel) + the pinned dependency set + this project.
  Runs prepare_data, the eval follower, report, backfill, and the CPU embedded default.
- `gpu_image`: a CUDA 13.0 base image (the CUDA of SGLang's torch) + the same pinned set
  (requirements.lock, but SGLang's CUDA torch) + SGLang + Transformer Engine + this project. Runs
  `train` (engines and trainer) and GPU evals. tests/integration/test_gpu_pins.py checks that
  SGLang's and megatron-core's own requirements hold in the lock and resolves this set (Transformer
  Engine included) for linux x86_64.

Tasks take their image from `task_image("cpu" | "gpu")`:
- by default the ImageSpec itself: `pyflyte run --remote` / `pyflyte register` build and push it
  (docker or the configured builder) to `MILES_IMAGE_REGISTRY`;
- with `MILES_CPU_IMAGE` / `MILES_GPU_IMAGE` set, that prebuilt image reference is used as is and
  nothing is built (CI, air-gapped registration, `pyflyte package` offline).

Image-only imports (sglang, CUDA extensions) belong behind `gpu_image.is_container()` in task
modules, so registering from a laptop never imports them. Importing this module builds nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from flytekit import ImageSpec
from flytekit.constants import CopyFileDetection

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REGISTRY = os.environ.get("MILES_IMAGE_REGISTRY", "ghcr.io/miles-flyte")

LOCK = PROJECT_ROOT / "requirements.lock"
# Pins the GPU image takes from SGLang instead of the lock: its CUDA build of torch (sglang 0.5.23
# pins torch==2.14.1, a CUDA 13.0 build; the CPU set keeps torch 2.13.0, whose CPU wheel is the one
# the project's machines can install). Every other pin is the lock's.
GPU_OWN = ("torch",)
# pyproject.toml's `gpu` extra. Plain SGLang: its `all` extra adds image/video generation
# (`diffusion`: cloudpickle==3.1.2 and PyYAML==6.0.1, which contradict the lock) and servers this
# project does not run.
GPU_EXTRAS = ["sglang==0.5.23"]
# CUDA 13.0 like SGLang's torch (cuda-toolkit 13.0.x); devel for the kernels SGLang compiles at run
# time; Ubuntu 24.04's glibc 2.39 (SGLang 0.5.23's wheels are manylinux_2_34).
GPU_BASE_IMAGE = "nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04"

# Transformer Engine: the trainer's fused layers and attention (`--transformer-impl auto` picks them on
# a GPU where `transformer_engine` imports; fused attention keeps no s x s state: docs/training.md,
# "Memory per GPU"). Its PyTorch part, transformer-engine-torch, is published as source only (a CUDA
# extension built against the torch it runs with), so the image installs it after the pinned set,
# without build isolation: it builds against SGLang's CUDA torch with the devel base image's CUDA
# toolkit and cuDNN (its setup first tries NVIDIA's prebuilt wheel for that torch and CUDA). Its core
# library, transformer-engine-cu13, is a wheel of the same version for the CUDA 13 torch (named here:
# the source distribution's static metadata names the CUDA 12 core, its build the torch's). The
# version is the newest megatron-core 0.16.1 admits (its `dev` extra: >=2.9.0a0,<2.12.0).
TE_REQUIREMENT = "transformer-engine[core_cu13,pytorch]==2.11.0"
SOURCE_BUILT = ("transformer-engine-torch",)  # the GPU set's only distribution without a wheel
TE_BUILD_TOOLS = ("cmake", "ninja", "pybind11", "setuptools", "pip")
TE_BUILD_JOBS = 8  # nvcc processes in parallel (each takes a few GB of the builder's memory)


def te_build_command() -> str:
    """The image's last install step: Transformer Engine against the torch already installed."""
    return (f"uv pip install {' '.join(TE_BUILD_TOOLS)} && "
            f"NVTE_FRAMEWORK=pytorch MAX_JOBS={TE_BUILD_JOBS} uv pip install --no-build-isolation '{TE_REQUIREMENT}'")


def gpu_requirements() -> list[str]:
    """Everything the GPU image ends up with: its packages, then what `te_build_command` adds."""
    return [*gpu_packages(), TE_REQUIREMENT]


def gpu_packages() -> list[str]:
    """requirements.lock (the one pinned set) without the CPU torch, plus the GPU extras."""
    pins = []
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and line.split("==", 1)[0].split("[", 1)[0].lower() not in GPU_OWN:
            pins.append(line)
    return [*pins, *GPU_EXTRAS]


# SOURCE_COPY: the project's whole source goes into the images (and, for `pyflyte run --remote`,
# into the fast-registration bundle: `--copy all`). flytekit's default copies only the modules that
# registration imported, and the tasks import most of miles_core when they run (the driver, the
# trainer, the engines' server processes), so such an image or bundle fails with ModuleNotFoundError.
# The tag then hashes every tracked-looking file (gitignore applies): a code change makes a new tag,
# whose build reuses every layer but the last (the source).
cpu_image = ImageSpec(
    name="miles-flyte-cpu",
    registry=REGISTRY,
    python_version="3.11",
    # The whole pinned resolution; the CPU index keeps torch==2.13.0 a CPU wheel.
    requirements=str(PROJECT_ROOT / "requirements.lock"),
    pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    env={"PYTHONUNBUFFERED": "1"},
    source_root=str(PROJECT_ROOT), source_copy_mode=CopyFileDetection.ALL,  # see SOURCE_COPY
)

gpu_image = ImageSpec(
    name="miles-flyte-gpu",
    registry=REGISTRY,
    base_image=GPU_BASE_IMAGE,
    python_version="3.11",
    apt_packages=["git", "build-essential", "libnuma1"],
    # The same pinned set as the CPU image (requirements.lock) plus SGLang, which brings its CUDA torch;
    # then Transformer Engine built against that torch (see TE_REQUIREMENT).
    packages=gpu_packages(),
    commands=[te_build_command()],
    env={"PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN"},
    source_root=str(PROJECT_ROOT), source_copy_mode=CopyFileDetection.ALL,  # see SOURCE_COPY
)

IMAGES = {"cpu": cpu_image, "gpu": gpu_image}


def task_image(kind: str):
    """The image for tasks of `kind` (cpu | gpu): a prebuilt reference from MILES_{KIND}_IMAGE, else the ImageSpec."""
    if kind not in IMAGES:
        raise ValueError(f"unknown image kind {kind!r}; known: {', '.join(IMAGES)}")
    return os.environ.get(f"MILES_{kind.upper()}_IMAGE") or IMAGES[kind]
