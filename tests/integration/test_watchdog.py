"""NCCL's watchdog on CPU, and the checkpoint wait that must not trip it (tests/support/strict_device.py).

Two rank processes over gloo, the world standing for NCCL under the strict device harness, the
trainer's timeout (--distributed-timeout-minutes) cut to 2 s:
- a collective that waits past the timeout ends its rank's process (exit 134, a line on stderr), as
  NCCL's watchdog tears a GPU rank down; it is not an exception the caller could catch;
- a checkpoint whose writer (DP rank 0) uploads for longer than the timeout completes on both ranks:
  the waiting rank waits in the checkpoint group (gloo, its own long timeout), not in the trainer's.
  Guards: the non-writer ranks of a first 8B checkpoint killed by NCCL's 10-minute watchdog.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support import strict_device as strict
from tests.support.ranks import exit_launcher, run_launcher

TIMEOUT = timedelta(seconds=2)
SLOW = 6.0  # seconds rank 0 keeps the other waiting: three timeouts


def _init(rank: int, tmp: str) -> None:
    err = os.open(f"{tmp}/rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2, timeout=TIMEOUT)


def _ranks(target, tmp: str) -> None:
    """Fork both ranks, wait for them, write their exit codes; the launcher exits 0."""
    import multiprocessing as mp

    procs = [mp.get_context("fork").Process(target=target, args=(r, tmp)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    Path(tmp, "codes").write_text(" ".join(str(p.exitcode) for p in procs))
    exit_launcher(0)


def _late_barrier_rank(rank: int, tmp: str) -> None:
    from miles_core.train import collectives

    _init(rank, tmp)
    strict.enforce_device_rule("cuda", [None])
    if rank == 0:
        time.sleep(SLOW)  # never joins: rank 1's barrier passes the timeout
        os._exit(0)
    try:
        collectives.barrier()
    except BaseException:  # the watchdog must not let the caller see an exception
        Path(tmp, "rank1.caught").write_text(traceback.format_exc())
        os._exit(3)
    os._exit(4)  # the barrier returned: nothing waited


def _late_barrier_launcher(tmp: str) -> None:
    _ranks(_late_barrier_rank, tmp)


def test_a_collective_past_its_timeout_tears_the_rank_down(tmp_path):
    run_launcher(_late_barrier_launcher, str(tmp_path), 180, "the rank launcher")
    codes = (tmp_path / "codes").read_text().split()
    assert codes == ["0", str(strict.WATCHDOG_EXIT)], (codes, (tmp_path / "rank1.stderr").read_text()[-3000:])
    err = (tmp_path / "rank1.stderr").read_text()
    assert "watchdog: torch.distributed.barrier" in err and "tearing rank 1 down" in err, err[-3000:]


class _Trainer:
    """What CheckpointManager.save asks of a trainer: this rank's tensors and JSON meta."""

    def checkpoint_state(self):
        rank = dist.get_rank()
        return ({"model": {"w": torch.full((4,), float(rank))}, "optimizer": {"m": torch.zeros(2)},
                 "rng": {"torch_cpu": torch.get_rng_state()}}, {"rank": rank})


def _checkpoint_rank(rank: int, tmp: str) -> None:
    from miles_core.storage import Store
    from miles_core.train import checkpoint
    from miles_core.train.process_groups import ensure_process_groups, trainer_groups

    try:
        _init(rank, tmp)
        ensure_process_groups(1, timeout_minutes=TIMEOUT.total_seconds() / 60)  # DP=2
        strict.enforce_device_rule("cuda", trainer_groups())
        if rank == 0:  # the writer's upload outlasts the trainer's timeout
            real = checkpoint.put_tensors

            def slow(*args, **kwargs):
                time.sleep(SLOW / 3)
                return real(*args, **kwargs)

            checkpoint.put_tensors = slow
        manager = checkpoint.CheckpointManager(Store(f"file://{tmp}/ckpt"), interval=1)
        uri = manager.save(0, _Trainer(), {"note": "x"})
        Path(tmp, f"rank{rank}.saved").write_text(uri)
    except BaseException:
        Path(tmp, f"rank{rank}.caught").write_text(traceback.format_exc())
        os._exit(3)
    os._exit(0)


def _checkpoint_launcher(tmp: str) -> None:
    _ranks(_checkpoint_rank, tmp)


def test_a_checkpoint_upload_longer_than_the_timeout_keeps_the_waiting_rank(tmp_path):
    run_launcher(_checkpoint_launcher, str(tmp_path), 180, "the rank launcher")
    codes = (tmp_path / "codes").read_text().split()
    errors = {p.name: p.read_text()[-3000:] for p in tmp_path.glob("rank*.caught")}
    assert codes == ["0", "0"], (codes, errors, (tmp_path / "rank1.stderr").read_text()[-3000:])
    assert (tmp_path / "ckpt" / "step_00000000" / "COMPLETE").exists() or list(
        (tmp_path / "ckpt" / "step_00000000").glob("*COMPLETE*")), sorted(os.listdir(tmp_path / "ckpt"))
