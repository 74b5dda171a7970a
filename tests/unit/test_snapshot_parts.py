"""A snapshot written in parts by several ranks (miles_core/weights/snapshot.py; docs/training.md, "Weight export")."""

from __future__ import annotations

import torch

from miles_core.models.safetensors_dir import load_safetensors_dir, safetensors_files
from miles_core.storage import Store
from miles_core.storage.weight_versions import model_file
from miles_core.weights.snapshot import INDEX, MARKER, complete_snapshots, export_part, export_snapshot, partition, seal


class FakeTrainer:
    def __init__(self, state):
        self.state, self.aux_files = state, {"config.json": b"{}"}

    def hf_state_dict(self, dtype=None):
        return self.state


def _state():
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": (50, 8), "head": (50, 8), "l0.q": (8, 8), "l0.mlp": (24, 8), "l1.q": (8, 8), "l1.mlp": (24, 8),
              "norm": (8,)}
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def test_partition_is_balanced_deterministic_and_covers_every_tensor_once():
    sizes = {n: t.numel() * 4 for n, t in _state().items()}
    parts = partition(sizes, 3)
    assert parts == partition(dict(reversed(list(sizes.items()))), 3)  # the same on every writer
    assert sorted(n for p in parts for n in p) == sorted(sizes)
    loads = [sum(sizes[n] for n in p) for p in parts]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert partition(sizes, 1) == [sorted(sizes)]


def test_parts_written_by_three_writers_are_complete_only_once_sealed(tmp_path):
    """Pins: part 0's writer writes its shard, HF's index and the small files; the others their shards;
    the directory is not complete until sealed, and then reads back as the whole state (HF's sharded
    layout). Guards: rank 0 writing the whole model while the other ranks wait."""
    state = _state()
    store = Store(f"file://{tmp_path}")
    key = export_snapshot(FakeTrainer(state), store, 7, prefix="weights", parts=3)
    written = [export_part(state, store, key, i, 3) for i in (1, 2)]
    assert complete_snapshots(store, "weights") == [] and not store.exists(f"{key}/{MARKER}")
    seal(store, key)
    assert complete_snapshots(store, "weights") == [7]
    d = str(tmp_path / key)
    assert safetensors_files(d) == [model_file(i, 3) for i in range(3)]
    back = load_safetensors_dir(d)
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
    index = store.get_json(f"{key}/{INDEX}")
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    assert min(written) > 0 and store.get_bytes(f"{key}/config.json") == b"{}"


def test_one_part_is_the_single_file_sealed_by_its_writer(tmp_path):
    store = Store(f"file://{tmp_path}")
    key = export_snapshot(FakeTrainer(_state()), store, 3)
    assert store.exists(f"{key}/model.safetensors") and store.exists(f"{key}/{MARKER}")
    assert not store.exists(f"{key}/{INDEX}")
