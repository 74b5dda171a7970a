"""The torch API the code relies on exists in the GPU image's torch (tests/support/torch_api.py).

The CPU venv runs torch 2.13.0; the GPU image gets SGLang's pin, torch 2.14.1 (a CUDA 13 build, no CPU
wheel). The surface (attribute chains rooted at torch names in miles_core/, tasks/, bench/gpu_check.py,
tests/gpu/, the collectives that collectives.py wraps by name, and call shapes) is read with `ast`,
resolved in both torches, each imported on CPU: 2.14.1 in a venv of its own, built once in
~/.cache/miles-flyte/torch-venvs (~4.3 GB, ~60 s; then ~10 s a run). The cross-version tests skip
only when the package registry cannot be reached.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.support import gpu_pins, torch_api

# Code a later change could write: names 2.13.0 has and 2.14.1 removed (found by diffing both torches'
# dir() and signatures), and a name neither has.
PLANTED = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_group_via_split_group
    from torch.nn import functional as F


    def compiled(model, x):
        dist._StoreCollectives  # gone in 2.14.1
        torch.distributed.all_reduce_v2(x)  # in no torch
        F.silu(x, inplace=False)  # fine in both
        return torch.compile(model, shapes_spec=None)  # 2.14.1's torch.compile has no shapes_spec
    """
)
PLANTED_MISSING = {
    "torch.distributed._StoreCollectives",
    "torch.distributed.distributed_c10d._new_group_via_split_group",
}


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    (root / "planted.py").write_text(PLANTED)
    return torch_api.collect(), torch_api.collect(root, sources=("planted.py",), dynamic=())


@pytest.fixture(scope="module")
def verdicts(surfaces):
    code, planted = surfaces
    try:
        target = torch_api.target_python()
    except gpu_pins.RegistryUnreachable as e:
        pytest.skip(f"needs the package registry: {e}")
    chains = sorted({*code.chains, *planted.chains})
    ref, tgt = torch_api.probe_both(chains, sorted(code.attr_names), target)
    return torch_api.compare(code, ref, tgt), torch_api.compare(planted, ref, tgt)


@pytest.mark.slow
def test_the_code_uses_only_torch_apis_the_gpu_torch_has(verdicts):
    v, _ = verdicts
    assert v.target.split("+")[0] == str(torch_api.gpu_torch_version()), v.target
    assert v.reference.startswith("2.13.0"), v.reference
    assert v.ok, v.report(verbose=False)
    assert len(v.resolved) >= 100 and v.calls_checked >= 50, v.report(verbose=False)


@pytest.mark.slow
def test_the_check_fails_on_apis_the_gpu_torch_lacks(verdicts):
    _, p = verdicts
    assert not p.ok
    assert set(p.missing) == PLANTED_MISSING, p.report(verbose=False)
    assert len(p.call_problems) == 1 and "shapes_spec" in p.call_problems[0], p.call_problems
    assert list(p.unresolved_in_reference) == ["torch.distributed.all_reduce_v2"]
    assert "torch.nn.functional.silu" in p.resolved


def test_the_surface_holds_the_collectives_and_resolves_in_the_cpu_torch(surfaces):
    code, planted = surfaces
    chains = set(code.chains)
    assert {"torch.distributed.all_reduce", "torch.distributed.all_gather", "torch.distributed.barrier", "torch.distributed.get_backend", "torch.cuda.current_device"} <= chains
    helper = [u for u in code.uses if u.chain == "torch.distributed.distributed_c10d._new_process_group_helper"]
    assert any({"group_name", "timeout", "device_id"} <= set(u.keywords) for u in helper), helper
    assert all(c.startswith("torch") for c in chains)
    # aliases: `import torch.distributed as dist`, `from torch.nn import functional as F`, a from-import
    assert {
        "torch.compile",
        "torch.distributed._StoreCollectives",
        "torch.distributed.all_reduce_v2",
        "torch.nn.functional.silu",
        "torch.distributed.distributed_c10d._new_group_via_split_group",
    } <= set(planted.chains)
    assert [u.keywords for u in planted.uses if u.chain == "torch.compile"] == [("shapes_spec",)]
    ref = torch_api.probe(sys.executable, code.chains)
    unresolved = {c: d["error"] for c, d in ref["chains"].items() if not d["ok"]}
    assert not unresolved, f"chains the CPU torch {ref['version']} does not have (checked nowhere): {unresolved}"
