"""Prompt dataset normalization (miles_core.prepare.dataset, docs/deployment.md).

Pins: every accepted source format lands as the same normalized Arrow table in the run root;
bad rows fail with file, row and field named (never a bare stack trace, docs/architecture.md); an
unchanged content hash skips re-normalization; a run lineage cannot silently switch datasets.
"""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_core.config.sections import DataSection
from miles_core.prepare.dataset import dataset_fingerprint, prepare_dataset
from miles_core.rollout.prompts import (
    PROMPT_SCHEMA,
    DatasetError,
    data_key,
    hash_key,
    load_prompt_table,
    load_prompts,
    stored_dataset_info,
)
from miles_core.storage import Store

ROWS = [
    {"prompt": [1, 2, 3, 4, 10], "label": "4321", "task": "reverse4"},
    {"prompt": [5, 6, 7, 8, 10], "label": "8765", "metadata": {"src": "x"}},
]


class CountingTokenizer:
    """Splits on whitespace into digit ids; counts calls so tests can see re-tokenization."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        return [int(t) if t.isdigit() else 10 for t in text.split()]


def write_jsonl(path, rows, raw_lines: list[bytes] = ()):
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return str(path)


@pytest.fixture
def store(tmp_path):
    return Store(f"file://{tmp_path}/run")


def test_jsonl_token_ids_normalized(tmp_path, store):
    src = write_jsonl(tmp_path / "p.jsonl", ROWS)
    info = prepare_dataset(src, store)
    assert info.num_rows == 2 and info.uri.endswith("data/prompts.arrow")
    rows = load_prompts(store)
    assert rows[0] == {"prompt": [1, 2, 3, 4, 10], "label": "4321", "task": "reverse4", "metadata": "{}"}
    assert rows[1]["task"] == "" and json.loads(rows[1]["metadata"]) == {"src": "x"}
    assert load_prompt_table(store).schema.equals(PROMPT_SCHEMA, check_metadata=False)
    assert store.exists(hash_key("prompts"))


def test_text_prompts_use_the_given_tokenizer(tmp_path, store):
    tok = CountingTokenizer()
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1 2 3 4 <sep>", "label": 4321}])
    prepare_dataset(src, store, tokenizer=tok)
    (row,) = load_prompts(store)
    assert row["prompt"] == [1, 2, 3, 4, 10]
    assert row["label"] == "4321"  # non-string labels are stored as JSON text
    assert tok.calls == 1


def test_text_prompts_default_to_the_model_tokenizer(tmp_path, store):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1 2 3 4 <sep>", "label": "4321"}])
    prepare_dataset(src, store, tokenizer_source="builtin:tiny-gpt")
    assert load_prompts(store)[0]["prompt"] == [1, 2, 3, 4, 10]


def test_parquet_arrow_and_gzip_sources_match_jsonl(tmp_path):
    table = pa.Table.from_pylist([{"prompt": r["prompt"], "label": r["label"]} for r in ROWS])
    pq.write_table(table, tmp_path / "p.parquet")
    with pa.OSFile(str(tmp_path / "p.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with gzip.open(tmp_path / "p.jsonl.gz", "wb") as f:
        f.write(b"".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}).encode() + b"\n" for r in ROWS))
    results = []
    for name in ("p.parquet", "p.arrow", "p.jsonl.gz"):
        st = Store(f"file://{tmp_path}/run-{name}")
        prepare_dataset(str(tmp_path / name), st)
        results.append(load_prompts(st))
    assert results[0] == results[1] == results[2]
    assert [r["prompt"] for r in results[0]] == [r["prompt"] for r in ROWS]


def test_builtin_dataset(store):
    info = prepare_dataset(DataSection(prompt_data="builtin:reverse4"), store)
    assert info.num_rows == 9500
    first = load_prompts(store)[0]
    assert first["prompt"] == [0, 0, 0, 0, 10] and first["task"] == "reverse4"


def test_input_and_label_keys_from_the_data_section(tmp_path, store):
    src = write_jsonl(tmp_path / "k.jsonl", [{"question": [3, 4], "answer": "x"}])
    prepare_dataset(DataSection(prompt_data=src, input_key="question", label_key="answer"), store)
    assert load_prompts(store)[0]["prompt"] == [3, 4]


def test_bad_rows_name_file_row_and_field(tmp_path, store):
    """Regression guard: a malformed row must come back as a message naming file, row and field."""
    src = write_jsonl(
        tmp_path / "bad.jsonl",
        [ROWS[0], {"label": "1"}, {"prompt": [], "label": "1"}, {"prompt": [1, "a"], "label": "1"},
         {"prompt": 7, "label": "1"}, {"prompt": [1]}, {"prompt": "   ", "label": "1"}],
        raw_lines=[b"\xff\xfe not utf8", b"{not json"],
    )
    with pytest.raises(DatasetError) as e:
        prepare_dataset(src, store, tokenizer=CountingTokenizer())
    msg = str(e.value)
    assert "8 bad row(s)" in msg
    assert f"{src}: line 2: field 'prompt': missing" in msg
    assert "line 3: field 'prompt': empty prompt" in msg
    assert "line 4: field 'prompt': token 1 is 'a'" in msg
    assert "line 5: field 'prompt': expected text or a list of token ids, got int" in msg
    assert "line 6: field 'label': missing" in msg
    assert "line 7: field 'prompt': empty prompt" in msg
    assert "line 8: not valid UTF-8" in msg
    assert "line 9: not valid JSON" in msg
    assert not store.exists(data_key("prompts"))  # nothing half-written


def test_bad_table_rows_name_the_row(tmp_path, store):
    pq.write_table(pa.Table.from_pylist([{"prompt": [1], "label": "a"}, {"prompt": [-3], "label": "b"}]),
                   tmp_path / "neg.parquet")
    with pytest.raises(DatasetError, match=r"neg.parquet: row 1 \(0-based\): field 'prompt': token 0 = -3 is out of range"):
        prepare_dataset(str(tmp_path / "neg.parquet"), store)


def test_missing_source_and_unknown_format(tmp_path, store):
    with pytest.raises(DatasetError, match="not found"):
        prepare_dataset(str(tmp_path / "nope.jsonl"), store)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown format"):
        prepare_dataset(str(tmp_path / "x.csv"), store)
    with pytest.raises(DatasetError, match="unknown builtin"):
        prepare_dataset("builtin:nope", store)


def test_unchanged_hash_skips_renormalization(tmp_path, store):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1 2", "label": "x"}])
    tok = CountingTokenizer()
    first = prepare_dataset(src, store, tokenizer=tok)
    second = prepare_dataset(src, store, tokenizer=tok)
    assert first == second and tok.calls == 1
    assert dataset_fingerprint(src) == first.content_hash
    write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1 2 3", "label": "x"}])
    third = prepare_dataset(src, store, tokenizer=tok)
    assert third.content_hash != first.content_hash and tok.calls == 2
    assert load_prompts(store)[0]["prompt"] == [1, 2, 3]


def test_same_content_elsewhere_has_the_same_hash(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", ROWS)
    assert dataset_fingerprint(a) == dataset_fingerprint(b)
    assert dataset_fingerprint(DataSection(prompt_data=a, input_key="other")) != dataset_fingerprint(a)


def test_a_started_run_keeps_its_dataset(tmp_path, store):
    """A lineage that has STATUS.json must not switch datasets under its data-source cursor."""
    src = write_jsonl(tmp_path / "a.jsonl", ROWS)
    prepare_dataset(src, store)
    store.put_json("STATUS.json", {"state": "segment_done", "last_step": 3, "segment": 0})
    write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    with pytest.raises(DatasetError, match="already trains on a different dataset"):
        prepare_dataset(src, store)
    assert stored_dataset_info(store).num_rows == 2


def test_load_without_prepare_is_a_clear_error(store):
    with pytest.raises(DatasetError, match="Run prepare_data"):
        load_prompts(store)


@pytest.mark.s3
def test_source_and_run_root_on_object_storage(storage_root, tmp_path):
    """Both the source and the run root may be any fsspec URI (here: file:// and a real S3 server)."""
    src_store = Store(storage_root + "/src")
    src_store.put_bytes("p.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in ROWS))
    run = Store(storage_root + "/runs/r1")
    info = prepare_dataset(src_store.uri("p.jsonl"), run)
    assert info.num_rows == 2
    assert [r["prompt"] for r in load_prompts(run)] == [r["prompt"] for r in ROWS]
    assert prepare_dataset(src_store.uri("p.jsonl"), run) == info
