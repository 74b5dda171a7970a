"""The bad-input corpus (issue 16 item 3): each case is one bad input a user can give.

Every case asserts a clear error naming the problem (the flag, key, file or function) and, for the
`miles` CLI, an exit status != 0 with a one-line message on stderr (no traceback as the only
message); the storage cases also assert that nothing already committed is lost. Configuration cases
run through `miles validate`, which is the same `validate()` every task and the driver call before
any cluster or actor starts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pyarrow as pa
import pytest

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.buffer import objects as O
from miles_core.cli import main as miles
from miles_core.data import DatasetError, prepare_dataset
from miles_core.node_local import HandoffError, localize
from miles_core.rollout.rewards import Rewarder
from miles_core.samples import SAMPLE_SCHEMA, SampleStatus, SchemaError, groups_to_batch, ipc_to_groups
from miles_core.storage import InvalidName, Store
from tests.integration.test_buffer_durable import make_group

# (flags, what the message must name). Ranges of numeric flags, unknown values, malformed values.
CONFIG_CASES = [
    (["--eps-clip", "-0.1"], "--eps-clip=-0.1 must be > 0"),
    (["--eps-clip-high", "0"], "--eps-clip-high=0.0 must be > 0"),
    (["--rollout-top-k", "0"], "--rollout-top-k=0 must be -1 (off) or >= 1"),
    (["--rollout-top-p", "1.5"], "--rollout-top-p=1.5 must be in (0, 1]"),
    (["--lr", "0"], "--lr=0.0 must be > 0"),
    (["--lr", "nan"], "--lr=nan must be a finite number"),
    (["--kl-loss-coef", "inf"], "--kl-loss-coef=inf must be a finite number"),
    (["--num-rollout", "0"], "--num-rollout=0 must be >= 1"),
    (["--rollout-batch-size", "0"], "--rollout-batch-size=0 must be >= 1"),
    (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt=0 must be >= 1"),
    (["--max-weight-staleness", "-1"], "--max-weight-staleness=-1 must be >= 0"),
    (["--rollout-temperature", "-1"], "--rollout-temperature=-1.0 must be >= 0"),
    (["--sglang-mem-fraction-static", "1.5"], "--sglang-mem-fraction-static=1.5 must be in (0, 1)"),
    (["--engine-request-timeout-seconds", "0"], "--engine-request-timeout-seconds=0.0 must be > 0"),
    (["--engine-max-running-requests", "0"], "--engine-max-running-requests=0 must be >= 1"),
    (["--weight-decay", "-0.1"], "--weight-decay=-0.1 must be >= 0"),
    (["--clip-grad", "-1"], "--clip-grad=-1.0 must be >= 0"),
    (["--entropy-coef", "-0.01"], "--entropy-coef=-0.01 must be >= 0"),
    (["--tiny-hidden-size", "130"], "--tiny-hidden-size=130 must be a multiple of --tiny-num-heads=4"),
    (["--eval-max-prompts", "0"], "--eval-max-prompts=0 must be >= 1"),
    (["--seed", "-1"], "--seed=-1 must be >= 0"),
    (["--buffer-coalesce-seconds", "-1"], "--buffer-coalesce-seconds=-1.0 must be >= 0"),
    (["--async-data-buffer-capacity-factor", "0"], "--async-data-buffer-capacity-factor=0.0 must be > 0"),
    (["--deadline-seconds", "0"], "--deadline-seconds=0.0 must be > 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size=0 must be >= 1"),
    (["--engine-backend", "tpu"], "--engine-backend: invalid choice: 'tpu'"),
    (["--async-unused-samples-handler", "keep"], "--async-unused-samples-handler: invalid choice: 'keep'"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--num-rollout", "ten"], "--num-rollout"),
    (["--prompt-data", "builtin:nope"], "--prompt-data='builtin:nope': unknown builtin dataset"),
    (["--hf-checkpoint", "builtin:nope"], "--hf-checkpoint='builtin:nope': unknown builtin model"),
    (["--eval-prompt-data", "heldout"], "--eval-prompt-data 'heldout': expected name=uri"),
    (["--run-id", "../escape"], "--run-id='../escape': '/' is not allowed"),
    (["--run-id", ".."], "--run-id='..': '..' is not allowed"),
    (["--engine-bind-host", "0.0.0.0"], "--engine-bind-host=0.0.0.0 exposes the engine servers"),
    (["--prompt-data", "/no/such/prompts.jsonl"], "--prompt-data='/no/such/prompts.jsonl': no such file"),
    (["--hf-checkpoint", "file:///no/such/model"], "--hf-checkpoint='file:///no/such/model': no such file"),
    (["--eval-prompt-data", "h=/no/such/eval.jsonl"], "--eval-prompt-data='/no/such/eval.jsonl': no such file"),
    (["--ref-load", "/no/such/ref"], "--ref-load='/no/such/ref': no such file"),
    (["--custom-rm-path", "no_such_module_xyz:reward"], "--custom-rm-path"),
    (["--custom-generate-function-path", "no_such_module_xyz:generate"], "--custom-generate-function-path"),
    (["--custom-async-data-buffer-path", "no-colon"], "--custom-async-data-buffer-path"),
    (["--dynamic-sampling-filter-path", "no_such_module_xyz:f"], "--dynamic-sampling-filter-path"),
]


def _miles(argv: list[str], capsys) -> tuple[int, str]:
    rc = miles(argv)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("flags, named", CONFIG_CASES, ids=[" ".join(c[0]) for c in CONFIG_CASES])
def test_bad_configuration_is_refused_by_name(flags, named, capsys, monkeypatch):
    monkeypatch.delenv("MILES_ENGINE_API_KEY", raising=False)
    rc, err = _miles(["validate", *flags], capsys)
    assert rc != 0 and named in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["buffer", "inspect", "file:///no/such/run"], ["report", "/no/such/run"]])
def test_cli_on_a_run_root_that_does_not_exist(argv, capsys):
    rc, err = _miles(argv, capsys)
    assert rc != 0 and "no run at" in err and "no/such/run" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["buffer", "list", "x"], ["report"], ["no-such-command"],
                                  ["import-model", "/no/such/model.gguf", "file:///tmp/out"]])
def test_cli_usage_errors(argv, capsys):
    rc, err = _miles(argv, capsys)
    assert rc != 0 and err.strip() and "Traceback" not in err


def _buffer_with(root: str, n: int) -> None:
    with DurableBuffer.open(Store(root), capacity_groups=n, unused_handler=DropUnused(), consumed_through_step=-1) as b:
        for i in range(n):
            b.put(make_group(i))


def _ipc(batch: pa.RecordBatch, schema: pa.Schema) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _unknown_major() -> bytes:
    batch = groups_to_batch([make_group(99)])
    schema = SAMPLE_SCHEMA.with_metadata({b"miles.schema_version": b"9.0"})
    return _ipc(batch.replace_schema_metadata(schema.metadata), schema)


BAD_OBJECTS = {
    "corrupt": lambda: b"this is not arrow",
    "truncated": lambda: O.encode_object([groups_to_batch([make_group(98)])])[:-40],
    "unknown-schema-major": _unknown_major,
    "empty": lambda: b"",
}


@pytest.mark.parametrize("kind", sorted(BAD_OBJECTS))
def test_a_bad_buffer_object_is_quarantined_and_nothing_committed_is_lost(kind, tmp_path):
    root = f"file://{tmp_path}/run"
    _buffer_with(root, 3)
    store = Store(root)
    bad = O.group_key("wbad", 0)
    store.put_bytes(bad, BAD_OBJECTS[kind]())
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1) as b:
        assert sorted(b.available_group_ids()) == ["g0000", "g0001", "g0002"]
        assert b.quarantined_total == 1
    reason = store.get_json(O.quarantine_key(bad) + O.REASON_SUFFIX)
    assert reason["source"] == bad and reason["reason"]


def test_an_unknown_schema_major_is_named():
    with pytest.raises(SchemaError, match="unknown major 9"):
        ipc_to_groups(_unknown_major())


@pytest.mark.parametrize("key", ["../escape.json", "a/../../escape.json"])
def test_storage_keys_with_dotdot_are_refused(key, tmp_path):
    with pytest.raises(InvalidName, match="'..' is not allowed"):
        Store(f"file://{tmp_path}/root").put_bytes(key, b"x")
    assert not (tmp_path / "escape.json").exists()


def test_a_listed_key_that_escapes_a_local_copy_is_refused(tmp_path, monkeypatch):
    """An object store can hold a key like `sub/../../x`; copying a snapshot to this node refuses it
    before anything is written (memory:// stands in for the object store)."""
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    src = Store("memory://bad-inputs/snap")
    src.put_bytes(".complete", b"")
    monkeypatch.setattr(Store, "list", lambda self, prefix="": [".complete", "sub/../../../../evil.txt"])
    with pytest.raises(HandoffError, match=r"lists the key 'sub/\.\./\.\./\.\./\.\./evil.txt'"):
        localize(src.uri(), "weights", required=".complete")
    assert not list(tmp_path.rglob("evil.txt"))


def test_a_snapshot_without_its_marker_is_refused(tmp_path):
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no such directory with .complete"):
        localize((tmp_path / "snap").as_uri(), "weights", required=".complete")


ROW_CASES = [
    ({"text": "hi", "label": "1"}, "prompt", "missing"),
    ({"prompt": "", "label": "1"}, "prompt", "empty prompt"),
    ({"prompt": [], "label": "1"}, "prompt", "empty prompt"),
    ({"prompt": 12, "label": "1"}, "prompt", "expected text or a list of token ids"),
    ({"prompt": "hi"}, "label", "missing"),
    ({"prompt": "hi", "label": "1", "metadata": "[1, 2]"}, "metadata", "expected a JSON object"),
]


@pytest.mark.parametrize("row, field, problem", ROW_CASES, ids=[f"{c[1]}-{c[2]}" for c in ROW_CASES])
def test_bad_dataset_rows_are_named(row, field, problem, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "ok", "label": "1"}) + "\n" + json.dumps(row) + "\n")
    store = Store(f"file://{tmp_path}/run")
    with pytest.raises(DatasetError) as e:
        prepare_dataset(str(src), store, tokenizer=lambda text: [1, 2, 3])
    assert field in str(e.value) and problem in str(e.value) and "row" in str(e.value)
    assert not store.list("data/")  # nothing half-written


def test_the_corpus_has_at_least_40_cases():
    n = len(CONFIG_CASES) + 2 + 4 + len(BAD_OBJECTS) + 1 + 2 + 2 + len(ROW_CASES) + 4
    assert n >= 40, n


def hangs(sample):
    threading.Event().wait(30)  # a reward stuck on a lock or a dead service
    return 1.0


async def hangs_async(sample):
    await asyncio.sleep(30)
    return 1.0


def raises(sample):
    raise KeyError("label")


def not_a_number(sample):
    return "yes"


@pytest.mark.parametrize("fn, named", [(hangs, "did not return within 0.5 s (--reward-timeout-seconds)"),
                                       (hangs_async, "did not return within 0.5 s (--reward-timeout-seconds)"),
                                       (raises, "KeyError: 'label'"), (not_a_number, "'yes', not a number")],
                         ids=["hanging", "hanging-async", "raising", "not-a-number"])
def test_a_bad_reward_function_fails_its_samples_not_the_run(fn, named):
    rewarder = Rewarder(fn, timeout_seconds=0.5)
    group = make_group(0)
    for s in group.samples:
        s.reward = None
    started = time.monotonic()
    asyncio.run(rewarder.score_group(group))
    rewarder.close(0.0)
    assert time.monotonic() - started < 10
    for s in group.samples:
        assert s.status == SampleStatus.FAILED and s.reward is None
        assert named in json.loads(s.metadata)["reward_error"]
    if fn in (hangs, hangs_async):
        assert fn.__qualname__ in json.loads(group.samples[0].metadata)["reward_error"]
