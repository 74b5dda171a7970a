"""Prompt datasets: normalize any source into the run root once, then read it back cheaply.

`prepare_dataset(data_section, store)` reads `--prompt-data` (JSONL, Parquet or Arrow; a local
path or any fsspec URI; or `builtin:*`) and writes one normalized Arrow IPC file into the run
root, `data/prompts.arrow`, followed by `data/prompts.hash.json` (content hash, row count,
source). The hash file is written last: it is the completion marker
(docs/quickstart.md#where-the-run-lives), so a reader
never sees a half-written dataset as complete.

Normalized columns:
    prompt    list<int32>  token ids (text prompts are tokenized with the model's tokenizer)
    label     string       the label the reward compares against (non-string labels as JSON)
    task      string       task name (e.g. "reverse4"; "" when the source has none)
    metadata  string       JSON object (the source row's `metadata` field, "{}" when absent)

Text prompts are tokenized with the run's tokenizer (`tokenizer_source(cfg)`: a builtin model's
digit tokenizer, or the HF directory's files), loaded only when a text prompt is met. With
`--apply-chat-template` a text prompt becomes one user message and a list of {role, content}
messages is used as it is; both are rendered by the tokenizer's chat template with the generation
prompt appended, so the model starts its answer right after the prompt ids. Without the flag, text
is tokenized without special tokens and a message list is a row error. Token-id prompts are used
as they are either way. `--max-seq-len` drops prompts that leave no room for one response token
(counted as `dropped_too_long` in the hash file, and logged).

The content hash covers the source bytes and everything that changes the normalized output
(column keys, tokenizer source, chat template flag, max_seq_len, format version; the last two only
when set, so the hashes of datasets prepared before they existed stay valid). When the run root already holds a dataset
with the same hash, nothing is re-read or re-tokenized. Bad rows raise `DatasetError` naming the
file, the row and the field; every bad row is listed (up to 20), not just the first.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from miles_core.models.tokenizer import load_tokenizer
from miles_core.rollout.builtin_tasks import TEXT_BUILTIN_DATASETS, builtin_rows
from miles_core.rollout.prompts import (
    FORMAT_VERSION,
    PROMPT_SCHEMA,
    DatasetError,
    DatasetInfo,
    data_key,
    hash_key,
    stored_dataset_info,
)
from miles_core.storage import Store, normalize_uri

log = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 20
_INT32_MAX = 2**31 - 1

# A prompt (text, or a list of {role, content} messages) -> token ids.
Tokenizer = Callable[[Any], list[int]]


# ----------------------------------------------------------------------------- public API


def prepare_dataset(data, store: Store, *, tokenizer_source: str = "builtin:tiny-gpt",
                    tokenizer: Any = None, name: str = "prompts") -> DatasetInfo:
    """Normalize `data.prompt_data` (a DataSection, or a source string) into `store` (the run root).

    `tokenizer_source` is `models.source.tokenizer_source(cfg)` (a builtin model name or the
    model's URI); its tokenizer is loaded the first time a text prompt is met (token-id datasets
    never load it). `tokenizer` overrides it: a transformers tokenizer, or a plain callable
    prompt -> ids. `data.apply_chat_template` and `data.max_seq_len` apply (see the module docstring).
    Returns without reading the source rows again when the stored content hash is unchanged.
    """
    settings = _settings(data)
    source, input_key, label_key = settings.source, settings.input_key, settings.label_key
    raw = read_source_bytes(source)
    content_hash = _content_hash(raw, settings, tokenizer_source)
    existing = stored_dataset_info(store, name)
    if existing is not None and existing.content_hash == content_hash and store.exists(data_key(name)):
        return existing
    if existing is not None and existing.content_hash != content_hash and store.exists("STATUS.json"):
        raise DatasetError(
            f"{store.uri()} already trains on a different dataset (source {existing.source!r}, hash "
            f"{existing.content_hash[:12]}); a run lineage keeps its dataset so no prompt is lost or repeated "
            f"across segments. Start a new --run-id for {source!r}, or restore the original dataset."
        )
    tok = _prompt_tokenizer(tokenizer, tokenizer_source, settings)
    rows = _normalized_rows(source, raw, input_key, label_key, tok)
    rows, dropped = _drop_too_long(rows, settings.max_seq_len, source)
    table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, PROMPT_SCHEMA) as writer:
        writer.write_table(table)
    store.put_bytes(data_key(name), sink.getvalue())
    meta = {"content_hash": content_hash, "num_rows": table.num_rows, "source": source,
            "format_version": FORMAT_VERSION, "input_key": input_key, "label_key": label_key,
            "tokenizer": tokenizer_source, "apply_chat_template": settings.apply_chat_template,
            "max_seq_len": settings.max_seq_len, "dropped_too_long": dropped, "created_at": time.time()}
    store.put_json(hash_key(name), meta)  # the completion marker: written last
    return DatasetInfo(store.uri(data_key(name)), content_hash, table.num_rows, source)


def dataset_fingerprint(data, *, tokenizer_source: str = "builtin:tiny-gpt") -> str:
    """The content hash `prepare_dataset` would compute, without normalizing anything."""
    settings = _settings(data)
    return _content_hash(read_source_bytes(settings.source), settings, tokenizer_source)


# ----------------------------------------------------------------------------- reading sources


def read_source_bytes(source: str) -> bytes:
    """The bytes the content hash covers: the file, or the canonical JSON of a builtin dataset."""
    if source.startswith("builtin:"):
        try:
            rows = builtin_rows(source)
        except ValueError as e:
            raise DatasetError(f"--prompt-data={source!r}: {e}") from e
        return json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()

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


def source_rows(source: str) -> Iterator[tuple[str, Any]]:
    """(row label for errors, row dict or why it is not one) of a source's rows as stored, in order,
    without normalizing them (what validation reads to check that the rows can be scored)."""
    return _raw_rows(source, read_source_bytes(source))


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
            return pq.read_table(pa.BufferReader(raw))
        try:
            return pa.ipc.open_file(pa.py_buffer(raw)).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(pa.py_buffer(raw)).read_all()
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{source}: not a readable {fmt} file: {e}") from e


# ----------------------------------------------------------------------------- normalization


def _normalized_rows(source: str, raw: bytes, input_key: str, label_key: str,
                     tokenizer: Tokenizer) -> list[dict]:
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
        return _tokenize(value, field, tokenizer)
    if isinstance(value, (list, tuple)):
        if not value:
            raise _RowError(field, "empty prompt (no token ids).")
        if all(isinstance(v, dict) for v in value):
            return _tokenize(_messages(value, field, tokenizer), field, tokenizer)
        return _check_ids(value, field)
    raise _RowError(field, f"expected text or a list of token ids, got {type(value).__name__}.")


def _messages(value, field: str, tokenizer) -> list[dict]:
    """A chat message list, checked: it needs --apply-chat-template and {role, content} strings."""
    if not getattr(tokenizer, "apply_chat_template", False):  # the lazy loader's flag, or a chat tokenizer
        raise _RowError(field, "a list of chat messages needs --apply-chat-template (the tokenizer's chat "
                               "template renders them); or give the prompt as text or token ids.")
    for j, m in enumerate(value):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _RowError(field, f"message {j} needs string 'role' and 'content' (keys: {sorted(m)[:10]}).")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _tokenize(prompt, field: str, tokenizer: Tokenizer) -> list[int]:
    try:
        ids = list(tokenizer(prompt))
    except DatasetError:
        raise  # the tokenizer itself is unusable (e.g. no chat template): not a row's fault
    except Exception as e:  # noqa: BLE001 - a tokenizer failure is a row error with its cause
        raise _RowError(field, f"tokenizer failed: {type(e).__name__}: {e}") from e
    if not ids:
        raise _RowError(field, "tokenizes to no tokens.")
    return _check_ids(ids, field)


def _drop_too_long(rows: list[dict], max_seq_len: int | None, source: str) -> tuple[list[dict], int]:
    """Rows whose prompt leaves room for at least one response token under --max-seq-len."""
    if not rows:
        raise DatasetError(f"{source}: the dataset has no rows.")
    if max_seq_len is None:
        return rows, 0
    kept = [r for r in rows if len(r["prompt"]) < max_seq_len]
    dropped = len(rows) - len(kept)
    if not kept:
        longest = min(len(r["prompt"]) for r in rows)
        raise DatasetError(f"{source}: all {len(rows)} prompts have >= --max-seq-len={max_seq_len} tokens "
                           f"(the shortest has {longest}), leaving no room for a response; raise --max-seq-len.")
    if dropped:
        log.warning("%s: dropped %d of %d prompts with >= --max-seq-len=%d tokens (no room for a response).",
                    source, dropped, len(rows), max_seq_len)
    return kept, dropped


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
    """Loads the run's tokenizer the first time a text (or chat) prompt needs it."""

    def __init__(self, tokenizer_source: str, apply_chat_template: bool = False):
        self.tokenizer_source = tokenizer_source
        self.apply_chat_template = apply_chat_template
        self._tok = None

    def __call__(self, prompt) -> list[int]:
        if self._tok is None:
            self._tok = tokenizer_for(self.tokenizer_source, self.apply_chat_template)
        return self._tok(prompt)


def tokenizer_for(tokenizer_source: str, apply_chat_template: bool = False) -> Tokenizer:
    """prompt -> token ids with the tokenizer of `tokenizer_source` (see the module docstring)."""
    return _hf_prompt_tokenizer(load_tokenizer(tokenizer_source), tokenizer_source, apply_chat_template)


def _prompt_tokenizer(tokenizer, tokenizer_source: str, settings: "_Settings") -> Tokenizer:
    """The lazy tokenizer of `tokenizer_source`, or an explicit `tokenizer` (a transformers tokenizer
    is wrapped like a loaded one; a plain callable prompt -> ids is used as it is)."""
    if tokenizer is None:
        _check_text_builtin(settings.source, tokenizer_source)
        return _LazyTokenizer(tokenizer_source, settings.apply_chat_template)
    if hasattr(tokenizer, "apply_chat_template"):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return _hf_prompt_tokenizer(tokenizer, name, settings.apply_chat_template)
    return tokenizer


def _hf_prompt_tokenizer(tok, name: str, apply_chat_template: bool) -> Tokenizer:
    if not apply_chat_template:
        return _PlainTokenizer(tok)
    if not getattr(tok, "chat_template", None):
        raise DatasetError(f"--apply-chat-template is set but the tokenizer of {name!r} has no chat template "
                           "(no chat_template in its tokenizer files); unset --apply-chat-template, or use a "
                           "model whose tokenizer has one.")
    return _ChatTokenizer(tok)


class _PlainTokenizer:
    """Text -> ids without special tokens; a message list is refused (it has no apply_chat_template)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


class _ChatTokenizer:
    """Text (one user message) or messages -> the chat template's ids, generation prompt appended."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, prompt) -> list[int]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding; 4.x a list of ids
            out = out["input_ids"]
        if out and isinstance(out[0], (list, tuple)):
            out = out[0]
        return list(out)

    __call__ = apply_chat_template


@dataclass(frozen=True)
class _Settings:
    source: str
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = False
    max_seq_len: int | None = None


def _check_text_builtin(source: str, tokenizer_source: str) -> None:
    if source in TEXT_BUILTIN_DATASETS and tokenizer_source.startswith("builtin:"):
        raise DatasetError(f"--prompt-data={source!r} holds text prompts for a real (instruct) model; the digit "
                           f"tokenizer of --hf-checkpoint={tokenizer_source!r} cannot encode them. Set "
                           "--hf-checkpoint to an HF model directory (and --apply-chat-template).")


BUILTIN_COLUMNS = ("prompt", "label")  # the columns of every builtin: dataset, whatever --input-key says


def columns(source: str, input_key: str, label_key: str) -> tuple[str, str]:
    """(prompt column, label column) of `source`: a builtin dataset's own, else --input-key/--label-key."""
    return BUILTIN_COLUMNS if source.startswith("builtin:") else (input_key, label_key)


def _settings(data) -> _Settings:
    """The normalization settings of a DataSection (or a namespace like one), or of a bare source string."""
    if isinstance(data, str):
        return _Settings(data)
    max_seq_len = getattr(data, "max_seq_len", None)
    if max_seq_len is not None and max_seq_len < 2:
        raise DatasetError(f"--max-seq-len={max_seq_len}: must be at least 2 (one prompt and one response token).")
    return _Settings(data.prompt_data, *columns(data.prompt_data, data.input_key, data.label_key),
                     bool(getattr(data, "apply_chat_template", False)), max_seq_len)


def _content_hash(raw: bytes, settings: _Settings, tokenizer_id: str) -> str:
    key = {"format": FORMAT_VERSION, "input_key": settings.input_key, "label_key": settings.label_key,
           "tokenizer": tokenizer_id, "format_of": source_format(settings.source)}
    if settings.apply_chat_template:  # only when set: default hashes stay those of older versions
        key["apply_chat_template"] = True
    if settings.max_seq_len is not None:
        key["max_seq_len"] = settings.max_seq_len
    h = hashlib.sha256()
    h.update(json.dumps(key, sort_keys=True).encode())
    h.update(b"\0")
    h.update(raw)
    return h.hexdigest()
