"""Importing a model source into the HF safetensors directory every role loads.

Why: the engines and the trainer read one format only (config.json + safetensors + tokenizer
files) and only the families of miles_core.models.families (docs/models.md). A source in another
shape is turned into that format once, here, and checked against the family's adapter and both
readers, so a run never starts on a model that one role would read differently from the other (a
silently ignored RoPE scaling, say).

Sources:
- a GGUF file (a local path, or a file:// / s3:// URI; remote files are copied to a temp file) of
  an architecture both GGUF and transformers' GGUF loader know among ours (GGUF_ARCHITECTURES):
  its tensors are dequantized to float32 by transformers, its tokenizer and chat template kept. A
  GGUF with RoPE scaling (Llama 3.1's `rope_freqs` tensor, `*.rope.scaling.*` keys) is refused:
  transformers' loader drops the scaling and the model would be read with plain RoPE;
- a local HF directory with safetensors weights: the weights are copied byte for byte, the
  config normalised.
Config normalisation: `quantization_config` is dropped (the weights are plain tensors now); a
legacy `rope_scaling={"type": ...}` becomes `{"rope_type": ...}`; a model_type outside FAMILIES, or
a RoPE type or option its family's adapter does not handle, is refused naming what is handled.

The destination gets every file, then `miles_import.json` (source, its sha, what was converted,
when), then the `.complete` marker last: a directory with the marker is whole, and importing into
it again returns at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from datetime import datetime, timezone

from miles_core.models.families import ADAPTERS, FAMILIES, UnsupportedModel, spec_of
from miles_core.models.safetensors_dir import MissingWeights, safetensors_files
from miles_core.models.source import IMPORT_FORMAT_VERSION, MARKER, ModelSourceError, source_fingerprint
from miles_core.storage import Store, normalize_uri

RECORD = "miles_import.json"
ARCHITECTURES = FAMILIES  # the model_types a user may bring: one adapter each
HF_CLASSES = {mtype: ADAPTERS[mtype].hf_class for mtype in ARCHITECTURES}
# GGUF's general.architecture -> model_type, for the families transformers' GGUF loader reads
# (transformers.integrations.ggml.GGUF_CONFIG_MAPPING; GGUF spells qwen3_moe "qwen3moe"; glm4_moe has
# no loader there). tests/unit/test_model_import.py checks it against the installed transformers.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")


class ModelImportError(ModelSourceError):
    """A source that cannot be imported; the message names the source and the problem."""


def import_model(src: str, dest_uri: str) -> str:
    """Import `src` (a GGUF file or an HF safetensors directory) into `dest_uri`; return its URI."""
    store = Store(dest_uri)
    if store.exists(MARKER):
        return store.uri()
    started = time.time()
    with _local_source(src) as path, tempfile.TemporaryDirectory(prefix="miles-import-") as out:
        if os.path.isdir(path):
            files, record = _from_hf_dir(path, out)
        else:
            files, record = _from_gguf(path, out)
        record.update(source=src, source_sha=_fingerprint(path), format_version=IMPORT_FORMAT_VERSION,
                      files=sorted(files), imported_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      seconds=round(time.time() - started, 1))
        for name in sorted(files):
            store.put_file(name, files[name])
    store.put_json(RECORD, record)
    store.put_bytes(MARKER, b"")
    return store.uri()


# ------------------------------------------------------------------ sources


@contextlib.contextmanager
def _local_source(src: str):
    """A local path holding `src`: the path itself, or a temp copy of a remote GGUF file."""
    uri = normalize_uri(src)
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        if not os.path.exists(path):
            raise ModelImportError(f"import {src!r}: no such file or directory ({path}).")
        yield path
        return
    parent, name = uri.rsplit("/", 1)
    if not name.lower().endswith(".gguf"):
        raise ModelImportError(f"import {src!r}: a remote source must be a .gguf file; copy an HF "
                               "directory to a local path first.")
    store = Store(parent)
    if not store.exists(name):
        raise ModelImportError(f"import {src!r}: not found.")
    with tempfile.TemporaryDirectory(prefix="miles-import-src-") as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(store.get_bytes(name))
        yield path


def _fingerprint(path: str) -> str:
    """source_fingerprint of a file; for a directory, of its files' fingerprints by name."""
    if not os.path.isdir(path):
        return source_fingerprint(path)
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if os.path.isfile(os.path.join(path, name)) and not name.startswith("."):
            h.update(f"{name}\0{source_fingerprint(os.path.join(path, name))}\0".encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ HF directory


def _from_hf_dir(src: str, out: str) -> tuple[dict[str, str], dict]:
    """Files to publish (name -> local path) and the record of what changed."""
    try:
        weights = safetensors_files(src)
    except MissingWeights as e:
        others = sorted(n for n in os.listdir(src) if n.endswith(OTHER_WEIGHTS))
        found = f" (found {', '.join(others)}: convert them to safetensors first)" if others else ""
        raise ModelImportError(f"import {src!r}: {e}{found}.") from e
    cfg = _read_config(src)
    cfg, changes = normalize_config(cfg, src)
    _write_json(os.path.join(out, "config.json"), cfg)
    files = {"config.json": os.path.join(out, "config.json")}
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.startswith(".") and not name.endswith(OTHER_WEIGHTS) \
                and name not in files and (name in weights or not name.endswith(".safetensors")):
            files[name] = path
    return files, {"kind": "hf-directory", "architecture": cfg["model_type"], "converted": changes}


def _read_config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ModelImportError(f"import {src!r}: no config.json; not an HF model directory.") from e
    except json.JSONDecodeError as e:
        raise ModelImportError(f"import {src!r}: config.json is not valid JSON ({e}).") from e


# ------------------------------------------------------------------ GGUF


def gguf_info(path: str) -> tuple[str, list[str]]:
    """The GGUF file's architecture and the types of its tensors (without loading them); a GGUF
    transformers would misread (RoPE scaling it drops) is refused here."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct.error/... on bad files
        raise ModelImportError(f"import {path!r}: not a readable GGUF file ({type(e).__name__}: {e}).") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelImportError(f"import {path!r}: the GGUF file has no general.architecture.")
    arch = bytes(field.parts[field.data[0]]).decode()
    scaling = sorted(k for k in reader.fields if k.startswith(f"{arch}.rope.scaling."))
    scaling += ["rope_freqs.weight"] if any(t.name == "rope_freqs.weight" for t in reader.tensors) else []
    if scaling:
        raise ModelImportError(f"import {path!r}: the GGUF file scales RoPE ({', '.join(scaling)}), which "
                               "transformers' GGUF loader drops (the model would run with plain RoPE); import "
                               "the model's HF safetensors directory instead.")
    return arch, sorted({t.tensor_type.name for t in reader.tensors})


def _from_gguf(path: str, out: str) -> tuple[dict[str, str], dict]:
    arch, types = gguf_info(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelImportError(f"import {path!r}: GGUF architecture {arch!r} is not supported; "
                               f"supported: {', '.join(GGUF_ARCHITECTURES)} (glm4_moe: import its HF directory).")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg, changes = normalize_config(json.loads(model.config.to_json_string(use_diff=False)), path)
    cfg["architectures"] = [HF_CLASSES[cfg["model_type"]]]
    save_weights(model, out)
    del model
    _write_json(os.path.join(out, "config.json"), cfg)  # over save_pretrained's: the normalised one
    files = {n: os.path.join(out, n) for n in sorted(os.listdir(out))}
    converted = [f"dequantized GGUF tensors ({', '.join(types)}) to float32"] + changes
    return files, {"kind": "gguf", "architecture": arch, "converted": converted,
                   "chat_template": "chat_template.jinja" in files}


def save_weights(model, out: str) -> None:
    """`model`'s weights (and generation_config.json) in out/ as transformers writes a checkpoint: its
    on-disk names (`revert_weight_conversion`, what save_pretrained applies; save_pretrained itself
    refuses a GGUF-loaded model), which for a MoE model are one tensor per expert
    (`mlp.experts.{e}.gate_proj.weight`) where the loaded model holds them fused, as every reader of the
    family's tensor map expects; a tied lm_head left out."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding, as save_pretrained does
    state = revert_weight_conversion(model, state)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    model.generation_config.save_pretrained(out)


# ------------------------------------------------------------------ config


def normalize_config(cfg: dict, source: str) -> tuple[dict, list[str]]:
    """`cfg` as both readers take it, and what was changed; refuses what they cannot serve."""
    cfg, changes = dict(cfg), []
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if cfg.pop(key, None) is not None and key == "quantization_config":
            changes.append("dropped quantization_config")
    check_supported(cfg, f"import {source!r}", ModelImportError)
    for field in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(field)
        if isinstance(rope, dict) and "type" in rope:
            cfg[field] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": rope["type"]}
            changes.append(f"{field}.type -> {field}.rope_type")
    _check_readers(cfg, source)
    return cfg, changes


def check_supported(cfg: dict, where: str, error: type[Exception] = UnsupportedModel):
    """The ModelSpec of a config.json dict a user brings, else `error` saying `where` and what is not
    handled: a model_type outside FAMILIES (naming them), a RoPE type or option its family's adapter
    refuses (naming what it handles), a missing field. Plain data: `miles validate` calls it too."""
    mtype = cfg.get("model_type")
    if mtype not in FAMILIES:
        raise error(f"{where}: model_type={mtype!r} is not supported; supported: {', '.join(FAMILIES)} "
                    "(docs/models.md).")
    try:
        return spec_of(cfg)
    except KeyError as e:
        raise error(f"{where}: config.json lacks {e} (model_type={mtype!r}).") from e
    except UnsupportedModel as e:
        raise error(f"{where}: {e} (docs/models.md).") from e


def _check_readers(cfg: dict, source: str) -> None:
    """The CPU engine must read the config too (the trainer reads the family's spec, checked above);
    its refusal, named."""
    # torch: only an import pays for it (the driver and tasks import this module)
    from miles_core.engines.model import ModelLoadError, spec_from_config

    try:
        spec_from_config(cfg, source)
    except KeyError as e:
        raise ModelImportError(f"import {source!r}: config.json lacks {e} (model_type={cfg['model_type']!r}).") from e
    except (ModelLoadError, UnsupportedModel) as e:
        raise ModelImportError(f"import {source!r}: the model cannot be served or trained: {e}") from e


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")

