"""The normalized prompt dataset in the run root: where it lives, its schema, and its reader.

    rows = load_prompts(store)        # [{prompt: [ids], label, task, metadata}, ...] in order
    info = stored_dataset_info(store) # None until the dataset is complete

`data/{name}.arrow` is one Arrow IPC file; `data/{name}.hash.json` is written after it and is the
completion marker. `miles_core.prepare.dataset` writes both; the rollout data source and evals read.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from miles_core.storage import Store, validate_name

FORMAT_VERSION = "1"

PROMPT_SCHEMA = pa.schema(
    [
        pa.field("prompt", pa.list_(pa.int32()), nullable=False),
        pa.field("label", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
    ],
    metadata={b"miles.prompts_format": FORMAT_VERSION.encode()},
)

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
            "Run prepare_data (or miles_core.prepare.dataset.prepare_dataset) first."
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
