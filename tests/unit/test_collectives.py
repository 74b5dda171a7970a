"""NCCL's device rule, checked on CPU (miles_core.train.collectives): two processes, torch.distributed
over gloo, the world standing for an NCCL group under strict mode (no Megatron).

Pins: under strict mode, a CPU tensor handed straight to `dist.all_reduce` on a group standing for
NCCL is refused with an error naming the collective, the tensor's device and the group's device;
`all_reduce_sums` (the DP metric sums, a CPU float64 tensor) goes through the collectives module and
gets the sums; `all_gather` returns every rank's tensor on the caller's device, untagged (a later raw
call on it is refused again); a dtype NCCL lacks is refused; the rank setup hook installs the rule.
Every torch.distributed collective in miles_core/train is called from collectives.py alone.

Guards: `all_reduce_sums` handing its CPU tensor to Megatron's DP group directly, which NCCL refuses
at the first step of every DP>=2 GPU run while gloo (every CPU test) accepts it.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import miles_core
import miles_core.train
from miles_core.train import collectives
from tests.support import strict_device as strict

WORLD = 2
COLLECTIVE_CALL = re.compile(
    r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|reduce|barrier|"
    r"all_to_all\w*|send|recv|isend|irecv|scatter\w*|gather\w*)\(|from torch\.distributed import")


def _worker(rank: int, init_file: str) -> None:
    from miles_core.train.data_parallel import all_reduce_sums

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        strict.enforce_device_rule("cuda", [None])
        assert collectives.group_device(None) == torch.device("cuda")

        with pytest.raises(strict.DeviceRuleError, match=r"all_reduce got a tensor on cpu .* device is cuda"):
            dist.all_reduce(torch.ones(2), group=None)  # what today's all_reduce_sums did

        assert all_reduce_sums({"b": 2.0, "a": rank + 1.0}, dist.group.WORLD) == {"a": 3.0, "b": 4.0}

        mine = torch.full((2, 3), float(rank))
        parts = collectives.all_gather(mine, None)
        assert [p.device.type for p in parts] == ["cpu", "cpu"]
        assert all(torch.equal(p, torch.full((2, 3), float(r))) for r, p in enumerate(parts))
        with pytest.raises(strict.DeviceRuleError):  # handed back untagged: "on the CPU" again
            dist.all_reduce(parts[0], group=None)

        peak = torch.tensor([float(rank), -float(rank)])
        assert collectives.all_reduce(peak, None, op=dist.ReduceOp.MAX) is peak  # in place, like dist
        assert peak.tolist() == [1.0, 0.0]

        with pytest.raises(strict.DeviceRuleError, match="uint16"):
            collectives.all_reduce(torch.ones(2, dtype=torch.uint16), None)
        collectives.barrier()
    finally:
        dist.destroy_process_group()


def _rank(rank: int, tmp: str) -> None:
    try:
        _worker(rank, f"{tmp}/pg")
    except BaseException:
        Path(tmp, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _launch(tmp: str) -> None:
    """In a fresh (spawned) process: import torch once, then fork the ranks (no process group exists
    before the fork). Exits without interpreter teardown."""
    torch.set_num_threads(1)
    ranks = [mp.get_context("fork").Process(target=_rank, args=(r, tmp)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
        if p.is_alive():
            p.kill()
    os._exit(0 if all(p.exitcode == 0 for p in ranks) else 1)


def test_the_rank_setup_hook_is_called_with_the_groups_and_refuses_a_bad_name(monkeypatch):
    from miles_core.train import process_groups

    called = []
    monkeypatch.setattr(strict, "nccl_device_rule", called.append)
    monkeypatch.setenv(process_groups.RANK_SETUP_ENV, strict.HOOK)
    process_groups.run_rank_setup_hook(["g"])
    assert called == [["g"]]
    for bad, why in (("tests.support.strict_device", "module:function"),
                     ("tests.support.strict_device:no_such_hook", "has no function no_such_hook")):
        monkeypatch.setenv(process_groups.RANK_SETUP_ENV, bad)
        with pytest.raises(ValueError, match=why):
            process_groups.run_rank_setup_hook([None])
    monkeypatch.setenv(process_groups.RANK_SETUP_ENV, "")
    process_groups.run_rank_setup_hook([None])  # unset: nothing


def test_the_product_wraps_no_torch_distributed_function():
    """The device rule's checks patch torch.distributed; that is the test harness's
    (tests/support/strict_device.py), never the product's."""
    import ast

    for path in Path(miles_core.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                target = ast.unparse(node.args[0]) if node.args else ""
                assert target not in ("dist", "torch.distributed"), f"{path}: {ast.unparse(node)}"


def test_every_trainer_collective_goes_through_the_collectives_module():
    """Pins: no `dist.<collective>(` outside collectives.py in miles_core/train (also the paths no
    CPU test runs, such as the GPU branch of the trainer)."""
    here = Path(miles_core.train.__file__).parent
    direct = [f"{p.name}:{i}: {line.strip()}" for p in sorted(here.glob("*.py")) if p.name != "collectives.py"
              for i, line in enumerate(p.read_text().splitlines(), 1) if COLLECTIVE_CALL.search(line)]
    assert direct == []
    assert COLLECTIVE_CALL.search("        dist.all_reduce(t, group=group)")  # the pattern sees today's call
