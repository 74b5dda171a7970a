"""The GPU image installs the one pinned set: requirements.lock (but SGLang's CUDA torch) + SGLang."""

from __future__ import annotations

from images import GPU_EXTRAS, LOCK, SOURCE_BUILT, TE_REQUIREMENT, gpu_image, gpu_packages, gpu_requirements


def test_gpu_image_installs_the_lock_plus_the_gpu_extras():
    lock = [ln.strip() for ln in LOCK.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    pkgs = gpu_packages()
    assert set(pkgs) == {p for p in lock if not p.startswith("torch==")} | set(GPU_EXTRAS)
    assert not any(p.startswith("torch==") for p in pkgs)
    assert "megatron-core==0.16.1" in pkgs and gpu_image.packages == pkgs


def test_gpu_image_builds_transformer_engine_against_its_torch_after_the_set():
    # The last step installs Transformer Engine without build isolation (its PyTorch part is source
    # only and must build against the image's CUDA torch, not a torch fetched into an isolated env).
    (cmd,) = gpu_image.commands
    assert "--no-build-isolation" in cmd and f"'{TE_REQUIREMENT}'" in cmd and "NVTE_FRAMEWORK=pytorch" in cmd
    assert cmd.index("pybind11") < cmd.index("--no-build-isolation")
    assert gpu_requirements() == [*gpu_packages(), TE_REQUIREMENT]
    assert SOURCE_BUILT == ("transformer-engine-torch",)
    assert not any(p.startswith("transformer-engine") for p in gpu_packages())
