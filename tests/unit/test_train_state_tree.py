"""Optimizer state as safetensors + JSON (no pickle), exactly as it was.

Pins: tensors, tuples (AdamW betas), int and dtype dict keys (Megatron's distributed optimizer
keys buffers by index and dtype), None/bool/float leaves all survive a JSON round trip of the
skeleton; anything else is refused instead of pickled.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from miles_core.train.state_tree import StateTreeError, flatten, unflatten


def test_round_trip_through_safetensors_and_json():
    """A Megatron-like nested state comes back equal, with the same key and container types."""
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "amsgrad": False, "params": [0], "x": None}],
            "params": {0: {torch.bfloat16: [[{"param": torch.arange(3), "gbuf_local_start": 0}]]}}}
    tensors, skeleton = flatten(tree)
    back = unflatten(load(save(tensors)), json.loads(json.dumps(skeleton)))
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(back["params"][0]) == [torch.bfloat16]
    assert torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])
    assert torch.equal(back["params"][0][torch.bfloat16][0][0]["param"], torch.arange(3))
    assert back["param_groups"][0]["x"] is None and back["state"][0]["step"].item() == 3.0


def test_unknown_leaf_is_refused():
    with pytest.raises(StateTreeError, match="without pickle"):
        flatten({"a": object()})
