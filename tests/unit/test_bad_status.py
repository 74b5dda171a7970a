"""A STATUS.json that does not parse, on small run roots built here. Pins: it is rebuilt from the
config records, checkpoints and consumption manifests (segment_done, or finished when the resumable
step reaches --num-rollout - 1), says so in its message, and the plan, `miles runs show` and the next
segment's number all work from it; nothing is written by reading."""

from __future__ import annotations

import json

import pytest

from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.driver.plan import describe_plan, is_finished
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, SEGMENT_DONE, STATUS_KEY, next_segment, read_status, write_config


def _run_root(tmp_path, *flags: str, checkpoint: int | None, manifests: int, segments: int = 1) -> tuple:
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r", *flags])
    store = Store(cfg.run_uri)
    for segment in range(segments):
        write_config(store, cfg, segment)
    if checkpoint is not None:
        store.put_bytes(f"checkpoints/step_{checkpoint:08d}/COMPLETE", b"{}")
    for step in range(manifests):
        store.put_json(f"buffer/consumed/{step:08d}.json", {"step": step, "consumed": [], "rejected": []})
    store.put_bytes(STATUS_KEY, b'{"state": "runn')
    return cfg, store


@pytest.mark.parametrize("bad", [b'{"state": "runn', b"", b"[]", b'{"state": "running", "last_step": "x"}'])
def test_a_bad_status_is_rebuilt_as_segment_done_from_checkpoints_and_manifests(tmp_path, bad):
    cfg, store = _run_root(tmp_path, checkpoint=3, manifests=5, segments=2)
    store.put_bytes(STATUS_KEY, bad)
    status = read_status(store)
    assert (status.state, status.last_step, status.segment) == (SEGMENT_DONE, 4, 1)
    assert "rebuilt" in status.message and "STATUS.json does not parse" in status.message
    assert next_segment(store) == 2 and not is_finished(cfg.run, status)
    assert "resuming after step 4 (segment 2)" in describe_plan(cfg)
    assert store.get_bytes(STATUS_KEY) == bad  # reading writes nothing


def test_a_missing_status_of_a_run_with_history_is_rebuilt_and_a_new_run_has_none(tmp_path):
    """The next segment of a run whose STATUS.json is gone numbers itself after the recorded segments (never
    segment 0, over config.json), and the plan says it resumes; a run that never started has no status."""
    cfg, store = _run_root(tmp_path, checkpoint=3, manifests=5, segments=2)
    store.delete(STATUS_KEY)
    status = read_status(store)
    assert (status.state, status.last_step, status.segment) == (SEGMENT_DONE, 4, 1)
    assert "STATUS.json is missing" in status.message and next_segment(store) == 2
    assert "resuming after step 4 (segment 2)" in describe_plan(cfg) and not store.exists(STATUS_KEY)
    new = Store(f"file://{tmp_path}/runs/new")
    write_config(new, cfg)
    assert read_status(new) is None and next_segment(new) == 0


def test_a_bad_status_of_a_run_checkpointed_at_its_last_step_is_finished(tmp_path):
    cfg, store = _run_root(tmp_path, "--num-rollout", "4", checkpoint=3, manifests=4)
    status = read_status(store)
    assert (status.state, status.last_step, status.segment) == (FINISHED, 3, 0) and is_finished(cfg.run, status)
    assert "already finished" in describe_plan(cfg)


def test_manifests_past_the_last_checkpoint_do_not_finish_the_run(tmp_path):
    cfg, store = _run_root(tmp_path, "--num-rollout", "4", checkpoint=2, manifests=4)
    status = read_status(store)
    assert (status.state, status.last_step) == (SEGMENT_DONE, 3)  # step 3 was never checkpointed


def test_without_checkpoints_the_manifests_decide(tmp_path):
    none = ("--save", "", "--save-interval", "")
    _, store = _run_root(tmp_path, *none, checkpoint=None, manifests=0)
    status = read_status(store)
    assert (status.state, status.last_step, status.segment) == (SEGMENT_DONE, -1, 0)
    _, store = _run_root(tmp_path, *none, "--num-rollout", "4", checkpoint=None, manifests=4)
    assert (read_status(store).state, read_status(store).last_step) == (FINISHED, 3)


def test_runs_show_reads_a_rebuilt_status(tmp_path, capsys):
    cfg, _ = _run_root(tmp_path, checkpoint=3, manifests=5)
    assert main(["runs", "show", cfg.run_uri, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["status"]
    assert (s["state"], s["last_step"]) == (SEGMENT_DONE, 4) and "rebuilt" in s["message"]
