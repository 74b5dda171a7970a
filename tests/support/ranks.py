"""Rank processes for multi-rank tests on CPU: fork `target(*args)` once per entry of `args_list`,
wait for all of them, and raise naming the exit codes unless every one exited 0. Used from a
spawned launcher process that imported Megatron once, so the forked ranks inherit it."""

from __future__ import annotations

import torch.multiprocessing as mp


def fork_ranks(target, args_list: list[tuple], timeout: float = 120) -> None:
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
