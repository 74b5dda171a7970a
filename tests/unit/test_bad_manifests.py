"""A consumption manifest that does not parse (truncated, empty, garbage), on a small run root built
here. Pins: `miles runs show`, `miles buffer inspect` and `miles lineage` keep working and say which
step's manifest is bad instead of counting wrong silently; groups the compaction record covers are
counted as consumed or rejected (step unknown); a resume through a bad manifest after the compaction
refuses with the file and the fix, and one that restarts before it opens; fork and replay refuse by name.
An eval result that does not parse is skipped with a warning by `runs show` and `lineage`."""

from __future__ import annotations

import json

import pytest

from miles_core.buffer import DataBufferError, DropUnused, DurableBuffer
from miles_core.buffer.objects import consumed_key
from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.eval.results import EvalResult, result_key, write_result
from miles_core.lineage.recorded import LineageError, RecordedRun
from miles_core.storage import Store
from miles_core.storage.run_root import SEGMENT_DONE, write_config, write_status
from tests.integration.test_buffer_durable import make_group

BAD = {"truncated": b'{"step": 0, "consumed": ["g00', "empty": b"", "garbage": b"\x00\xffnot json",
       "not a manifest": b"[1, 2]"}


def _run_root(tmp_path, bad: bytes = BAD["truncated"]) -> tuple[str, dict[int, str]]:
    """Steps 0-3 consume one group each, compaction through step 1; steps 0 (covered) and 3 (after
    the compaction) then have a bad manifest. Returns (run uri, step -> the group it consumed)."""
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    by_step = {}
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1) as buf:
        for i in range(5):
            buf.put(make_group(i))
        for step in range(4):
            by_step[step] = buf.get().group_id
            buf.record_consumed(step, [by_step[step]])
            if step == 1:
                buf.compact(1)
    write_status(store, SEGMENT_DONE, last_step=3, segment=0)
    for step in (0, 3):
        store.put_bytes(consumed_key(step), bad)
    return cfg.run_uri, by_step


@pytest.mark.parametrize("kind", sorted(BAD))
def test_runs_show_counts_around_a_bad_manifest_and_names_it(tmp_path, capsys, kind):
    uri, _ = _run_root(tmp_path, BAD[kind])
    assert main(["runs", "show", uri, "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["buffer"]
    assert (b["committed"], b["consumed"], b["consumed_or_rejected_unattributed"], b["available"]) == (5, 2, 1, 2)
    assert [(r["step"], r["covered_by_compaction"]) for r in b["unreadable_manifests"]] == [(0, True), (3, False)]
    assert b["unreadable_manifests"][0]["key"].endswith("buffer/consumed/00000000.json")
    assert main(["runs", "show", uri]) == 0
    text = capsys.readouterr().out
    assert "+ 1 consumed or rejected at steps whose manifest does not parse (0;" in text
    assert "manifests of steps 3 do not parse (after the last compaction)" in text


def test_buffer_inspect_ids_marks_the_unattributed_group(tmp_path, capsys):
    uri, by_step = _run_root(tmp_path)
    assert main(["buffer", "inspect", uri, "--ids", "--json"]) == 0
    rows = {r["group_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[by_step[0]]["status"] == "consumed_or_rejected" and rows[by_step[0]]["step"] is None
    assert (rows[by_step[2]]["status"], rows[by_step[2]]["step"]) == ("consumed", 2)
    assert rows[by_step[3]]["status"] == "available"  # unknown: named in the buffer line of `runs show`


def test_lineage_works_for_other_groups_and_says_which_step_is_missing(tmp_path, capsys):
    uri, by_step = _run_root(tmp_path)
    assert main(["lineage", uri, by_step[2], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fate"] == {"step": 2, "outcome": "consumed"}
    assert main(["lineage", uri, by_step[0], "--json"]) == 0
    fate = json.loads(capsys.readouterr().out)["fate"]
    assert fate == {"step": None, "outcome": "unknown", "unreadable_steps": [0], "consumed_or_rejected": True}
    assert main(["lineage", uri, by_step[3]]) == 0
    assert "manifests of steps 3 do not parse" in capsys.readouterr().out


def test_resume_through_a_bad_manifest_after_the_compaction_refuses_with_the_fix(tmp_path):
    uri, _ = _run_root(tmp_path)
    with pytest.raises(DataBufferError, match=r"00000003\.json.*resume from the checkpoint before that step"):
        DurableBuffer.open(Store(uri), capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=3)


def test_resume_over_a_compaction_record_that_does_not_parse_refuses_with_the_fix(tmp_path):
    uri, _ = _run_root(tmp_path)
    Store(uri).put_bytes("buffer/compacted/upto_00000001.json", b'{"through_step": 1, "objects_')
    with pytest.raises(DataBufferError, match=r"compaction record .*upto_00000001\.json does not parse .*"
                                              r"`miles doctor .* --repair` moves it aside"):
        DurableBuffer.open(Store(uri), capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=2)


def test_resume_before_the_bad_manifest_opens_and_ignores_the_covered_one(tmp_path):
    uri, by_step = _run_root(tmp_path)
    with DurableBuffer.open(Store(uri), capacity_groups=8, unused_handler=DropUnused(),
                            consumed_through_step=2) as buf:
        available = set(buf.available_group_ids())
    assert available == {by_step[3], "g0004"}  # step 3 is trained again after the restored step 2
    assert not Store(uri).exists(consumed_key(3))


def test_fork_or_replay_through_a_bad_manifest_refuses_by_name(tmp_path):
    uri, _ = _run_root(tmp_path)
    run = RecordedRun.open(uri)
    with pytest.raises(LineageError, match=r"00000000\.json is not valid JSON.*fork or replay an earlier step"):
        run.manifests(2)
    assert [m["step"] for m in run.manifests(2, start=1)] == [1, 2]


def test_a_bad_eval_result_is_skipped_by_runs_show_and_lineage(tmp_path, capsys, caplog):
    uri, by_step = _run_root(tmp_path)
    store = Store(uri)
    write_result(store, EvalResult(2, "held", {"eval/held": 0.5}))
    store.put_bytes(result_key(1, "held"), b'{"step": 1, "data')
    assert main(["runs", "show", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval"] == {"held": [{"step": 2, "mean_reward": 0.5}]}
    assert "held.json skipped: it does not parse" in caplog.text
    assert main(["lineage", uri, by_step[2], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval"]["held"]["after"] == {"step": 2, "mean_reward": 0.5}
