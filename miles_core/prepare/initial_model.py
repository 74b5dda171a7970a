"""The run's initial model, made present once: a builtin model written from `--seed`, or an
importable source imported (`miles_core.prepare.model_import`). Every role then copies it from its
URI (`miles_core.models.source.model_uri`) to its own node.

A builtin model is the same files for the same name, seed, sizes, model code and library versions,
so each machine makes it once: it is kept in the node cache (`$MILES_CACHE_DIR/builtin/`, keyed by
all of these) and a later run copies it from there without importing transformers.

    uri = ensure_model(cfg)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile

import miles_core.models as models_package
from miles_core.models.builtin import materialize_checkpoint
from miles_core.models.source import MARKER, import_source, is_builtin, model_uri, needs_import
from miles_core.prepare.model_import import import_model
from miles_core.storage import Store
from miles_core.storage.node_local import node_cache_dir

CACHED_MARKER = ".miles-builtin.json"  # a cache entry's marker (its key's inputs), never copied out
BUILTIN_KEEP = 8


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
    store = Store(uri)
    local = builtin_files(cfg)
    for name in sorted(os.listdir(local)):
        if name != CACHED_MARKER:
            store.put_file(name, os.path.join(local, name))
    store.put_bytes(MARKER, b"")
    return uri


def builtin_files(cfg) -> str:
    """A local directory holding the builtin model of `cfg` (name, seed, sizes): the node cache's
    entry, made on first use (written aside, published by one rename; a racing writer's copy is
    dropped for the one already published)."""
    m = cfg.model
    spec = {"hf_checkpoint": m.hf_checkpoint, "seed": cfg.run.seed, "num_layers": m.tiny_num_layers,
            "hidden_size": m.tiny_hidden_size, "num_heads": m.tiny_num_heads, "code": _model_code_digest(),
            "versions": {p: importlib.metadata.version(p) for p in ("torch", "transformers", "safetensors")}}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]
    root = os.path.join(node_cache_dir(), "builtin")
    entry = os.path.join(root, key)
    if os.path.exists(os.path.join(entry, CACHED_MARKER)):
        return entry
    os.makedirs(root, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{key}.partial-", dir=root)
    try:
        materialize_checkpoint(m.hf_checkpoint, cfg.run.seed, partial, num_layers=m.tiny_num_layers,
                               hidden_size=m.tiny_hidden_size, num_heads=m.tiny_num_heads)
        with open(os.path.join(partial, CACHED_MARKER), "w") as f:
            json.dump(spec, f)
        try:
            os.rename(partial, entry)
        except OSError:  # published meanwhile by another process (or a stale entry without its marker)
            if not os.path.exists(os.path.join(entry, CACHED_MARKER)):
                shutil.rmtree(entry, ignore_errors=True)
                os.rename(partial, entry)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _prune(root, keep=BUILTIN_KEEP)
    return entry


def _prune(root: str, keep: int) -> None:
    """The newest `keep` published entries stay (a code change makes new ones)."""
    entries = [os.path.join(root, e) for e in os.listdir(root) if not e.startswith(".")]
    entries.sort(key=lambda e: os.stat(e).st_mtime if os.path.exists(e) else 0.0, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _model_code_digest() -> str:
    """The builtin models' code (miles_core/models): a change makes new entries."""
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(models_package.__file__))
    for here, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(here, name)
                with open(path, "rb") as f:
                    digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return digest.hexdigest()
