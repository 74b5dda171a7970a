"""A small run root written directly (no training), for the `miles` inspection commands' tests.

    run = small_run(tmp_path)   # SmallRun(uri, storage_root, trained, rejected, available)

Five groups g0000..g0004 (token versions i, i+1) are committed with --max-weight-staleness 1. Step 0
takes them at weight version 3: g0000 and g0001 are too stale (rejected), g0002 is trained; step 1
trains g0003; g0004 stays available. Step 0's snapshot was exported, evaluated and retired (only its
eval result names it); step 1's snapshot and checkpoint are complete. STATUS: segment_done at step 1
of --num-rollout 4.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.config import parse_flags
from miles_core.eval.results import EvalResult, write_result
from miles_core.storage import Store
from miles_core.storage.run_root import SEGMENT_DONE, write_config, write_status
from tests.integration.test_buffer_durable import make_group


@dataclass(frozen=True)
class SmallRun:
    uri: str
    storage_root: str
    trained: dict[int, str]  # step -> the group it trained
    rejected: list[str]      # rejected at step 0
    available: str


def small_run(tmp_path, run_id: str = "r") -> SmallRun:
    root = f"file://{tmp_path}"
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", root, "--run-id", run_id, "--num-rollout", "4", "--max-weight-staleness", "1"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1,
                            max_weight_staleness=1) as buf:
        for i in range(5):
            buf.put(make_group(i, version=i))
        trained = {}
        for step in (0, 1):
            trained[step] = buf.get(current_version=3).group_id
            buf.record_consumed(step, [trained[step]])
    store.put_bytes("snapshots/step_00000001/.complete", b"")
    store.put_bytes("checkpoints/step_00000001/COMPLETE", b"")
    for step in (0, 1):
        write_result(store, EvalResult(step, "held", {"eval/held": 0.25 * (step + 1)},
                                       snapshot_uri=f"{cfg.run_uri}/snapshots/step_{step:08d}"))
    write_status(store, SEGMENT_DONE, last_step=1, segment=0)
    return SmallRun(cfg.run_uri, root, trained, ["g0000", "g0001"], "g0004")
