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
