"""Finished is final, at its exact boundary (`run_training`, docs/training.md), without Ray: the segment
itself (`_run_segment`, which would start the cluster) is a stand-in.

The rule: a run whose STATUS.json says `finished` at `last_step` returns that outcome at once (no
write, no cluster) while `last_step >= --num-rollout - 1`; raising --num-rollout continues it from
`last_step + 1` up to the new `--num-rollout - 1`, and the segment that reaches that step marks the
run finished again.

Pins, on a run finished at step 4 (--num-rollout 5): --num-rollout 5 again is a no-op (finished,
0 steps, STATUS byte-identical, the segment never runs); --num-rollout 6, raised by exactly one,
is accepted and trains exactly one step (step 5: the real `_end_step` and `run_loop` over stand-in
roles), after which STATUS says finished at 5 under segment 1; running --num-rollout 6 once more is
then a no-op.

Guards: an off-by-one in the finished check (`< num_rollout - 2`, or `<=`): raised by one, the run
would be reported finished without training (or a finished run trained again at the same target);
and the end-of-segment state (`== num_rollout - 1`) mis-marking the one-step segment.
"""

from __future__ import annotations

import sys

import pytest

from miles_core.config import RunConfig, embedded_default, replace_fields
from miles_core.driver.loop import run_loop
from miles_core.driver.segment import run_training
from miles_core.storage import Store, run_root
from tests.unit.test_driver_loop import Recorder, build_roles


def _cfg(tmp_path, **kw) -> RunConfig:
    return replace_fields(embedded_default(), storage_root=str(tmp_path), run_id="r", lease_ttl_seconds=2.0,
                          lease_renew_seconds=0.5, **kw)


@pytest.fixture
def segments(monkeypatch):
    """`_run_segment` without Ray: it resumes at the step after the last one trained (where the
    latest checkpoint resumes; the run below finished at step 4), ends where the real `_end_step`
    says, and runs the real loop over recorded stand-in roles. Returns the trained steps of each
    segment run."""
    runs: list[list[int]] = []
    checkpoint = {"next_step": 5}
    segment_module = sys.modules[run_training.__module__]  # where run_training looks up _run_segment

    def fake_run_segment(cfg, store, segment, lease, *_):
        start = checkpoint["next_step"]
        end, reason = segment_module._end_step(cfg.run, start)
        rec = Recorder()
        roles, _ = build_roles(rec, start=start, end=end, end_reason=reason)
        result = run_loop(roles)
        runs.append([e[1] for e in rec.log if e[0] == "train_step"])
        if result.last_step is not None:
            checkpoint["next_step"] = result.last_step + 1
        return result, 7

    monkeypatch.setattr(segment_module, "_run_segment", fake_run_segment)
    return runs


def test_a_finished_run_continued_with_num_rollout_plus_one_trains_exactly_one_step(tmp_path, segments):
    """Pins the finished-is-final boundary: same --num-rollout is a no-op, +1 trains exactly one more
    step; guards against an off-by-one in the finished check (e.g. `< num_rollout - 2`)."""
    store = Store(_cfg(tmp_path).run_uri)
    run_root.write_config(store, {"run": {"num_rollout": 5}}, 0)
    run_root.write_status(store, run_root.FINISHED, last_step=4, segment=0)

    before = store.get_bytes(run_root.STATUS_KEY)
    same = run_training(_cfg(tmp_path, num_rollout=5))
    assert (same.state, same.last_step, same.steps_run) == (run_root.FINISHED, 4, 0)
    assert segments == [] and store.get_bytes(run_root.STATUS_KEY) == before
    assert not store.exists("config_segment_0001.json")

    more = run_training(_cfg(tmp_path, num_rollout=6))
    assert segments == [[5]], f"--num-rollout raised by one trained steps {segments}, expected [[5]]"
    assert (more.state, more.first_step, more.last_step, more.steps_run) == (run_root.FINISHED, 5, 5, 1)
    status = run_root.read_status(store)
    assert (status.state, status.last_step, status.segment) == (run_root.FINISHED, 5, 1)
    assert store.exists("config_segment_0001.json")

    again = run_training(_cfg(tmp_path, num_rollout=6))
    assert (again.state, again.last_step, again.steps_run) == (run_root.FINISHED, 5, 0)
    assert segments == [[5]]
