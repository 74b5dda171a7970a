"""`miles runs show` and `miles lineage` on a small run root built here (the real-run check is in
tests/e2e/test_pyflyte_run.py). Pins: the summary and a group's lineage come from the run root's
files (status, segments, lease, buffer, manifests, evals); a missing run or group id is a clear
error with exit 1, never an empty answer."""

from __future__ import annotations

import json

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.eval.results import EvalResult, write_result
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, write_config, write_status
from tests.integration.test_buffer_durable import make_group


def _run_root(tmp_path) -> str:
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    write_config(store, cfg, 1)
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1) as buf:
        for i in range(3):
            buf.put(make_group(i, version=i))
        got = [buf.get().group_id for _ in range(2)]
        buf.record_consumed(0, got[:1])
        buf.record_consumed(1, got[1:])
    for step in (0, 2):
        write_result(store, EvalResult(step, "held", {"eval/held": 0.25 * (step + 1)}))
    write_status(store, FINISHED, last_step=1, segment=1)
    return cfg.run_uri


def test_runs_show_summarises_the_run_root(tmp_path, capsys):
    uri = _run_root(tmp_path)
    assert main(["runs", "show", uri, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["status"]["state"] == "finished" and [g["segment"] for g in s["segments"]] == [0, 1]
    assert (s["buffer"]["committed"], s["buffer"]["consumed"], s["buffer"]["available"]) == (3, 2, 1)
    assert s["eval"] == {"held": [{"step": 0, "mean_reward": 0.25}, {"step": 2, "mean_reward": 0.75}]}
    assert s["checkpoints"]["steps"] == [] and s["lease"] is None
    assert main(["runs", "show", uri]) == 0
    text = capsys.readouterr().out
    assert "steps        2 of 160 trained" in text and "3 groups committed, 2 consumed" in text
    assert "eval held    step 0: 0.250, step 2: 0.750" in text


def test_lineage_names_the_consuming_step_the_versions_and_the_evals_around_it(tmp_path, capsys):
    uri = _run_root(tmp_path)
    manifest = Store(uri).get_json("buffer/consumed/00000001.json")
    gid = manifest["consumed"][0]
    assert main(["lineage", uri, gid, "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    version = int(gid[1:])
    assert t["fate"] == {"step": 1, "outcome": "consumed"}
    assert [s["versions"] for s in t["samples"]] == [{str(version): 1, str(version + 1): 1}] * 2
    assert t["eval"] == {"held": {"before": {"step": 0, "mean_reward": 0.25}, "after": {"step": 2, "mean_reward": 0.75}}}
    assert main(["lineage", uri, gid]) == 0
    assert "consumed     trained at step 1" in capsys.readouterr().out


def test_a_missing_run_or_group_is_a_clear_error(tmp_path, capsys, monkeypatch):
    uri = _run_root(tmp_path)
    assert main(["lineage", uri, "g0009"]) == 1
    err = capsys.readouterr().err
    assert "no group 'g0009'" in err and "close: g000" in err
    assert main(["runs", "show", f"file://{tmp_path}/runs/typo"]) == 1
    assert "no run at" in capsys.readouterr().err
    assert main(["lineage", f"file://{tmp_path}/runs/typo", "g0000"]) == 1
    capsys.readouterr()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # `runs list` defaults to the root a run uses: ./.miles, absent here
    assert main(["runs", "list"]) == 1
    assert "no storage root at" in capsys.readouterr().err


def test_runs_show_says_a_lease_record_that_does_not_parse(tmp_path, capsys):
    """One bad file never stops the summary: a garbage LEASE.json is shown as unreadable, with the fix."""
    uri = _run_root(tmp_path)
    Store(uri).put_bytes("LEASE.json", b"<html>503</html>")
    assert main(["runs", "show", uri, "--json"]) == 0
    lease = json.loads(capsys.readouterr().out)["lease"]
    assert "LEASE.json is not a lease record" in lease["error"] and "miles doctor" in lease["error"]
    assert main(["runs", "show", uri]) == 0
    assert "lease        unreadable: " in capsys.readouterr().out
