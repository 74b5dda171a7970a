"""Reading the weights of an HF-format directory: one `model.safetensors` or shards with an index."""

from __future__ import annotations

import json
import os


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
