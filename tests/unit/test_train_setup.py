"""Process-group setup and the CPU shim.

Pins: `ensure_process_groups` is idempotent and refuses a different tensor-parallel size in the
same process; the CPU RNG tracker's `fork` runs its block on its own stream and restores the
default generator (so Megatron's forks do not perturb the trainer's sampling RNG).
"""

from __future__ import annotations

import pytest
import torch

from miles_core.train.cpu_shim import CpuRngStatesTracker, install_cpu_shim
from miles_core.train.process_groups import ensure_process_groups


def test_process_groups_are_idempotent():
    """A second call with the same size is a no-op; another size names the flag."""
    install_cpu_shim()
    ensure_process_groups(1)
    ensure_process_groups(1)
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    with pytest.raises(RuntimeError, match="tensor-model-parallel-size"):
        ensure_process_groups(2)


def test_cpu_tracker_fork_isolates_its_stream():
    """Inside fork: a seeded stream that advances across forks; outside: the default generator untouched."""
    tracker = CpuRngStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    expected_outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        a = torch.rand(2)
    with tracker.fork():
        b = torch.rand(2)
    assert torch.equal(torch.rand(3), expected_outside)
    ref = torch.Generator().manual_seed(7)
    assert torch.equal(torch.cat([a, b]), torch.rand(4, generator=ref))
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("model-parallel-rng", 1)


def test_megatron_on_cpu_imports_no_compiler_and_runs_its_fusions_eagerly():
    """Pins: importing miles_core.train on a machine without CUDA makes Megatron's jit fuser the identity
    before Megatron loads: its fused functions are plain functions (run op by op) and importing Megatron
    did not import torch's compiler stack. Guards: every rank process paying ~1.7 CPU-s of
    torch._dynamo/_inductor imports for kernels CPU runs never compile."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("with CUDA Megatron keeps torch.compile")
    import miles_core.train  # noqa: F401 - installs it (first thing, as in a rank process)
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.jit import jit_fuser

    def f(x):
        return x

    assert jit_fuser(f) is f
    assert type(fused_bias_swiglu.bias_swiglu).__name__ == "function"
    x = torch.randn(3, 8)
    assert torch.allclose(fused_bias_swiglu.swiglu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
