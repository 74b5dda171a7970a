"""Nested state (optimizer state dicts) as safetensors + JSON, so checkpoints never pickle.

`flatten(tree)` splits a tree of dicts/lists/tuples whose leaves are tensors, numbers, strings,
bools, None or torch dtypes into (tensors by path, a JSON skeleton); `unflatten` rebuilds it
exactly, including int, dtype and tuple dict keys (Megatron's distributed optimizer keys the
gathered state of its buffers by index, then by (param dtype, grad dtype)) and tuples (AdamW's betas). Tensor names are the dotted path, made unique when
two paths collide (a string key containing a dot); the skeleton records each tensor's name.

The trees it must hold (megatron-core 0.16.1, docs/training.md): torch AdamW's `state_dict()`
(int-keyed `state`, `param_groups` with tuple betas and None leaves) and the `state_dict()` of the
`ChainedOptimizer` that `get_megatron_optimizer` returns: with one inner optimizer, that inner
optimizer's dict, e.g. `Float16OptimizerWithFloat16Params`' {"optimizer": AdamW state,
"fp32_from_fp16_params": [[fp32 main params] per group], "grad_scaler": {...} with fp16 only};
with several, a list of those. Never the `ChainedOptimizer.state` ProxyDict (not a dict: refused).
"""

from __future__ import annotations

from typing import Any

import torch


class StateTreeError(TypeError):
    def __init__(self, message: str):
        super().__init__(message)


def _enc_key(k) -> list:
    if isinstance(k, tuple):
        return ["tuple", [_enc_key(v) for v in k]]
    if isinstance(k, bool) or not isinstance(k, (int, str, torch.dtype)):
        raise StateTreeError(f"unsupported dict key {k!r} ({type(k).__name__})")
    if isinstance(k, torch.dtype):
        return ["dtype", str(k).removeprefix("torch.")]
    return ["int", k] if isinstance(k, int) else ["str", k]


def _dec_key(k: list):
    kind, v = k
    if kind == "tuple":
        return tuple(_dec_key(x) for x in v)
    return getattr(torch, v) if kind == "dtype" else v


def flatten(tree: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by unique name, JSON-able skeleton). Tensors are detached CPU copies on GPU; on CPU
    they may alias the live state, so write them before the next step. Raises StateTreeError on a
    leaf or key it cannot store without pickle (naming its path)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            key, n = path or ".", 1
            while key in tensors:  # "a.b" as one key and as a path: keep both
                key, n = f"{path or '.'}#{n}", n + 1
            tensors[key] = x.detach().cpu().contiguous()
            return {"t": "tensor", "k": key}
        if isinstance(x, torch.dtype):
            return {"t": "dtype", "v": str(x).removeprefix("torch.")}
        if isinstance(x, dict):
            return {"t": "dict", "items": [[_enc_key(k), walk(v, f"{path}.{k}" if path else str(k))]
                                           for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"t": "tuple" if isinstance(x, tuple) else "list",
                    "items": [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"t": "value", "v": x}
        raise StateTreeError(f"{path or 'root'}: cannot store a {type(x).__name__} without pickle")

    skeleton = walk(tree, prefix)
    return tensors, skeleton


def unflatten(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """The tree `flatten` split, rebuilt from its tensors and (JSON round-tripped) skeleton."""
    t = skeleton["t"]
    if t == "tensor":
        return tensors[skeleton["k"]]
    if t == "dtype":
        return getattr(torch, skeleton["v"])
    if t == "dict":
        return {_dec_key(k): unflatten(tensors, v) for k, v in skeleton["items"]}
    if t in ("list", "tuple"):
        items = [unflatten(tensors, v) for v in skeleton["items"]]
        return tuple(items) if t == "tuple" else items
    return skeleton["v"]
