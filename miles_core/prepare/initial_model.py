"""The run's initial model, made present once: a builtin model written from `--seed`, or an
importable source imported (`miles_core.prepare.model_import`). Every role then copies it from its
URI (`miles_core.models.source.model_uri`) to its own node.

    uri = ensure_model(cfg)
"""

from __future__ import annotations

import os
import tempfile

from miles_core.models.builtin import materialize_checkpoint
from miles_core.models.source import MARKER, import_source, is_builtin, model_uri, needs_import
from miles_core.prepare.model_import import import_model
from miles_core.storage import Store


def ensure_model(cfg) -> str:
    """`model_uri(cfg)`, creating a builtin model or importing a source first when it is not there."""
    uri = model_uri(cfg)
    m = cfg.model
    if not (is_builtin(m.hf_checkpoint) or needs_import(m.hf_checkpoint)) or Store(uri).exists(MARKER):
        return uri
    if needs_import(m.hf_checkpoint):
        return import_model(import_source(m.hf_checkpoint), uri)
    return _materialize_builtin(cfg, uri)


def _materialize_builtin(cfg, uri: str) -> str:
    m, store = cfg.model, Store(uri)
    with tempfile.TemporaryDirectory(prefix="miles-initial-") as tmp:
        materialize_checkpoint(m.hf_checkpoint, cfg.run.seed, tmp, num_layers=m.tiny_num_layers,
                               hidden_size=m.tiny_hidden_size, num_heads=m.tiny_num_heads)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                store.put_bytes(name, f.read())
    store.put_bytes(MARKER, b"")
    return uri
