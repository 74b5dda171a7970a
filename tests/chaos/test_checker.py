"""The chaos checker finds what it is there to find (a fake run root, no run needed)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
from safetensors.numpy import save_file

from tests.chaos.checker import check


def _fake_run(run, consumed_by_step: dict[int, list[str]], committed: list[str]):
    (run / "buffer" / "groups" / "w1").mkdir(parents=True)
    (run / "buffer" / "consumed").mkdir(parents=True)
    meta = [json.dumps({"epoch": 0, "position": ord(g[0])}) for g in committed]  # one prompt per first letter
    table = pa.table({"group_id": committed, "metadata": meta})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (run / "buffer" / "groups" / "w1" / "000000000000.arrow").write_bytes(sink.getvalue().to_pybytes())
    for step, ids in consumed_by_step.items():
        (run / "buffer" / "consumed" / f"{step:08d}.json").write_text(json.dumps({"consumed": ids, "rejected": []}))
    last = max(consumed_by_step)
    ckpt = run / "checkpoints" / f"step_{last:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    save_file({"w": np.ones(2, dtype=np.float32)}, str(ckpt / "model.safetensors"))
    (run / "checkpoints" / "LATEST").write_text(f"step_{last:08d}")
    (run / "STATUS.json").write_text(json.dumps({"state": "finished", "last_step": last}))


def test_a_consistent_run_root_passes(tmp_path):
    _fake_run(tmp_path, {0: ["a", "b"], 1: ["c", "d"]}, ["a", "b", "c", "d", "e"])
    assert check(tmp_path, 2, 2, {"a", "e"}) == []


def test_a_group_consumed_twice_or_lost_is_found(tmp_path):
    _fake_run(tmp_path, {0: ["a", "b"], 1: ["b", "x"]}, ["a", "b", "c"])
    problems = " | ".join(check(tmp_path, 2, 2, {"a", "z"}))
    assert "consumed twice" in problems and "have no committed object" in problems
    assert "committed before a kill are gone" in problems


def test_a_missing_step_or_an_incomplete_checkpoint_is_found(tmp_path):
    _fake_run(tmp_path, {0: ["a", "b"], 2: ["c", "d"]}, ["a", "b", "c", "d"])
    (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").unlink()
    problems = " | ".join(check(tmp_path, 3, 2, set()))
    assert "manifests of steps [0, 2]" in problems and "not the complete checkpoint" in problems


def test_a_prompt_trained_twice_under_two_group_ids_is_found(tmp_path):
    _fake_run(tmp_path, {0: ["a", "b"], 1: ["c", "a2"]}, ["a", "b", "c", "a2"])  # "a2": prompt of "a" again
    assert any("prompt position(s) trained twice" in p for p in check(tmp_path, 2, 2, set()))


def test_a_compaction_that_calls_an_unconsumed_object_done_is_found(tmp_path):
    _fake_run(tmp_path, {0: ["a", "b"], 1: ["c", "d"]}, ["a", "b", "c", "d", "e"])
    (tmp_path / "buffer" / "compacted").mkdir()
    record = {"through_step": 1, "objects_done": {"w1": [[0, 0]]}, "consumed": []}
    (tmp_path / "buffer" / "compacted" / "upto_00000001.json").write_text(json.dumps(record))
    assert any("calls w1/000000000000 done" in p for p in check(tmp_path, 2, 2, set()))


def _weights(run, steps: int = 6) -> dict:
    """Weight versions 1..steps in `run` as the trainer writes them (2 parts, anchors 1-2, deltas after)."""
    import torch

    from miles_core.storage import Store
    from miles_core.storage import weight_versions as wv
    from miles_core.weights.snapshot import partition, seal

    store = Store(f"file://{run}")
    writers = [wv.PartWriter(anchor_every=20, first_anchors=2) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "c": torch.randn(16, 16, generator=g)}
    for step in range(1, steps + 1):
        state = {k: torch.where(torch.rand(v.shape, generator=g) < 0.02, v * 1.1 + 0.01, v) for k, v in state.items()}
        names = partition({k: v.numel() * 2 for k, v in state.items()}, 2)
        for i, w in enumerate(writers):
            w.write(store, f"weights/step_{step:08d}", state, i, 2, names[i])
        seal(store, f"weights/step_{step:08d}")
    return state


def test_weight_versions_that_do_not_rebuild_to_their_checksums_are_found(tmp_path):
    """The checker rebuilds every sealed weight version on its own (numpy, zstandard, xxhash): a clean chain
    passes, and is read as deltas; a flipped value in a delta, a part held both as an anchor and as a delta (a
    killed publish's leftover) and a newest version whose chain is broken are each found."""
    import zstandard

    from tests.chaos.checker import weight_kinds, weight_versions_rebuild, load

    _fake_run(tmp_path, {0: ["a", "b"]}, ["a", "b"])
    _weights(tmp_path)
    assert list(weight_kinds(tmp_path).values()) == ["anchor"] * 2 + ["delta"] * 4
    assert check(tmp_path, 1, 2, set()) == []
    weights = tmp_path / "weights"
    delta = weights / "step_00000004" / "delta-00001-of-00002.safetensors.zst"
    raw = bytearray(zstandard.ZstdDecompressor().decompress(delta.read_bytes()))
    raw[-1] ^= 0x40  # a bit of the last tensor's data
    delta.write_bytes(zstandard.ZstdCompressor().compress(bytes(raw)))
    problems = weight_versions_rebuild(load(tmp_path), 1, 2)
    assert any("step_00000004" in p and "checksums" in p for p in problems), problems
    (weights / "step_00000005" / "model-00002-of-00002.safetensors").write_bytes(b"")
    problems = weight_versions_rebuild(load(tmp_path), 1, 2)
    assert any("step_00000005" in p and "both an anchor and a delta" in p for p in problems), problems
    for f in (weights / "step_00000005").iterdir():
        f.unlink()
    (weights / "step_00000005").rmdir()
    problems = weight_versions_rebuild(load(tmp_path), 1, 2)
    assert any("step_00000006" in p and "chain is broken" in p for p in problems), problems
