"""`miles runs list`, `miles buffer inspect --ids` and `miles lineage` on a small run root built here
(tests/support/small_run.py: a rejected group, a retired snapshot).

Pins: runs list names every run of a storage root with its state, steps of --num-rollout and last
update (a run that never started a segment too); --ids lists every group with its fate and step,
including a group whose object was deleted after consumption; lineage of a rejected group claims
no checkpoint, snapshot or eval, and for a trained group names the first snapshot that included
its step even when that snapshot was retired (its eval result remains).
"""

from __future__ import annotations

import json

from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.storage import Store
from miles_core.storage.run_root import write_config
from tests.support.small_run import small_run


def _json(capsys, argv: list[str]):
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_runs_list_names_every_run_with_state_steps_and_update(tmp_path, capsys):
    run = small_run(tmp_path)
    small_run(tmp_path, "a-second")
    fresh = parse_flags(["--preset", "tiny-reverse4", "--storage-root", run.storage_root, "--run-id", "fresh"])
    write_config(Store(fresh.run_uri), fresh)  # a run that never started a segment
    runs = _json(capsys, ["runs", "list", "--json", run.storage_root])
    assert [r["run_id"] for r in runs] == ["a-second", "fresh", "r"]
    r = runs[2]
    assert (r["state"], r["steps_done"], r["num_rollout"], r["run_uri"]) == ("segment_done", 2, 4, run.uri)
    assert r["updated_at"] > 0 and runs[1]["state"] == "not started" and runs[1]["num_rollout"] == 160
    assert main(["runs", "list", run.storage_root.removeprefix("file://")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "STEPS", "LAST", "UPDATE"] and lines[3].split()[:3] == \
        ["r", "segment_done", "2/4"]


def test_runs_list_of_an_empty_storage_root(tmp_path, capsys):
    assert main(["runs", "list", str(tmp_path)]) == 0
    assert "no runs under" in capsys.readouterr().out


def test_buffer_ids_list_each_group_with_its_fate(tmp_path, capsys):
    run = small_run(tmp_path)
    rows = _json(capsys, ["buffer", "inspect", run.uri, "--ids", "--json"])
    fates = {r["group_id"]: (r["status"], r["step"], r["stored"]) for r in rows}
    assert fates == {"g0000": ("rejected", 0, True), "g0001": ("rejected", 0, True), "g0002": ("consumed", 0, True),
                     "g0003": ("consumed", 1, True), "g0004": ("available", None, True)}
    assert main(["buffer", "inspect", run.uri, "--ids"]) == 0
    assert "g0004  available  -" in capsys.readouterr().out
    counts = _json(capsys, ["buffer", "inspect", run.uri])  # without --ids: the counts, as before
    assert (counts["committed"], counts["consumed"], counts["rejected"], counts["available"]) == (5, 2, 2, 1)


def test_buffer_ids_include_groups_whose_object_is_gone(tmp_path, capsys):
    run = small_run(tmp_path)
    store = Store(run.uri)
    manifest = store.get_json("buffer/consumed/00000001.json")
    store.put_json("buffer/consumed/00000001.json", {**manifest, "consumed": [*manifest["consumed"], "g0099"]})
    rows = _json(capsys, ["buffer", "inspect", run.uri, "--ids", "--json"])
    assert rows[-1] == {"group_id": "g0099", "status": "consumed", "step": 1, "stored": False}


def test_lineage_of_a_rejected_group_claims_no_checkpoint_or_snapshot(tmp_path, capsys):
    """Guards: a rejected group printed with the checkpoint and snapshot "that include it"."""
    run = small_run(tmp_path)
    t = _json(capsys, ["lineage", run.uri, run.rejected[0], "--json"])
    assert t["fate"] == {"step": 0, "outcome": "rejected"}
    assert (t["checkpoint"], t["snapshot"], t["eval"]) == (None, None, {})
    assert main(["lineage", run.uri, run.rejected[0]]) == 0
    text = capsys.readouterr().out
    assert "rejected     at step 0" in text and "never trained" in text and "includes it)" not in text


def test_lineage_names_the_first_snapshot_even_when_retired(tmp_path, capsys):
    """Guards: naming a later snapshot (79) when the first that included the step (39) was evaluated,
    then retired."""
    run = small_run(tmp_path)
    t = _json(capsys, ["lineage", run.uri, run.trained[0], "--json"])
    assert (t["fate"]["step"], t["checkpoint"], t["snapshot"], t["snapshot_retired"]) == (0, 1, 0, True)
    later = _json(capsys, ["lineage", run.uri, run.trained[1], "--json"])
    assert (later["snapshot"], later["snapshot_retired"]) == (1, False)
    assert main(["lineage", run.uri, run.trained[0]]) == 0
    assert "snapshot     step 0 (the first that includes it; retired since" in capsys.readouterr().out
