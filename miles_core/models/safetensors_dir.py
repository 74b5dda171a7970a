"""Reading the weights of an HF-format directory: one `model.safetensors` or shards with an index.

`load_safetensors_dir(dir)` reads every tensor; `SafetensorsReader(dir)` reads on demand, a whole
tensor or a range of its rows or columns (what one tensor-parallel rank holds), through
safetensors' memory-mapped `safe_open`: the rest of the tensor is not touched. Only safetensors
files are read (no pickle, so no `.bin`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # validation imports this module and never imports torch
    import torch


class MissingWeights(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files of `model_dir`, in a stable order; MissingWeights when there are none."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise MissingWeights(f"{model_dir}: no model.safetensors (or model.safetensors.index.json); "
                         "only safetensors checkpoints are read")


def load_safetensors_dir(model_dir: str) -> dict:
    """Every tensor of the directory, by name (torch tensors, on CPU)."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for name in safetensors_files(model_dir):
        tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


class SafetensorsReader:
    """The tensors of `model_dir`, read when asked: `read(name)` whole, `read(name, dim, start,
    stop)` only rows (dim 0) or columns (dim 1) [start, stop). Returned tensors are views of the
    memory-mapped file (copy them, or drop them, before the file goes); `bytes_read` counts the
    bytes handed out. Use it as a context manager (or call `close()`).
    """

    def __init__(self, model_dir: str):
        self._files = [safe_open(os.path.join(model_dir, n), framework="pt") for n in safetensors_files(model_dir)]
        self._file_of = {name: f for f in self._files for name in f.keys()}
        self.bytes_read = 0

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files:
            f.__exit__(None, None, None)
        self._files, self._file_of = [], {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> list[int]:
        """The stored shape of `name` (KeyError when the directory has no such tensor)."""
        return list(self._file_of[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        f = self._file_of[name]
        if dim is None:
            t = f.get_tensor(name)
        else:
            t = f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
        self.bytes_read += t.numel() * t.element_size()
        return t
