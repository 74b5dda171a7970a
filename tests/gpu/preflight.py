"""What the prepared GPU check needs, found or not: one line each, then exit 3 naming what is missing.

    python3 tests/gpu/preflight.py            # on the device machine (tests/gpu/check.sh runs it first)
    python3 tests/gpu/preflight.py --no-cuda  # anywhere: everything but the GPU

It reports python, torch and its CUDA, the GPU (name, memory, bf16, NCCL), megatron-core (and
whether it is the copy carried in .gpu_vendor/), every third-party package the check and the
gpu-marked tests import, and then imports the project modules they run, so a dependency pulled in
by one of them (and absent on the device) is named here, before any phase starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("torch", "numpy", "safetensors", "transformers", "tokenizers", "huggingface_hub", "fsspec", "pyarrow",
            "cloudpickle", "yaml", "pytest", "megatron.core")
MEGATRON_MODULES = ("megatron.core.optimizer", "megatron.core.distributed", "megatron.core.models.gpt")
PROJECT_MODULES = ("miles_core.config", "miles_core.storage", "miles_core.train.trainer", "miles_core.train.checkpoint",
                   "miles_core.engines.model", "miles_core.prepare.memory", "miles_core.prepare.checks",
                   "miles_core.models.builtin",
                   "bench.gpu_check", "tests.unit.test_train")
HINTS = {"megatron": "carry megatron-core: run `bash tests/gpu/check.sh --vendor` here, then name .gpu_vendor in "
                     "the run's carry",
         "": "carry it as a wheel in .whl/ (docs/training.md, 'The GPU check')"}


def find(name: str) -> tuple[bool, str]:
    """(importable, version and location, or what was missing)."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        missing = getattr(e, "name", None) or name
        return False, f"missing {missing!r} ({type(e).__name__}: {e})"
    version = getattr(module, "__version__", "")
    where = os.path.dirname(getattr(module, "__file__", None) or "?")
    carried = " [carried: .gpu_vendor]" if os.sep + ".gpu_vendor" + os.sep in where + os.sep else ""
    return True, f"{version} {where}{carried}".strip()


def cuda_lines() -> tuple[bool, list[str]]:
    """(a usable CUDA device, lines describing it)."""
    import torch
    import torch.distributed as dist

    lines = [f"torch {torch.__version__}, built for CUDA {torch.version.cuda}"]
    if not torch.cuda.is_available():
        return False, lines + ["CUDA: not available"]
    props = torch.cuda.get_device_properties(0)
    lines.append(f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
                 f"{props.major}.{props.minor}, {torch.cuda.device_count()} device(s), bf16 "
                 f"{torch.cuda.is_bf16_supported()}, NCCL {dist.is_nccl_available()}")
    return True, lines


def check(need_cuda: bool) -> list[str]:
    """Print what was found; return the problems."""
    sys.path.insert(0, ROOT)
    print(f"python {platform.python_version()} ({sys.executable})")
    problems = []
    for name in PACKAGES + MEGATRON_MODULES + PROJECT_MODULES:
        ok, text = find(name)
        print(f"{'ok' if ok else 'MISSING':8} {name}: {text}")
        if not ok:
            top = name.split(".")[0]
            problems.append(f"{name}: {text}; {HINTS.get(top, HINTS[''])}")
    if need_cuda and find("torch")[0]:
        ok, lines = cuda_lines()
        print("\n".join(lines))
        if not ok:
            problems.append("no CUDA device: this is the GPU check (bench/gpu_check.py --cpu-smoke runs on CPU)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-cuda", action="store_true", help="do not require a CUDA device")
    problems = check(need_cuda=not ap.parse_args(argv).no_cuda)
    if problems:
        print("preflight FAILED:\n  " + "\n  ".join(problems), flush=True)
        return 3
    print("preflight ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
