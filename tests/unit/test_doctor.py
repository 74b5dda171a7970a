"""`miles doctor RUN_URI [--repair]` on damaged run roots built here (file://).

The run root: 8 groups committed one object each (seq 0..7), steps 0..3 consume g0000..g0003, checkpoints
(with real COMPLETE manifests) at steps 1 and 3, a compaction through step 1, a complete snapshot and an eval
result of step 1, a released lease, STATUS segment_done at step 3.

Pins: a clean root has no warning and exits 0; each damage kind gets its finding, severity and exit status
(0 when the run can continue as it is, 1 when it cannot); --repair rebuilds STATUS and a covered manifest,
moves what it removes under quarantine/doctor/{time}/ (an undecodable object to buffer/quarantine/) with the
same bytes, never touches a committed group or a complete checkpoint, refuses under a live lease, and the
check after it says what remains. A rebuilt manifest is read as "taken" by a buffer reopen, as "consumed or
rejected at step k" by `runs show` and lineage, and refused by fork and replay.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.eval.results import EvalResult, write_result
from miles_core.lineage.doctor import QUARANTINE, RepairRefused, diagnose, repair
from miles_core.lineage.fork import fork_run
from miles_core.lineage.recorded import LineageError, RecordedRun
from miles_core.storage import Store
from miles_core.storage.lease import LEASE_KEY, Lease, LeaseRecord
from miles_core.storage.run_root import SEGMENT_DONE, read_status, write_config, write_status
from miles_core.train.checkpoint import CheckpointManager
from tests.integration.test_buffer_durable import make_group

GROUPS = "buffer/groups"


class FakeTrainer:
    def __init__(self, value: float):
        self.value = value

    def checkpoint_state(self):
        t = {"w": torch.full((16,), self.value)}
        return {"model": t, "optimizer": {"m": t["w"] * 2}, "rng": {"s": torch.arange(4)}}, {"value": self.value}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doctor-template")
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{root}", "--run-id", "r", "--num-rollout", "8"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    mgr = CheckpointManager.from_config(cfg.train, store)
    with DurableBuffer.open(store, capacity_groups=16, unused_handler=DropUnused(), consumed_through_step=-1) as buf:
        for i in range(8):
            buf.put(make_group(i))
        for step in range(4):
            buf.record_consumed(step, [buf.get().group_id])
            if step in (1, 3):
                mgr.save(step, FakeTrainer(float(step)), {"consumed_through_step": step})
            if step == 1:
                buf.compact(1)
    store.put_bytes("snapshots/step_00000001/.complete", b"")
    write_result(store, EvalResult(1, "held", {"eval/held": 0.5}, snapshot_uri=f"{cfg.run_uri}/snapshots/step_00000001"))
    with Lease.acquire(store, ttl_seconds=60):
        pass
    write_status(store, SEGMENT_DONE, last_step=3, segment=0)
    return root / "runs" / "r"


@pytest.fixture
def run(template, tmp_path) -> Path:
    """A fresh copy of the template run root (its path)."""
    dest = tmp_path / "runs" / "r"
    shutil.copytree(template, dest)
    return dest


def uri(run: Path) -> str:
    return f"file://{run}"


def objects(run: Path) -> list[Path]:
    return sorted((run / GROUPS).rglob("*.arrow"))


def kinds(report, severity: str | None = None) -> list[str]:
    return sorted(f.kind for f in report.findings if severity is None or f.severity == severity)


def doctor(run: Path, capsys, *args: str) -> tuple[int, dict]:
    status = main(["doctor", uri(run), "--json", *args])
    return status, json.loads(capsys.readouterr().out)


def quarantined(run: Path, key: str) -> Path:
    """The one copy of `key` under quarantine/doctor/{time}/."""
    found = sorted((run / QUARANTINE).glob(f"*/{key}"))
    assert len(found) == 1, (key, sorted((run / QUARANTINE).rglob("*")))
    return found[0]


def snapshot_of_kept(run: Path) -> dict[str, bytes]:
    """The bytes of every committed group object that decodes and of every complete checkpoint's files."""
    kept = {str(p.relative_to(run)): p.read_bytes() for p in objects(run) if p.name != "000000000006.arrow"}
    for marker in (run / "checkpoints").glob("step_*/COMPLETE"):
        kept.update({str(p.relative_to(run)): p.read_bytes() for p in marker.parent.iterdir()})
    return kept


# ----------------------------------------------------------------------------- check


def test_a_clean_run_root_is_fine(run, capsys):
    status, out = doctor(run, capsys)
    assert status == 0 and out["can_continue"] and out["errors"] == 0 and out["warnings"] == 0, out
    assert {"config", "status", "lease", "checkpoints", "latest", "manifests", "group-objects", "eval-results",
            "snapshots"} <= {f["kind"] for f in out["findings"]}
    assert main(["doctor", uri(run)]) == 0
    text = capsys.readouterr().out
    assert "0 errors, 0 warnings: the run can continue as it is" in text and "a resume starts after step 3" in text


@pytest.mark.parametrize("bad", [b'{"state": "segm', b"", b"\x00garbage"])
def test_a_bad_status_is_a_warning_and_repair_rebuilds_it(run, capsys, bad):
    (run / "STATUS.json").write_bytes(bad)
    report = diagnose(uri(run))
    [f] = [f for f in report.findings if f.kind == "status"]
    assert f.severity == "warning" and "does not parse" in f.what and "segment_done after step 3" in f.meaning
    assert report.can_continue and main(["doctor", uri(run)]) == 0
    capsys.readouterr()
    after = repair(uri(run))
    assert [r["action"] for r in after.repairs] == ["rebuilt"] and kinds(after, "warning") == []
    status = read_status(Store(uri(run)))
    assert (status.state, status.last_step, status.segment) == (SEGMENT_DONE, 3, 0) and "rebuilt" in status.message
    assert quarantined(run, "STATUS.json").read_bytes() == bad


def test_a_missing_status_in_a_run_with_history_is_rebuilt(run):
    (run / "STATUS.json").unlink()
    report = diagnose(uri(run))
    assert [(f.kind, f.severity) for f in report.findings if f.kind == "status"] == [("status", "warning")]
    repair(uri(run))
    assert read_status(Store(uri(run))).last_step == 3


def test_a_garbage_config_is_an_error_repair_leaves_in_place(run, capsys):
    (run / "config.json").write_bytes(b"\x00\x01 not json")
    status, out = doctor(run, capsys)
    assert status == 1 and not out["can_continue"]
    [f] = [f for f in out["findings"] if f["kind"] == "config"]
    assert f["severity"] == "error" and f["key"].endswith("/config.json") and "restore it from a backup" in f["fix"]
    assert f["repair"] is None
    status, out = doctor(run, capsys, "--repair")
    assert status == 1 and (run / "config.json").read_bytes() == b"\x00\x01 not json"


def test_a_bad_segment_config_is_a_warning_and_moved_aside(run, capsys):
    (run / "config_segment_0001.json").write_bytes(b'{"segment": 1, "config": {"trai')
    report = diagnose(uri(run))
    [f] = [f for f in report.findings if f.kind == "config"]
    assert f.severity == "warning" and f.key.endswith("config_segment_0001.json") and f.repair is not None
    repair(uri(run))
    assert not (run / "config_segment_0001.json").exists()
    assert quarantined(run, "config_segment_0001.json").read_bytes() == b'{"segment": 1, "config": {"trai'
    assert RecordedRun.open(uri(run)).cfg.run.num_rollout == 8  # readers work again


def test_latest_to_a_missing_step_is_a_warning(run, capsys):
    (run / "checkpoints" / "LATEST").write_bytes(b"step_00000009")
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "latest"]
    assert status == 0 and f["severity"] == "warning" and "step_00000009" in f["what"]
    assert "the run does not read it" in f["meaning"]


@pytest.mark.parametrize("damage", ["missing", "wrong size"])
def test_a_damaged_newest_checkpoint_is_a_warning_naming_the_fallback(run, capsys, damage):
    model = run / "checkpoints" / "step_00000003" / "model.safetensors"
    if damage == "missing":
        model.unlink()
    else:
        model.write_bytes(model.read_bytes()[:-10])
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "checkpoint"]
    assert status == 0 and f["severity"] == "warning" and f["key"].endswith("checkpoints/step_00000003")
    assert ("missing file model.safetensors" if damage == "missing" else "model.safetensors: size") in f["what"]
    assert "falls back to step 1: steps 2..3 are trained again" in f["meaning"]
    # step 3's manifest is after the resume step now: deleted on resume, not an error
    assert out["errors"] == 0


def test_no_checkpoint_that_verifies_is_an_error(run, capsys):
    for step in (1, 3):
        (run / "checkpoints" / f"step_{step:08d}" / "optimizer.safetensors").unlink()
    status, out = doctor(run, capsys)
    assert status == 1 and [f["severity"] for f in out["findings"] if f["kind"] == "checkpoint"] == ["error"] * 2


def test_checksums_are_verified_when_asked(run):
    trainer = run / "checkpoints" / "step_00000003" / "trainer.json"
    data = bytearray(trainer.read_bytes())
    data[-2] = ord("9") if data[-2] != ord("9") else ord("8")  # same size, other bytes
    trainer.write_bytes(bytes(data))
    [f] = [f for f in diagnose(uri(run), verify_checksums=True).findings if f.kind == "checkpoint"]
    assert "checksum mismatch" in f.what


def test_a_truncated_manifest_the_compaction_covers_is_rebuilt(run, capsys):
    bad = b'{"step": 0, "consumed": ["g00'
    (run / "buffer/consumed/00000000.json").write_bytes(bad)
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "manifest"]
    assert status == 0 and f["severity"] == "warning" and "rebuilds it from the compaction record (1 group," in f["fix"]
    status, out = doctor(run, capsys, "--repair")
    assert status == 0 and out["warnings"] == 0 and [r["action"] for r in out["repairs"]] == ["rebuilt"]
    assert quarantined(run, "buffer/consumed/00000000.json").read_bytes() == bad
    rebuilt = json.loads((run / "buffer/consumed/00000000.json").read_text())
    assert rebuilt["consumed_or_rejected"] == ["g0000"] and rebuilt["consumed"] == [] and rebuilt["step"] == 0
    # readers: counted as consumed or rejected at step 0, never as available
    assert main(["runs", "show", uri(run), "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["buffer"]
    assert (b["consumed"], b["consumed_or_rejected_unattributed"], b["available"], b["rebuilt_manifests"]) == (3, 1, 4, [0])
    assert main(["lineage", uri(run), "g0000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fate"] == {"step": 0, "outcome": "consumed_or_rejected"}
    with pytest.raises(LineageError, match="rebuilt from the compaction record"):
        RecordedRun.open(uri(run)).manifests(1)
    # a resume that falls back before the compaction reads the rebuilt manifest: g0000 is not served again
    with DurableBuffer.open(Store(uri(run)), capacity_groups=16, unused_handler=DropUnused(),
                            consumed_through_step=0) as buf:
        served = {buf.get().group_id for _ in range(buf.queue_size)}
    assert "g0000" not in served and served == {"g0001", "g0002", "g0003", "g0004", "g0005", "g0006", "g0007"}


def test_a_truncated_manifest_after_the_compaction_is_an_error(run, capsys):
    (run / "buffer/consumed/00000003.json").write_bytes(b'{"step": 3, "consu')
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "manifest"]
    assert status == 1 and f["severity"] == "error" and "DataBufferError" in f["meaning"] and f["repair"] is None
    assert doctor(run, capsys, "--repair")[0] == 1
    assert (run / "buffer/consumed/00000003.json").read_bytes() == b'{"step": 3, "consu'


def test_a_missing_manifest_before_the_resume_step_is_an_error(run, capsys):
    (run / "buffer/consumed/00000002.json").unlink()
    status, out = doctor(run, capsys)
    assert status == 1 and any("trained twice" in f["meaning"] for f in out["findings"] if f["severity"] == "error")


def test_a_bad_compaction_record_is_an_error_repair_moves_it_aside(run, capsys):
    (run / "buffer/compacted/upto_00000001.json").write_bytes(b"garbage")
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "compaction"]
    assert status == 1 and f["severity"] == "error" and f["repair"]
    status, out = doctor(run, capsys, "--repair")
    assert status == 0 and out["errors"] == 0
    assert quarantined(run, "buffer/compacted/upto_00000001.json").read_bytes() == b"garbage"
    with DurableBuffer.open(Store(uri(run)), capacity_groups=16, unused_handler=DropUnused(),
                            consumed_through_step=3) as buf:
        assert buf.queue_size == 4


def test_a_deleted_unconsumed_group_object_is_lost(run, capsys):
    objects(run)[5].unlink()
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "lost-object"]
    assert status == 0 and f["severity"] == "warning" and f["key"].endswith("000000000005.arrow")
    assert "lost" in f["meaning"]


def test_a_deleted_partly_consumed_object_is_lost(tmp_path, capsys):
    """Two groups in one object, one consumed before the compaction: the compaction names it as consumed in an
    object not done; the object deleted, the other group is lost."""
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1,
                            coalesce_seconds=0.5) as buf:
        threads = [threading.Thread(target=buf.put, args=(make_group(i),)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        buf.record_consumed(0, [buf.get().group_id])
        buf.compact(0)
    [obj] = store.list("buffer/groups/")
    store.delete(obj)
    report = diagnose(cfg.run_uri)
    assert [f.severity for f in report.findings if f.kind == "lost-groups"] == ["warning"]


def test_an_undecodable_object_is_quarantined_like_a_reopen(run, capsys):
    obj = objects(run)[6]
    obj.write_bytes(b"not arrow")
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "group-object"]
    assert status == 0 and f["severity"] == "warning" and "never trained" in f["meaning"]
    repair(uri(run))
    moved = run / "buffer/quarantine" / obj.parent.name / obj.name
    assert moved.read_bytes() == b"not arrow" and not obj.exists()
    assert "not a readable Arrow" in json.loads(Path(str(moved) + ".reason.json").read_text())["reason"]


@pytest.mark.parametrize("where", ["next-seq", "writer-sorting-first"])
def test_a_copy_of_a_group_object_is_reported_and_repair_moves_the_copy_aside(run, capsys, where):
    """Consumed object 0's bytes again under its writer's next seq, or under a writer that sorts before it (a
    botched restore): a warning naming the copy (not the object the records name) and the object it repeats;
    --repair moves the copy to buffer/quarantine/ and keeps the original."""
    first = objects(run)[0]
    copy = first.with_name("000000000008.arrow") if where == "next-seq" else \
        run / GROUPS / "w0000000000000-restored" / "000000000000.arrow"
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(first.read_bytes())
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "duplicate-groups"]
    assert status == 0 and f["severity"] == "warning" and f["key"] == uri(copy) and first.name in f["what"]
    assert not [f for f in out["findings"] if f["kind"] in ("lost-object", "lost-groups")]
    status, out = doctor(run, capsys, "--repair")
    assert status == 0 and not [f for f in out["findings"] if f["kind"] == "duplicate-groups"]
    assert not copy.exists() and first.exists()
    assert (run / "buffer/quarantine" / copy.parent.name / copy.name).read_bytes() == first.read_bytes()


def test_a_stray_file_among_the_group_objects_is_reported_and_moved_aside(run, capsys):
    first = objects(run)[0]
    stray = first.with_name("000000000000.copy.arrow")
    stray.write_bytes(first.read_bytes())
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "stray-file"]
    assert status == 0 and f["severity"] == "warning" and f["key"] == uri(stray) and "never read" in f["meaning"]
    assert not [f for f in out["findings"] if f["kind"] == "duplicate-groups"]  # never read: no copy to serve
    doctor(run, capsys, "--repair")
    key = str(stray.relative_to(run))
    assert quarantined(run, key).read_bytes() == first.read_bytes() and not stray.exists()


def test_a_garbage_lease_is_an_error_repair_moves_it_aside(run, capsys):
    (run / LEASE_KEY).write_bytes(b"{not a lease")
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "lease"]
    assert status == 1 and f["severity"] == "error"
    status, out = doctor(run, capsys, "--repair")
    assert status == 0 and quarantined(run, LEASE_KEY).read_bytes() == b"{not a lease"
    with Lease.acquire(Store(uri(run)), ttl_seconds=60):  # the next segment takes a fresh lease
        pass


def test_an_expired_lease_is_a_warning(run):
    now = time.time()
    rec = LeaseRecord("host/pid1/abcd", "t" * 32, 3, now - 300, now - 200, now - 140, 60.0, 15.0)
    (run / LEASE_KEY).write_bytes(rec.to_bytes())
    [f] = [f for f in diagnose(uri(run)).findings if f.kind == "lease"]
    assert f.severity == "warning" and "host/pid1/abcd" in f.what and "never released" in f.what


def test_an_orphaned_temporary_is_moved_aside(run, capsys):
    tmp = run / "buffer/consumed/00000004.json.tmp-0123456789abcdef"
    tmp.write_bytes(b'{"half": ')
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "temporary"]
    assert status == 0 and f["severity"] == "warning" and f["key"].endswith(tmp.name)
    status, out = doctor(run, capsys, "--repair")
    assert not tmp.exists() and out["warnings"] == 0
    assert quarantined(run, f"buffer/consumed/{tmp.name}").read_bytes() == b'{"half": '


def test_an_incomplete_checkpoint_dir_older_than_the_newest_is_an_orphan(run, capsys):
    orphan = run / "checkpoints/step_00000002"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"half a model")
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "orphaned-checkpoint"]
    assert status == 0 and f["severity"] == "warning" and f["key"].endswith("checkpoints/step_00000002")
    status, out = doctor(run, capsys, "--repair")
    assert not orphan.exists() and out["warnings"] == 0
    assert quarantined(run, "checkpoints/step_00000002/model.safetensors").read_bytes() == b"half a model"


def test_a_bad_eval_result_is_moved_aside(run, capsys):
    result = run / "eval/step_00000001/held.json"
    result.write_bytes(b'{"step": 1, "data')
    [f] = [f for f in diagnose(uri(run)).findings if f.kind == "eval-result"]
    assert f.severity == "warning" and f.repair is not None
    repair(uri(run))
    assert quarantined(run, "eval/step_00000001/held.json").read_bytes() == b'{"step": 1, "data'


# ----------------------------------------------------------------------------- repair


def test_repair_never_touches_committed_groups_or_complete_checkpoints(run, capsys):
    """Every damage --repair handles at once: afterwards what remains is only what it may not fix, and every
    decodable group object and every complete checkpoint file is byte-identical."""
    (run / "STATUS.json").write_bytes(b"{")
    (run / "buffer/consumed/00000000.json").write_bytes(b"")
    objects(run)[6].write_bytes(b"garbage")
    (run / "buffer/groups" / objects(run)[0].parent.name / "000000000009.arrow.tmp-feed").write_bytes(b"x")
    (run / "checkpoints/step_00000000").mkdir()
    (run / "checkpoints/step_00000000/rng.safetensors").write_bytes(b"x")
    (run / "eval/step_00000001/held.json").write_bytes(b"[")
    before = snapshot_of_kept(run)
    status, out = doctor(run, capsys, "--repair")
    assert status == 0 and out["errors"] == 0 and out["warnings"] == 0, out
    assert out["before_repair"]["warnings"] == 6 and len(out["repairs"]) == 6
    assert snapshot_of_kept(run) == before
    assert len(list((run / QUARANTINE).glob("*/REPAIRS.json"))) == 1


def test_repair_is_refused_while_a_live_writer_holds_the_lease(run, capsys):
    (run / "STATUS.json").write_bytes(b"{")
    store = Store(uri(run))
    with Lease.acquire(store, ttl_seconds=60) as lease:
        with pytest.raises(RepairRefused, match=f"being written by {lease.holder}"):
            repair(uri(run))
        assert main(["doctor", uri(run), "--repair"]) == 1
        assert "RepairRefused" in capsys.readouterr().err
        status, out = doctor(run, capsys)  # the check alone is fine
        assert status == 0 and any(f["kind"] == "lease" and "held by" in f["what"] for f in out["findings"])
    assert (run / "STATUS.json").read_bytes() == b"{" and not (run / QUARANTINE).exists()


def test_usage_errors_and_a_missing_run(tmp_path, capsys):
    assert main(["doctor"]) == 2
    assert main(["doctor", str(tmp_path), "--repiar"]) == 2
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "nothing")]) == 1
    assert "no run at" in capsys.readouterr().err


def test_a_fork_without_the_objects_consumed_before_it_is_clean(run):
    """A fork copies only the objects holding unconsumed groups (seq 4..7 here): the source's consumed objects
    are not missing, and its manifests 0..3 name groups it never copied."""
    forked = fork_run(uri(run), 3, "f", [])
    assert forked.objects_copied == 4
    report = diagnose(forked.run_uri)
    assert kinds(report, "warning") == [] and kinds(report, "error") == []


def test_latest_naming_a_checkpoint_that_does_not_verify_is_marked_by_doctor_and_runs_show(run, capsys):
    assert (run / "checkpoints" / "LATEST").read_bytes().strip() == b"step_00000003"
    model = run / "checkpoints" / "step_00000003" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    status, out = doctor(run, capsys)
    [f] = [f for f in out["findings"] if f["kind"] == "latest"]
    assert status == 0 and f["severity"] == "warning" and "does not verify" in f["what"]
    assert "after step 1, the newest that verifies" in f["meaning"]
    assert main(["runs", "show", uri(run)]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("checkpoints")]
    assert "LATEST 3: DOES NOT VERIFY (model.safetensors: size" in line and "a resume starts after step 1" in line
