"""Rank processes for multi-rank tests on CPU: fork `target(*args)` once per entry of `args_list`,
wait for all of them, and raise naming the exit codes unless every one exited 0. Used from a
spawned launcher process that imported Megatron once, so the forked ranks inherit it."""

from __future__ import annotations

import os
import sys

import torch.multiprocessing as mp

FORK_RANKS_SECONDS = 120  # fork_ranks' bound when the test names none: small gloo ranks, to their end


def fork_ranks(target, args_list: list[tuple], timeout: float = FORK_RANKS_SECONDS) -> None:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=target, args=args) for args in args_list]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    if codes != [0] * len(procs):
        raise RuntimeError(f"rank processes exited with {codes}")


def run_launcher(target, tmp: str, timeout: float, what: str = "the trainer processes") -> None:
    """Run `target(tmp)` in a fresh spawned process (it imports Megatron once, then forks the ranks with
    `fork_ranks`) and wait; killed past `timeout`; assert it exited 0, naming `what` failed."""
    launcher = mp.get_context("spawn").Process(target=target, args=(tmp,))
    launcher.start()
    launcher.join(timeout)
    if launcher.is_alive():
        launcher.kill()
    assert launcher.exitcode == 0, f"{what} failed (exit code {launcher.exitcode}); see stderr"


def exit_launcher(code: int = 0) -> None:
    """End a launcher process without interpreter teardown (Megatron's and gloo's would hang or print)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
