"""Prompt datasets: normalize any source into the run root once, then read it back cheaply.

`prepare_dataset(data_section, store)` reads `--prompt-data` (JSONL, Parquet or Arrow; a local
path or any fsspec URI; or `builtin:*`) and writes one normalized Arrow IPC file into the run
root, `data/prompts.arrow`, followed by `data/prompts.hash.json` (content hash, row count,
source). The hash file is written last: it is the completion marker (DESIGN §3), so a reader
never sees a half-written dataset as complete.

Normalized columns:
    prompt    list<int32>  token ids (text prompts are tokenized with the model's tokenizer)
    label     string       the label the reward compares against (non-string labels as JSON)
    task      string       task name (e.g. "reverse4"; "" when the source has none)
    metadata  string       JSON object (the source row's `metadata` field, "{}" when absent)

The content hash covers the source bytes and everything that changes the normalized output
(column keys, tokenizer identity, format version). When the run root already holds a dataset
with the same hash, nothing is re-read or re-tokenized. Bad rows raise `DatasetError` naming the
file, the row and the field; every bad row is listed (up to 20), not just the first.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from miles_core.storage import Store, normalize_uri, validate_name

FORMAT_VERSION = "1"
MAX_REPORTED_ERRORS = 20
_INT32_MAX = 2**31 - 1

PROMPT_SCHEMA = pa.schema(
    [
        pa.field("prompt", pa.list_(pa.int32()), nullable=False),
        pa.field("label", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
    ],
    metadata={b"miles.prompts_format": FORMAT_VERSION.encode()},
)

Tokenizer = Callable[[str], list[int]]


class DatasetError(ValueError):
    """A dataset that cannot be normalized. The message names the file, row and field."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class DatasetInfo:
    """Where a normalized dataset lives and what it holds."""

    uri: str
    content_hash: str
    num_rows: int
    source: str


def data_key(name: str) -> str:
    return f"data/{validate_name(name, 'dataset name')}.arrow"


def hash_key(name: str) -> str:
    return f"data/{validate_name(name, 'dataset name')}.hash.json"


# ----------------------------------------------------------------------------- public API


def prepare_dataset(data, store: Store, *, hf_checkpoint: str = "builtin:tiny-gpt",
                    tokenizer: Tokenizer | None = None, name: str = "prompts") -> DatasetInfo:
    """Normalize `data.prompt_data` (a DataSection, or a source string) into `store` (the run root).

    `tokenizer` (text -> token ids) is used for text prompts; by default it is loaded lazily from
    `hf_checkpoint` the first time a text prompt is met (token-id datasets never load it).
    Returns without reading the source rows again when the stored content hash is unchanged.
    """
    source, input_key, label_key = _source_and_keys(data)
    raw = read_source_bytes(source)
    content_hash = _content_hash(raw, source, input_key, label_key, hf_checkpoint)
    existing = stored_dataset_info(store, name)
    if existing is not None and existing.content_hash == content_hash and store.exists(data_key(name)):
        return existing
    if existing is not None and existing.content_hash != content_hash and store.exists("STATUS.json"):
        raise DatasetError(
            f"{store.uri()} already trains on a different dataset (source {existing.source!r}, hash "
            f"{existing.content_hash[:12]}); a run lineage keeps its dataset so no prompt is lost or repeated "
            f"across segments. Start a new --run-id for {source!r}, or restore the original dataset."
        )
    tok = tokenizer or _LazyTokenizer(hf_checkpoint)
    rows = list(_normalized_rows(source, raw, input_key, label_key, tok))
    if not rows:
        raise DatasetError(f"{source}: the dataset has no rows.")
    table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, PROMPT_SCHEMA) as writer:
        writer.write_table(table)
    store.put_bytes(data_key(name), sink.getvalue())
    meta = {"content_hash": content_hash, "num_rows": table.num_rows, "source": source,
            "format_version": FORMAT_VERSION, "input_key": input_key, "label_key": label_key,
            "tokenizer": hf_checkpoint, "created_at": time.time()}
    store.put_json(hash_key(name), meta)  # the completion marker: written last
    return DatasetInfo(store.uri(data_key(name)), content_hash, table.num_rows, source)


def dataset_fingerprint(data, *, hf_checkpoint: str = "builtin:tiny-gpt") -> str:
    """The content hash `prepare_dataset` would compute, without normalizing anything."""
    source, input_key, label_key = _source_and_keys(data)
    return _content_hash(read_source_bytes(source), source, input_key, label_key, hf_checkpoint)


def stored_dataset_info(store: Store, name: str = "prompts") -> DatasetInfo | None:
    """The normalized dataset in the run root, or None when there is none (or it is incomplete)."""
    if not store.exists(hash_key(name)):
        return None
    meta = store.get_json(hash_key(name))
    return DatasetInfo(store.uri(data_key(name)), meta["content_hash"], int(meta["num_rows"]), meta["source"])


def load_prompt_table(store: Store, name: str = "prompts") -> pa.Table:
    if stored_dataset_info(store, name) is None:
        raise DatasetError(
            f"no normalized dataset {name!r} in {store.uri()}: {hash_key(name)} is missing. "
            "Run prepare_data (or miles_core.data.prepare_dataset) first."
        )
    raw = store.get_bytes(data_key(name))
    try:
        table = pa.ipc.open_file(pa.py_buffer(raw)).read_all()
    except pa.ArrowInvalid as e:
        raise DatasetError(f"{store.uri(data_key(name))} is not a readable Arrow file: {e}") from e
    missing = [f.name for f in PROMPT_SCHEMA if f.name not in table.column_names]
    if missing:
        raise DatasetError(f"{store.uri(data_key(name))} lacks columns {missing}; re-run prepare_data.")
    return table


def load_prompts(store: Store, name: str = "prompts") -> list[dict]:
    """Rows {prompt: [ids], label: str, task: str, metadata: str} of the normalized dataset, in order."""
    return load_prompt_table(store, name).to_pylist()


# ----------------------------------------------------------------------------- reading sources


def read_source_bytes(source: str) -> bytes:
    """The bytes the content hash covers: the file, or the canonical JSON of a builtin dataset."""
    if source.startswith("builtin:"):
        from miles_core.rollout.builtin_tasks import builtin_rows

        try:
            rows = builtin_rows(source)
        except ValueError as e:
            raise DatasetError(f"--prompt-data={source!r}: {e}") from e
        return json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()
    import fsspec

    uri = normalize_uri(source)
    try:
        with fsspec.open(uri, "rb", compression="infer") as f:
            return f.read()
    except FileNotFoundError as e:
        raise DatasetError(f"prompt dataset {source!r} not found ({uri}). Check --prompt-data.") from e
    except Exception as e:  # noqa: BLE001 - wrap with the source named, keep the cause
        raise DatasetError(f"cannot read prompt dataset {source!r}: {type(e).__name__}: {e}") from e


def source_format(source: str) -> str:
    if source.startswith("builtin:"):
        return "builtin"
    base = source.rsplit("/", 1)[-1].lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    if base.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if base.endswith((".parquet", ".pq")):
        return "parquet"
    if base.endswith((".arrow", ".feather", ".ipc")):
        return "arrow"
    raise DatasetError(
        f"prompt dataset {source!r}: unknown format; use a .jsonl, .parquet or .arrow file "
        "(optionally .gz), or a builtin:* dataset."
    )


def _raw_rows(source: str, raw: bytes) -> Iterator[tuple[str, Any]]:
    """(row label for errors, row dict or an error string) in file order."""
    fmt = source_format(source)
    if fmt == "builtin":
        for i, row in enumerate(json.loads(raw)):
            yield f"row {i}", row
        return
    if fmt == "jsonl":
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, f"not valid UTF-8 (byte {e.start}: {line[e.start:e.start + 1]!r})"
                continue
            try:
                row = json.loads(text)
            except ValueError as e:
                yield where, f"not valid JSON ({e})"
                continue
            yield where, row if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"
        return
    table = _read_table(source, raw, fmt)
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i} (0-based)", row


def _read_table(source: str, raw: bytes, fmt: str) -> pa.Table:
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(pa.BufferReader(raw))
        try:
            return pa.ipc.open_file(pa.py_buffer(raw)).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(pa.py_buffer(raw)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{source}: not a readable {fmt} file: {e}") from e


# ----------------------------------------------------------------------------- normalization


def _normalized_rows(source: str, raw: bytes, input_key: str, label_key: str,
                     tokenizer: Tokenizer) -> Iterable[dict]:
    errors: list[str] = []
    n_bad = 0
    out = []
    for where, row in _raw_rows(source, raw):
        try:
            if isinstance(row, str):
                raise _RowError(None, row)
            out.append(_normalize_row(row, input_key, label_key, tokenizer))
        except _RowError as e:
            n_bad += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                field = f" field '{e.field}':" if e.field else ""
                errors.append(f"{source}: {where}:{field} {e.message}")
    if errors:
        more = f"\n  ... and {n_bad - len(errors)} more" if n_bad > len(errors) else ""
        raise DatasetError(f"{n_bad} bad row(s) in prompt dataset {source}:\n  " + "\n  ".join(errors) + more)
    return out


class _RowError(Exception):
    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def _normalize_row(row: dict, input_key: str, label_key: str, tokenizer: Tokenizer) -> dict:
    if input_key not in row or row[input_key] is None:
        raise _RowError(input_key, f"missing (row keys: {sorted(row)[:10]}); set --input-key to the prompt column.")
    prompt = _prompt_ids(row[input_key], input_key, tokenizer)
    if label_key:
        if label_key not in row or row[label_key] is None:
            raise _RowError(label_key, "missing; set --label-key to the label column.")
        label = _text(row[label_key], label_key)
    else:
        label = ""
    task = row.get("task") or ""
    if not isinstance(task, str):
        raise _RowError("task", f"expected a string, got {type(task).__name__}.")
    metadata = row.get("metadata")
    if metadata is None:
        metadata = "{}"
    elif isinstance(metadata, dict):
        metadata = json.dumps(metadata, sort_keys=True)
    elif isinstance(metadata, str):
        try:
            if not isinstance(json.loads(metadata), dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise _RowError("metadata", f"expected a JSON object (or a string holding one): {e}.") from e
    else:
        raise _RowError("metadata", f"expected a JSON object, got {type(metadata).__name__}.")
    return {"prompt": prompt, "label": label, "task": task, "metadata": metadata}


def _text(value: Any, field: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _RowError(field, f"not valid UTF-8 (byte {e.start}).") from e
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError as e:
        raise _RowError(field, f"cannot be stored as JSON: {e}.") from e


def _prompt_ids(value: Any, field: str, tokenizer: Tokenizer) -> list[int]:
    if isinstance(value, bytes):
        value = _text(value, field)
    if isinstance(value, str):
        if not value.strip():
            raise _RowError(field, "empty prompt.")
        try:
            ids = list(tokenizer(value))
        except Exception as e:  # noqa: BLE001 - a tokenizer failure is a row error with its cause
            raise _RowError(field, f"tokenizer failed: {type(e).__name__}: {e}") from e
        if not ids:
            raise _RowError(field, "tokenizes to no tokens.")
        return _check_ids(ids, field)
    if isinstance(value, (list, tuple)):
        if not value:
            raise _RowError(field, "empty prompt (no token ids).")
        if all(isinstance(v, dict) for v in value):
            raise _RowError(field, "chat messages are not supported; render them to text (or token ids) first.")
        return _check_ids(value, field)
    raise _RowError(field, f"expected text or a list of token ids, got {type(value).__name__}.")


def _check_ids(ids, field: str) -> list[int]:
    out = []
    for j, v in enumerate(ids):
        if isinstance(v, bool) or not isinstance(v, int):
            if hasattr(v, "__index__") and not isinstance(v, bool):  # numpy integers
                v = int(v)
            else:
                raise _RowError(field, f"token {j} is {v!r} ({type(v).__name__}); token ids must be integers.")
        if not 0 <= v <= _INT32_MAX:
            raise _RowError(field, f"token {j} = {v} is out of range [0, {_INT32_MAX}].")
        out.append(v)
    return out


class _LazyTokenizer:
    """Loads the model's tokenizer the first time a text prompt needs it."""

    def __init__(self, hf_checkpoint: str):
        self.hf_checkpoint = hf_checkpoint
        self._tok = None

    def __call__(self, text: str) -> list[int]:
        if self._tok is None:
            self._tok = tokenizer_for(self.hf_checkpoint)
        return self._tok(text)


def tokenizer_for(hf_checkpoint: str) -> Tokenizer:
    """text -> token ids with the tokenizer of `--hf-checkpoint` (no special tokens added)."""
    if hf_checkpoint.startswith("builtin:"):
        from miles_core.models.builtin import digit_tokenizer

        tok = digit_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _source_and_keys(data) -> tuple[str, str, str]:
    if isinstance(data, str):
        return data, "prompt", "label"
    return data.prompt_data, data.input_key, data.label_key


def _content_hash(raw: bytes, source: str, input_key: str, label_key: str, tokenizer_id: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, "input_key": input_key, "label_key": label_key,
                         "tokenizer": tokenizer_id, "format_of": source_format(source)}, sort_keys=True).encode())
    h.update(b"\0")
    h.update(raw)
    return h.hexdigest()
