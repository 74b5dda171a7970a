"""A safetensors object written as its tensors are made (miles_core/storage/tensor_files.put_streamed).

Pins: the object holds exactly the tensors made, in the layout given, with the metadata taken after the last
one (the anchor's checksums), and reads back with safetensors and transformers' own reader; a tensor not as
laid out, a failing producer or metadata of another length commit nothing (the Store's commit rule: the whole
object or none). Guards: a header written before its checksums were known, a writer thread's error lost."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from miles_core.storage import Store
from miles_core.storage.tensor_files import put_streamed

SHAPES = {"b.weight": [3, 5], "a.bias": [7], "c.empty": [0, 4], "d.big": [257, 129]}


def _layout(order):
    return [(n, SHAPES[n], "BF16", 2 * torch.Size(SHAPES[n]).numel()) for n in order]


def test_streamed_object_holds_what_was_made_and_the_metadata_taken_last(tmp_path):
    store = Store(f"file://{tmp_path}")
    g = torch.Generator().manual_seed(0)
    src = {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}
    made = []

    def produce(n):
        made.append(n)
        return src[n].to(torch.bfloat16)

    size = put_streamed(store, "v/model.safetensors", _layout(sorted(SHAPES)), produce,
                        lambda: {"sums": json.dumps(made)}, {"sums": json.dumps(["x" * 6] * 4)})
    path = tmp_path / "v" / "model.safetensors"
    assert size == path.stat().st_size and made == sorted(SHAPES)
    got = load_file(path)
    assert set(got) == set(SHAPES) and all(torch.equal(got[n], src[n].to(torch.bfloat16)) for n in SHAPES)
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["sums"]) == sorted(SHAPES) and f.metadata()["format"] == "pt"


@pytest.mark.parametrize("fault", ["shape", "raises", "metadata"])
def test_a_faulty_stream_commits_nothing(tmp_path, fault):
    store = Store(f"file://{tmp_path}")

    def produce(n):
        if fault == "shape" and n == "b.weight":
            return torch.zeros(5, 3, dtype=torch.bfloat16)  # the right count, the wrong shape
        if fault == "raises" and n == "c.empty":
            raise RuntimeError("cast failed")
        return torch.zeros(*SHAPES[n], dtype=torch.bfloat16)

    meta = {"sums": "longer than planned" if fault == "metadata" else "x"}
    with pytest.raises((ValueError, RuntimeError)):
        put_streamed(store, "v/model.safetensors", _layout(sorted(SHAPES)), produce, lambda: meta, {"sums": "x"})
    assert not (tmp_path / "v" / "model.safetensors").exists()
    assert list((tmp_path / "v").iterdir()) == []  # no temporary file left either
