"""The GPU image installs the one pinned set: requirements.lock (but SGLang's CUDA torch) + SGLang."""

from __future__ import annotations

from images import GPU_EXTRAS, LOCK, gpu_image, gpu_packages


def test_gpu_image_installs_the_lock_plus_the_gpu_extras():
    lock = [ln.strip() for ln in LOCK.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    pkgs = gpu_packages()
    assert set(pkgs) == {p for p in lock if not p.startswith("torch==")} | set(GPU_EXTRAS)
    assert not any(p.startswith("torch==") for p in pkgs)
    assert "megatron-core==0.16.1" in pkgs and gpu_image.packages == pkgs


def test_images_carry_the_whole_source_not_only_what_registration_imported():
    """flytekit's default (`--copy auto`, ImageSpec's LOADED_MODULES) carries only the modules that
    registration imported; the tasks import most of miles_core when they run (the driver, the
    trainer, the engine server processes). Guards: an image or a `pyflyte run --remote` bundle that
    fails on the cluster with ModuleNotFoundError."""
    import json
    import pkgutil
    import subprocess
    import sys

    from flytekit.constants import CopyFileDetection

    import miles_core
    from images import cpu_image

    code = ("import json, sys, workflows.fully_async, workflows.eval_backfill, workflows.schedules; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('miles_core.'))))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout.strip().splitlines()[-1]))
    every = {m.name for m in pkgutil.walk_packages(miles_core.__path__, "miles_core.")}
    assert "miles_core.driver.segment" in every - loaded  # registration alone would leave the driver out
    assert cpu_image.source_copy_mode == gpu_image.source_copy_mode == CopyFileDetection.ALL
