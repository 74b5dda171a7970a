"""Trainer checkpoints in a Store (file:// and a real S3 server).

Pins: resume from a checkpoint gives the same next-step loss and weights as an uninterrupted run
(model, optimizer moments and step count, RNG all restored); the caller's extras come back as
saved; `latest()` ignores a directory without its COMPLETE marker (a crash mid-save) and the
LATEST pointer names the newest complete step; nothing is pickled (safetensors + JSON only).
"""

from __future__ import annotations

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.models.builtin import materialize_checkpoint
from miles_core.storage import Store
from miles_core.train.checkpoint import CheckpointError, CheckpointManager
from miles_core.train.trainer import Trainer
from tests.unit.test_train import make_groups

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 3, str(tmp_path_factory.mktemp("tiny-gpt")))


def test_resume_gives_the_same_next_step(tiny_gpt, storage_root):
    """Steps 0..2 uninterrupted == steps 0..1, save, new process state, load, step 2."""
    cfg = TrainSection(lr=2e-3)
    batches = [make_groups(4, 4, seed=s) for s in range(3)]
    with Trainer(cfg, tiny_gpt) as full:
        for k in range(3):
            ref = full.train_step(k, batches[k])
        ref_params = {n: p.detach().clone() for n, p in full.model.named_parameters()}

    ckpts = CheckpointManager(Store(storage_root).child("checkpoints"))
    extras = {"data_cursor": {"epoch": 0, "position": 17}, "consumed_through_step": 1, "weight_version": 2}
    with Trainer(cfg, tiny_gpt) as first:
        for k in range(2):
            first.train_step(k, batches[k])
        ckpts.save(1, first, extras)
    torch.manual_seed(12345)  # a new process would start from another RNG state
    with Trainer(cfg, tiny_gpt, seed=99) as resumed:
        step, got = ckpts.load_latest(resumed)
        assert step == 1 and got == {"step": 1, **extras}
        m = resumed.train_step(2, batches[2])
        assert m["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-6)
        assert m["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-5)
        for n, p in resumed.model.named_parameters():
            assert torch.allclose(p, ref_params[n], atol=1e-6), n


def test_latest_ignores_incomplete_dirs(tiny_gpt, storage_root):
    """A step dir without COMPLETE is never latest nor loadable; LATEST names the newest complete one."""
    store = Store(storage_root).child("checkpoints")
    ckpts = CheckpointManager(store)
    assert ckpts.latest() is None
    written = []
    put = store.put_bytes
    store.put_bytes = lambda k, data: (written.append(k), put(k, data))[1]
    with Trainer(TrainSection(), tiny_gpt) as tr:
        ckpts.save(3, tr, {})
        assert written[-2:] == ["step_00000003/COMPLETE", "LATEST"]  # marker after every part, pointer last
        ckpts.save(7, tr, {})
        store.put_bytes("step_00000009/model.safetensors", b"partial")  # crash mid-save
        assert ckpts.latest() == 7
        assert store.get_bytes("LATEST") == b"step_00000007"
        with pytest.raises(CheckpointError, match="COMPLETE"):
            ckpts.load(9, tr)
    keys = store.list("step_00000007")
    assert sorted(k.split("/")[-1] for k in keys) == ["COMPLETE", "extras.json", "files.json", "model.safetensors",
                                                       "optimizer.safetensors", "rng.safetensors", "trainer.json"]


def test_cadence_disabled_and_save_hf(tiny_gpt, tmp_path):
    """maybe_save writes at (k+1) % interval == 0 and at the last step; --save '' writes nothing;
    --save-hf with {step} gets a complete HF checkpoint per save."""
    from miles_core.config.sections import TrainSection as T
    from miles_core.weights.snapshot import MARKER

    run = Store(str(tmp_path / "run"))
    hf_tmpl = str(tmp_path / "hf" / "iter_{step}")
    mgr = CheckpointManager.from_config(T(save="auto", save_interval=2, save_hf=hf_tmpl), run)
    off = CheckpointManager.from_config(T(save=""), run)
    with Trainer(TrainSection(), tiny_gpt) as tr:
        saved = [k for k in range(5) if mgr.maybe_save(k, tr, {}, last=k == 4)]
        assert off.maybe_save(4, tr, {}, last=True) is None
    assert saved == [1, 3, 4]
    assert mgr.complete_steps() == [1, 3, 4]
    assert mgr.latest() == 4
    for k in saved:
        d = tmp_path / "hf" / f"iter_{k}"
        assert (d / MARKER).exists() and (d / "model.safetensors").exists() and (d / "config.json").exists()
