"""Checkpoints that prove themselves: COMPLETE lists every file with its size and sha256, and a resume
falls back past a checkpoint that does not verify to the newest one that does.

Pins: the marker lists exactly the step directory's files with their real sizes and checksums; a
deleted, truncated or (with checksums on) byte-flipped file of the newest checkpoint makes
`load_latest` restore the previous one, with a warning naming the file; an empty marker (an older
version's) still loads; no verifying checkpoint is a clear error; a listed file missing at read time
is called damage, not a tensor-parallel mismatch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.storage import Store
from miles_core.train import checkpoint as ckpt_mod
from miles_core.train.checkpoint import MARKER, CheckpointError, CheckpointManager, step_dir


class FakeTrainer:
    """The two methods a CheckpointManager calls: state out, state in."""

    def __init__(self, value: float = 0.0):
        self.value = value

    def checkpoint_state(self):
        t = {"w": torch.full((64,), self.value)}
        return {"model": t, "optimizer": {"m": t["w"] * 2}, "rng": {"s": torch.arange(4)}}, {"value": self.value}

    def load_checkpoint_state(self, tensors, meta):
        self.value = meta["value"]
        assert torch.equal(tensors["model"]["w"], torch.full((64,), meta["value"]))


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    root = f"file://{tmp_path}/ckpt" if request.param == "file" else f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    return Store(root)


def saved(store: Store, steps=(1, 3), **kw) -> CheckpointManager:
    mgr = CheckpointManager(store, **kw)
    for step in steps:
        mgr.save(step, FakeTrainer(float(step)), {"consumed_through_step": step})
    return mgr


def test_complete_lists_every_file_with_size_and_checksum(store):
    saved(store, steps=(1,))
    d = step_dir(1)
    doc = json.loads(store.get_bytes(f"{d}/{MARKER}"))
    on_disk = {k[len(d) + 1:] for k in store.list(d + "/")} - {MARKER}
    assert doc["format"] == 1 and set(doc["files"]) == on_disk
    assert {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer.json", "extras.json"} <= on_disk
    for name, meta in doc["files"].items():
        data = store.get_bytes(f"{d}/{name}")
        assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.mark.parametrize("damage, named", [
    (lambda s, k: s.delete(k), "missing file model.safetensors"),
    (lambda s, k: s.put_bytes(k, s.get_bytes(k)[:-10]), "model.safetensors: size"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(store, caplog, damage, named):
    mgr = saved(store)
    damage(store, f"{step_dir(3)}/model.safetensors")
    tr = FakeTrainer()
    with caplog.at_level(logging.WARNING, logger=ckpt_mod.__name__):
        step, extras = mgr.load_latest(tr)
    assert (step, extras["consumed_through_step"], tr.value) == (1, 1, 1.0)
    assert named in caplog.text and step_dir(3) in caplog.text


def _flip_a_byte(store: Store, key: str) -> None:
    data = bytearray(store.get_bytes(key))
    data[-1] ^= 0xFF
    store.put_bytes(key, bytes(data))


def test_a_flipped_byte_is_caught_by_checksums_on_request(store, caplog, monkeypatch):
    monkeypatch.setattr(ckpt_mod, "CHEAP_CHECKSUM_BYTES", 0)  # as for a large checkpoint: sizes only by default
    saved(store)
    _flip_a_byte(store, f"{step_dir(3)}/optimizer.safetensors")
    assert CheckpointManager(store).latest_verified() == 3  # same size: not seen without checksums
    with caplog.at_level(logging.WARNING, logger=ckpt_mod.__name__):
        assert CheckpointManager(store, verify_checksums=True).latest_verified() == 1
    assert "optimizer.safetensors: checksum mismatch" in caplog.text


def test_a_small_checkpoint_has_its_checksums_verified_by_default(store):
    mgr = saved(store)
    _flip_a_byte(store, f"{step_dir(3)}/rng.safetensors")
    assert mgr.latest_verified() == 1


def test_the_flag_reaches_the_manager(tmp_path):
    mgr = CheckpointManager.from_config(TrainSection(save="auto", verify_checkpoint_checksums=True),
                                        Store(f"file://{tmp_path}"))
    assert mgr.verify_checksums is True


def test_an_older_versions_empty_marker_still_loads(store, caplog):
    mgr = saved(store, steps=(2,))
    store.put_bytes(f"{step_dir(2)}/{MARKER}", b"")
    tr = FakeTrainer()
    with caplog.at_level(logging.INFO, logger=ckpt_mod.__name__):
        assert mgr.load_latest(tr)[0] == 2 and tr.value == 2.0
    assert "older version" in caplog.text


def test_no_verifying_checkpoint_is_a_clear_error(store):
    mgr = saved(store)
    for step in (1, 3):
        store.delete(f"{step_dir(step)}/trainer.json")
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* verifies \(steps \[1, 3\]"):
        mgr.load_latest(FakeTrainer())


def test_a_listed_file_missing_at_read_is_damage_not_a_tp_mismatch(store):
    mgr = saved(store, steps=(1,))
    store.delete(f"{step_dir(1)}/rng.safetensors")
    with pytest.raises(CheckpointError, match="damaged: its COMPLETE lists rng.safetensors") as info:
        mgr.load(1, FakeTrainer())
    assert "tensor-model-parallel" not in str(info.value)


@pytest.mark.parametrize("marker", [b"{not json", b'{"format": 1, "files": {"model.safetensors": {}}}'])
def test_a_marker_that_is_not_a_manifest_does_not_verify(store, marker):
    mgr = saved(store)
    store.put_bytes(f"{step_dir(3)}/{MARKER}", marker)
    assert mgr.latest_verified() == 1


def test_saving_over_a_complete_step_untrusts_it_until_its_new_marker(store, monkeypatch):
    """After a fallback the run saves its old steps again: mid-save, the old marker must not vouch for new files."""
    mgr = saved(store)
    seen = []
    put = store.put_bytes
    monkeypatch.setattr(store, "put_bytes", lambda k, data: (seen.append((k, mgr.complete_steps())), put(k, data))[1])
    mgr.save(3, FakeTrainer(7.0), {})
    assert all(steps == [1] for k, steps in seen if not k.endswith(MARKER) and k != "LATEST")
    tr = FakeTrainer()
    assert mgr.load_latest(tr)[0] == 3 and tr.value == 7.0
