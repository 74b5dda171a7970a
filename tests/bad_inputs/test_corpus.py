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
import re
import threading
import time

import pyarrow as pa
import pytest

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.buffer import objects as O
from miles_core.buffer.contract import DataBufferError
from miles_core.cli import main as miles
from miles_core.engines.model import CausalLM, ModelLoadError
from miles_core.prepare.dataset import prepare_dataset
from miles_core.rollout.episodes import GenerateArgs, GenerateFunctionError, load_generate_function
from miles_core.rollout.prompts import DatasetError
from miles_core.rollout.rewards import Rewarder
from miles_core.samples import SAMPLE_SCHEMA, SampleStatus, SchemaError, groups_to_batch, ipc_to_groups
from miles_core.storage import InvalidName, Store
from miles_core.storage.node_local import HandoffError, localize
from tests.integration.test_buffer_durable import make_group

REWARD_TIMEOUT_SECONDS = 0.5  # the rewarder's bound: a hung reward fails its samples after it
GENERATE_TIMEOUT_SECONDS = 0.3  # the custom generate's bound: a tool service that never answers fails after it

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
    (["--reward-timeout-seconds", "-5"], "--reward-timeout-seconds=-5.0 must be > 0"),
    (["--custom-generate-timeout-seconds", "0"], "--custom-generate-timeout-seconds=0.0 must be > 0"),
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
    (["--prompt-data", "htps://example.com/p.jsonl"], "--prompt-data='htps://example.com/p.jsonl': the scheme 'htps://'"),
    (["--hf-checkpoint", "s4://bucket/model"], "--hf-checkpoint='s4://bucket/model': the scheme 's4://'"),
    (["--storage-root", "gz://bucket/miles"], "--storage-root='gz://bucket/miles': the scheme 'gz://'"),
    (["--custom-rm-path", "no_such_module_xyz:reward"], "--custom-rm-path"),
    (["--custom-generate-function-path", "no_such_module_xyz:generate"], "--custom-generate-function-path"),
    (["--custom-generate-function-path", "tests.bad_inputs.test_corpus:not_async_generate"], "is not an async function"),
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
    rc, err = _miles(["validate", "--preset", "tiny-reverse4", *flags], capsys)
    assert rc != 0 and named in err, err
    assert "Traceback" not in err


MISSING_RUNS = [["buffer", "inspect", "file:///no/such/run"], ["report", "/no/such/run"],
                ["buffer", "inspect", "memory://no/such/run"], ["report", "memory://no/such/run"],
                ["fork", "file:///no/such/run", "--at-step", "1", "--new-run", "b"], ["replay", "file:///no/such/run"]]


@pytest.mark.parametrize("argv", MISSING_RUNS, ids=[" ".join(a[:2]) for a in MISSING_RUNS])
def test_cli_on_a_run_root_that_does_not_exist(argv, capsys):
    rc, err = _miles(argv, capsys)
    assert rc != 0 and "no run at" in err and "no/such/run" in err and "Traceback" not in err


def test_cli_on_a_missing_run_root_on_each_backend(storage_root, capsys):
    """A run root exists when it holds config.json, STATUS.json or buffer/ (on S3 there are no directories:
    an empty prefix and a missing one look alike). The same root answers once a buffer is committed."""
    run = f"{storage_root}/runs/typo"
    for argv in (["buffer", "inspect", run], ["report", run, "-o", "/dev/null"]):
        rc, err = _miles(argv, capsys)
        assert rc == 1 and f"no run at {run}" in err and "Traceback" not in err
    _buffer_with(run, 2)
    rc, _ = _miles(["buffer", "inspect", run], capsys)
    assert rc == 0


def test_cli_on_an_empty_directory_is_not_a_run(tmp_path, capsys):
    """A directory that exists but holds no run (config.json, STATUS.json or buffer/) is refused too."""
    rc, err = _miles(["buffer", "inspect", tmp_path.as_uri()], capsys)
    assert rc == 1 and f"no run at {tmp_path.as_uri()}" in err


@pytest.mark.parametrize("argv", [["buffer", "list", "x"], ["report"], ["report", "/tmp", "-o"], ["no-such-command"],
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


@pytest.mark.parametrize("manifest", [b"{not json", b"[1, 2]"], ids=["not-json", "not-an-object"])
def test_a_corrupt_consumption_manifest_refuses_the_reopen_and_loses_nothing(manifest, tmp_path):
    """Without its consumption manifest a reopen cannot know which groups were trained: it refuses, naming
    the manifest, rather than serving them again; the committed groups stay in storage."""
    root = f"file://{tmp_path}/run"
    _buffer_with(root, 3)
    store = Store(root)
    objects = store.list(O.GROUPS)
    store.put_bytes(O.consumed_key(0), manifest)
    with pytest.raises(DataBufferError, match=r"consumption manifest .*consumed/00000000\.json"):
        DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=0)
    assert store.list(O.GROUPS) == objects and len(objects) == 3


def test_an_unknown_schema_major_is_named():
    with pytest.raises(SchemaError, match="unknown major 9"):
        ipc_to_groups(_unknown_major())


@pytest.mark.parametrize("key", ["../escape.json", "a/../../escape.json", "/../escape.json"])
def test_storage_keys_with_dotdot_are_refused(key, tmp_path):
    with pytest.raises(InvalidName, match="'..' is not allowed"):
        Store(f"file://{tmp_path}/root").put_bytes(key, b"x")
    assert not (tmp_path / "escape.json").exists()


@pytest.mark.parametrize("key", ["sub/../../../../evil.txt", "/tmp/evil.txt", "../evil.txt"],
                         ids=["dotdot-inside", "absolute", "dotdot-first"])
def test_a_listed_key_that_escapes_a_local_copy_is_refused(key, tmp_path, monkeypatch):
    """An object store can hold a key like `sub/../../x` or `/x`; copying a snapshot to this node refuses
    it, naming the key, before anything is written (memory:// stands in for the object store)."""
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    src = Store("memory://bad-inputs/snap")
    src.put_bytes(".complete", b"")
    monkeypatch.setattr(Store, "list", lambda self, prefix="": [".complete", key])
    with pytest.raises(HandoffError, match=f"lists the key {re.escape(repr(key))}"):
        localize(src.uri(), "weights", required=".complete")
    assert not list(tmp_path.rglob("evil.txt"))
    assert not list((tmp_path / "cache").rglob(".miles-complete"))  # no half copy is trusted later


def test_a_snapshot_without_its_marker_is_refused(tmp_path):
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no such directory with .complete"):
        localize((tmp_path / "snap").as_uri(), "weights", required=".complete")


def _tiny_model(path, family: str, bad: dict[str, tuple[int, ...]] | None = None):
    """A one-layer HF directory (config.json + model.safetensors) of `family`; `bad` overrides shapes."""
    import torch
    from safetensors.torch import save_file

    if family == "gpt2":
        config = {"model_type": "gpt2", "vocab_size": 13, "n_embd": 8, "n_head": 2, "n_layer": 1, "n_positions": 16}
        shapes = {"wte.weight": (13, 8), "wpe.weight": (16, 8), "ln_f.weight": (8,), "ln_f.bias": (8,),
                  **{f"h.0.{n}": s for n, s in [
                      ("ln_1.weight", (8,)), ("ln_1.bias", (8,)), ("ln_2.weight", (8,)), ("ln_2.bias", (8,)),
                      ("attn.c_attn.weight", (8, 24)), ("attn.c_attn.bias", (24,)), ("attn.c_proj.weight", (8, 8)),
                      ("attn.c_proj.bias", (8,)), ("mlp.c_fc.weight", (8, 32)), ("mlp.c_fc.bias", (32,)),
                      ("mlp.c_proj.weight", (32, 8)), ("mlp.c_proj.bias", (8,))]}}
        prefix = "transformer."
    else:
        config = {"model_type": "llama", "vocab_size": 13, "hidden_size": 8, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "num_hidden_layers": 1, "intermediate_size": 16,
                  "max_position_embeddings": 16}
        shapes = {"embed_tokens.weight": (13, 8), "norm.weight": (8,),
                  **{f"layers.0.{n}": s for n, s in [
                      ("input_layernorm.weight", (8,)), ("post_attention_layernorm.weight", (8,)),
                      ("self_attn.q_proj.weight", (8, 8)), ("self_attn.k_proj.weight", (4, 8)),
                      ("self_attn.v_proj.weight", (4, 8)), ("self_attn.o_proj.weight", (8, 8)),
                      ("mlp.gate_proj.weight", (16, 8)), ("mlp.up_proj.weight", (16, 8)),
                      ("mlp.down_proj.weight", (8, 16))]}}
        prefix = "model."
    shapes |= bad or {}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({prefix + n: torch.zeros(s) for n, s in shapes.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_tiny_snapshots_of_the_shape_cases_load(family, tmp_path):
    """The control of the wrong-shape cases below: with the right shapes the same directory loads."""
    assert CausalLM.load(str(_tiny_model(tmp_path / "snap", family))).spec.hidden_size == 8


SHAPE_CASES = [("gpt2", "wte.weight", (12, 8)), ("gpt2", "h.0.mlp.c_fc.bias", (31,)),
               ("llama", "layers.0.self_attn.k_proj.weight", (8, 8)),
               ("llama", "layers.0.mlp.down_proj.weight", (7, 16))]


@pytest.mark.parametrize("family, name, shape", SHAPE_CASES, ids=[f"{c[0]}-{c[1]}" for c in SHAPE_CASES])
def test_a_snapshot_with_wrong_tensor_shapes_is_refused_at_load(family, name, shape, tmp_path):
    """Weights whose shapes disagree with config.json are refused when an engine loads them (a 400 from
    /update_weights_from_disk), naming the tensor; before, they loaded and failed mid-generation."""
    snap = _tiny_model(tmp_path / "snap", family, {name: shape})
    with pytest.raises(ModelLoadError, match=f"tensor '{re.escape(name)}' has shape {re.escape(str(list(shape)))}"):
        CausalLM.load(str(snap))


@pytest.mark.parametrize("missing, named", [("model.safetensors", "no model.safetensors"),
                                            ("config.json", "no config.json")])
def test_a_snapshot_without_its_weights_or_config_is_refused(missing, named, tmp_path):
    snap = _tiny_model(tmp_path / "snap", "llama")
    (snap / missing).unlink()
    with pytest.raises(ModelLoadError, match=named):
        CausalLM.load(str(snap))


ROW_CASES = [
    ({"text": "hi", "label": "1"}, "prompt", "missing"),
    ({"prompt": "", "label": "1"}, "prompt", "empty prompt"),
    ({"prompt": [], "label": "1"}, "prompt", "empty prompt"),
    ({"prompt": 12, "label": "1"}, "prompt", "expected text or a list of token ids"),
    ({"prompt": "hi"}, "label", "missing"),
    ({"prompt": "hi", "label": "1", "metadata": "[1, 2]"}, "metadata", "expected a JSON object"),
    ({"prompt": "hi", "label": "1", "task": 3}, "task", "expected a string, got int"),
    ({"prompt": [1, "a"], "label": "1"}, "prompt", "token ids must be integers"),
    ("{not json", "line 2", "not valid JSON"),
]


@pytest.mark.parametrize("row, field, problem", ROW_CASES, ids=[f"{c[1]}-{c[2]}" for c in ROW_CASES])
def test_bad_dataset_rows_are_named(row, field, problem, tmp_path):
    src = tmp_path / "prompts.jsonl"
    line = row if isinstance(row, str) else json.dumps(row)
    src.write_text(json.dumps({"prompt": "ok", "label": "1"}) + "\n" + line + "\n")
    store = Store(f"file://{tmp_path}/run")
    with pytest.raises(DatasetError) as e:
        prepare_dataset(str(src), store, tokenizer=lambda text: [1, 2, 3])
    assert field in str(e.value) and problem in str(e.value) and "row" in str(e.value)
    assert not store.list("data/")  # nothing half-written


@pytest.mark.parametrize("name, text, named", [("empty.jsonl", "", "the dataset has no rows"),
                                               ("bad.parquet", "PAR1garbage", "not a readable parquet file")])
def test_an_unreadable_or_empty_dataset_file_is_named(name, text, named, tmp_path):
    (tmp_path / name).write_text(text)
    store = Store(f"file://{tmp_path}/run")
    with pytest.raises(DatasetError, match=named) as e:
        prepare_dataset(str(tmp_path / name), store, tokenizer=lambda text: [1, 2, 3])
    assert name in str(e.value) and not store.list("data/")


RELEASE = threading.Event()  # set after the test: the abandoned thread ends, so pytest's exit never waits on it


def hangs(sample):
    RELEASE.wait(30)  # a reward stuck on a lock or a dead service
    return 1.0


async def hangs_async(sample):
    await asyncio.sleep(30)
    return 1.0


def raises(sample):
    raise KeyError("label")


def raises_timeout(sample):
    raise TimeoutError("reward service timed out")


def not_a_number(sample):
    return "yes"


@pytest.mark.parametrize("fn, named", [(hangs, "did not return within 0.5 s (--reward-timeout-seconds)"),
                                       (hangs_async, "did not return within 0.5 s (--reward-timeout-seconds)"),
                                       (raises, "KeyError: 'label'"), (not_a_number, "'yes', not a number"),
                                       (raises_timeout, "TimeoutError: reward service timed out")],
                         ids=["hanging", "hanging-async", "raising", "not-a-number", "raising-its-own-timeout"])
def test_a_bad_reward_function_fails_its_samples_not_the_run(fn, named):
    RELEASE.clear()
    rewarder = Rewarder(fn, timeout_seconds=REWARD_TIMEOUT_SECONDS)
    group = make_group(0)
    for s in group.samples:
        s.reward = None
    started = time.monotonic()
    try:
        asyncio.run(rewarder.score_group(group))
    finally:
        RELEASE.set()
        rewarder.close(0.0)
    assert time.monotonic() - started < 10
    for s in group.samples:
        assert s.status == SampleStatus.FAILED and s.reward is None
        assert named in json.loads(s.metadata)["reward_error"]
    if fn in (hangs, hangs_async):
        assert fn.__qualname__ in json.loads(group.samples[0].metadata)["reward_error"]


async def generate_hangs(args, sample, sampling_params):
    await asyncio.sleep(30)  # an environment or tool service that never answers


async def generate_raises(args, sample, sampling_params):
    raise ConnectionError("tool server refused")


async def generate_wrong_type(args, sample, sampling_params):
    return {"response": "not a Sample"}


def not_async_generate(args, sample, sampling_params):
    return sample


@pytest.mark.parametrize("fn, named", [
    ("generate_hangs", "did not return within 0.3 s (--custom-generate-timeout-seconds)"),
    ("generate_raises", "raised ConnectionError: tool server refused"),
    ("generate_wrong_type", "returned dict, not a miles_core.samples.Sample")],
    ids=["hanging", "raising", "wrong-type"])
def test_a_bad_generate_function_fails_its_episode_by_name(fn, named):
    """The producer turns GenerateFunctionError into a failed group (tests/integration cover that path);
    here: a hanging episode is cancelled after --custom-generate-timeout-seconds instead of holding its
    submission credit for ever, and every failure names the function."""
    path = f"tests.bad_inputs.test_corpus:{fn}"
    generate = load_generate_function(path, timeout_seconds=GENERATE_TIMEOUT_SECONDS)
    started = time.monotonic()
    with pytest.raises(GenerateFunctionError) as e:
        asyncio.run(generate(GenerateArgs(engine=None), make_group(0).samples[0], {}))
    assert time.monotonic() - started < 10 and path in str(e.value) and named in str(e.value)
