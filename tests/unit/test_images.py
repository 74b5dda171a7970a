"""The GPU image installs the one pinned set: requirements.lock (but SGLang's CUDA torch) + SGLang."""

from __future__ import annotations

from images import GPU_EXTRAS, LOCK, gpu_image, gpu_packages


def test_gpu_image_installs_the_lock_plus_the_gpu_extras():
    lock = [ln.strip() for ln in LOCK.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    pkgs = gpu_packages()
    assert set(pkgs) == {p for p in lock if not p.startswith("torch==")} | set(GPU_EXTRAS)
    assert not any(p.startswith("torch==") for p in pkgs)
    assert "megatron-core==0.16.1" in pkgs and gpu_image.packages == pkgs
