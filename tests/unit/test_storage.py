"""Object storage (docs/quickstart.md#where-the-run-lives) on file:// and memory://, with faults injected from outside.

Faults come from a real unreachable endpoint (a port where nothing listens) and from a
fault-injecting fsspec filesystem registered by this test module, never from switches inside
miles_core. The same behaviours against a real S3 server live in tests/integration/test_storage_s3.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
import types
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

import miles_core.storage as storage
from miles_core.storage import (
    TMP_MARK,
    InvalidName,
    ObjectNotFound,
    StorageError,
    StorageUnavailable,
    Store,
    normalize_uri,
    run_root_uri,
    validate_name,
)
from tests.support.seaweed import free_port

FAKE_KEY = "AKIAFAKEACCESSKEY123"
FAKE_SECRET = "fake-secret-value-must-never-be-printed"


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path) -> Store:
    if request.param == "file":
        return Store(f"file://{tmp_path}/root")
    return Store(f"memory://miles-test-{uuid.uuid4().hex[:10]}/root")


# ----------------------------------------------------------------------------- basic contract


def test_put_get_json_exists_delete(store):
    """Pins: the object API of docs/dev-contracts.md on local and in-memory roots.
    Guards: backend-specific differences leaking into callers (buffer, checkpoints)."""
    store.put_bytes("a/b/c.bin", b"\x00\x01")
    store.put_json("x.json", {"k": [1, 2]})
    assert store.get_bytes("a/b/c.bin") == b"\x00\x01"
    assert store.get_json("x.json") == {"k": [1, 2]}
    assert store.exists("a/b/c.bin") and not store.exists("a/b/nope")
    assert store.size("a/b/c.bin") == 2
    store.put_bytes("a/b/c.bin", b"new")  # overwrite is a full replacement
    assert store.get_bytes("a/b/c.bin") == b"new"
    store.delete("a/b/c.bin")
    assert not store.exists("a/b/c.bin")
    store.delete("a/b/c.bin")  # missing_ok by default
    with pytest.raises(ObjectNotFound):
        store.delete("a/b/c.bin", missing_ok=False)


def test_missing_key_is_object_not_found(store):
    """Pins: reading a missing key raises ObjectNotFound (a FileNotFoundError) naming the URI, at once.
    Guards: a missing object retried as if storage were down, or reported as StorageUnavailable."""
    with pytest.raises(ObjectNotFound) as info:
        store.get_bytes("checkpoints/LATEST")
    assert isinstance(info.value, FileNotFoundError)
    assert store.uri("checkpoints/LATEST") in str(info.value)
    with pytest.raises(ObjectNotFound):
        store.size("checkpoints/LATEST")


def test_move_missing_source_is_object_not_found(store):
    """Pins: moving a missing key raises ObjectNotFound on every backend.
    Guards: a raw FileNotFoundError from os.replace on file:// only (backend-dependent error types)."""
    with pytest.raises(ObjectNotFound):
        store.move("nope", "dst")


def test_get_json_invalid_is_storage_error(store):
    """Pins: a non-JSON object read with get_json is a StorageError naming the URI.
    Guards: a bare JSONDecodeError without the object's location."""
    store.put_bytes("bad.json", b"{not json")
    with pytest.raises(StorageError, match="bad.json"):
        store.get_json("bad.json")


def test_move_list_sizes_child_delete_prefix(store):
    """Pins: move, list_sizes, child stores and delete_prefix.
    Guards: quarantine moves (§6.2) and snapshot retirement (§7.2) losing or leaving objects."""
    store.put_bytes("buffer/groups/w0/000000000001.arrow", b"12345")
    store.move("buffer/groups/w0/000000000001.arrow", "buffer/quarantine/000000000001.arrow")
    assert store.list("buffer") == ["buffer/quarantine/000000000001.arrow"]
    assert store.list_sizes("buffer") == {"buffer/quarantine/000000000001.arrow": 5}
    child = store.child("snapshots/step_000001")
    child.put_bytes("model.safetensors", b"w")
    child.put_bytes(".complete", b"")
    assert child.list() == [".complete", "model.safetensors"]
    assert store.list("snapshots") == ["snapshots/step_000001/.complete", "snapshots/step_000001/model.safetensors"]
    assert child.uri("model.safetensors") == store.uri("snapshots/step_000001/model.safetensors")
    store.delete_prefix("snapshots/step_000001")
    assert store.list("snapshots") == [] and child.list() == []
    assert store.list("does/not/exist") == [] and store.list_sizes("does/not/exist") == {}


def test_local_path_only_for_file(store):
    """Pins: local_path gives a filesystem path on file:// and None elsewhere.
    Guards: callers opening memory:// or s3:// keys as local files."""
    path = store.local_path("k")
    if store.protocol == "file":
        store.put_bytes("k", b"v")
        assert open(path, "rb").read() == b"v"
    else:
        assert path is None


# ----------------------------------------------------------------------------- atomic commit


def test_temporaries_are_never_listed(store):
    """Pins: an in-progress write (a temporary beside the final key) is invisible to list and list_sizes.
    Guards: a reader picking up a half-written buffer object from a listing (§3, §14)."""
    store.put_bytes("buffer/groups/w0/000000000001.arrow", b"done")
    store.fs.pipe_file(store.path(f"buffer/groups/w0/000000000002.arrow{TMP_MARK}{uuid.uuid4().hex}"), b"par")
    assert store.list("buffer/groups") == ["buffer/groups/w0/000000000001.arrow"]
    assert list(store.list_sizes("buffer/groups")) == ["buffer/groups/w0/000000000001.arrow"]


def test_file_put_leaves_no_temporary(tmp_path):
    """Pins: on file:// a commit renames its temporary into place, leaving nothing else in the directory.
    Guards: temporaries accumulating (or a write done in place, visible while partial)."""
    store = Store(str(tmp_path / "r"))
    for i in range(5):
        store.put_bytes("d/k", os.urandom(1000 + i))
    assert os.listdir(tmp_path / "r" / "d") == ["k"]


def _payload(i: int) -> bytes:
    body = os.urandom(random.randint(1, 200_000)) + str(i).encode()
    return hashlib.sha256(body).digest() + body


def _complete(data: bytes) -> bool:
    return hashlib.sha256(data[32:]).digest() == data[:32]


def test_concurrent_writer_reader_never_see_partial(store):
    """Pins: while a writer overwrites one key and adds new keys, concurrent readers only ever read whole
    objects (checked by an embedded hash) and list only committed keys.
    Guards: non-atomic commits (write in place) that expose a partial object to the trainer (§14)."""
    store.put_bytes("hot", _payload(0))
    stop, errors, reads = threading.Event(), [], [0]
    read_once = threading.Event()

    def writer():
        for i in range(1, 60):
            store.put_bytes("hot", _payload(i))
            store.put_bytes(f"seq/{i:012d}", _payload(i))
            if i == 30:  # half-way, until a reader has read: the reads overlap the writes, however loaded
                read_once.wait(60)
        stop.set()

    def reader():
        while not stop.is_set():
            data = store.get_bytes("hot")
            if not _complete(data):
                errors.append(f"partial read of hot ({len(data)} bytes)")
            for key in store.list("seq"):
                if TMP_MARK in key or not _complete(store.get_bytes(key)):
                    errors.append(f"partial or temporary object listed: {key}")
            reads[0] += 1
            read_once.set()

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert reads[0] > 0 and len(store.list("seq")) == 59


# ----------------------------------------------------------------------------- listing


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=30, unique=True))
def test_listing_sorted_by_zero_padded_sequence(seqs):
    """Pins: keys written in any order list back sorted, and zero-padded numbers sort numerically,
    so resume needs one listing (§3). Guards: listing order depending on write order or backend."""
    store = Store(f"memory://miles-test-{uuid.uuid4().hex[:10]}")
    for s in seqs:
        store.put_bytes(f"buffer/groups/w1/{s:012d}.arrow", b"x")
        store.put_bytes(f"buffer/groups/w0/{s:012d}.arrow", b"x")
    keys = store.list("buffer/groups")
    assert keys == sorted(keys)
    w0 = [int(k.rsplit("/", 1)[1].split(".")[0]) for k in keys if "/w0/" in k]
    assert w0 == sorted(seqs)
    assert keys.index(f"buffer/groups/w1/{min(seqs):012d}.arrow") == len(seqs)


# ----------------------------------------------------------------------------- retries, injected faults


class FlakyFS(MemoryFileSystem):
    """An in-memory filesystem that fails the next `failures` calls of each data operation."""

    protocol = "flakytest"
    store: dict = {}
    pseudo_dirs = [""]
    failures = 0
    error: type[BaseException] = ConnectionError
    calls = 0

    def _maybe_fail(self):
        type(self).calls += 1
        if type(self).failures > 0:
            type(self).failures -= 1
            raise type(self).error("injected fault token=abc123")

    def pipe_file(self, path, value, **kw):
        self._maybe_fail()
        return super().pipe_file(path, value, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        self._maybe_fail()
        return super().cat_file(path, start, end, **kw)

    def find(self, path, *args, **kw):
        self._maybe_fail()
        return super().find(path, *args, **kw)


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation("flakytest", FlakyFS, clobber=True)
    FlakyFS.store, FlakyFS.pseudo_dirs, FlakyFS.failures, FlakyFS.calls = {}, [""], 0, 0
    FlakyFS.error = ConnectionError
    sleeps: list[float] = []
    # Record the backoff instead of waiting, on a fake clock the sleeps advance; replace the module's
    # `time` (not time.sleep itself, which other threads such as fsspec's event loop may be using).
    monkeypatch.setattr(storage, "time", types.SimpleNamespace(sleep=sleeps.append, monotonic=lambda: sum(sleeps)))
    return sleeps


def test_transient_faults_are_retried_until_success(flaky, caplog):
    """Pins: a filesystem failing 3 times then succeeding: put, get and list all succeed after retries,
    each retry logged as a warning without the error text (which may hold secrets).
    Guards: one network blip failing a commit; retries that leak credentials into logs."""
    s = Store("flakytest://bucket/run", retries=4, backoff_seconds=0.1)
    caplog.set_level(logging.WARNING, logger="miles_core.storage")
    for op in (lambda: s.put_bytes("k", b"v"), lambda: s.get_bytes("k"), lambda: s.list()):
        FlakyFS.failures, FlakyFS.calls = 3, 0
        op()
        assert FlakyFS.calls == 4
    assert s.get_bytes("k") == b"v" and s.list() == ["k"]
    assert len(flaky) == 9
    assert sum("retry" in r.getMessage() for r in caplog.records) == 9
    assert "abc123" not in caplog.text


def test_backoff_is_exponential_with_jitter_and_capped(flaky):
    """Pins: delays double from backoff_seconds up to max_backoff_seconds, each jittered in [0.5x, 1.5x).
    Guards: hot retry loops that hammer a struggling S3 endpoint, or unbounded waits."""
    s = Store("flakytest://bucket/run", retries=7, backoff_seconds=0.1, max_backoff_seconds=0.8)
    FlakyFS.failures = 7
    s.put_bytes("k", b"v")
    nominal = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8, 0.8]
    assert len(flaky) == 7
    for got, want in zip(flaky, nominal):
        assert 0.5 * want <= got < 1.5 * want


def test_no_wait_passes_the_backoff_cap_jitter_included(flaky, monkeypatch):
    """Pins: every wait is <= max_backoff_seconds (the documented 4 s), even when the jitter draws high.
    Guards: waits of up to 6 s behind a cap documented as 4 s."""
    monkeypatch.setattr(storage.random, "random", lambda: 0.999)
    s = Store("flakytest://bucket/run", retries=8, backoff_seconds=0.1)
    FlakyFS.failures = 8
    s.put_bytes("k", b"v")
    assert len(flaky) == 8 and max(flaky) == 4.0 and flaky[:2] == [0.1 * 1.499, 0.2 * 1.499]


def test_retry_deadline_shortens_the_retries_of_stores_built_inside(flaky):
    """Pins: Stores built inside `retry_deadline(s)` (without their own deadline) stop after s seconds;
    outside it, and with an explicit deadline, the 60 s default holds. Guards: a read-only CLI command
    retrying for a minute, or the short budget leaking into training's Stores."""
    with storage.retry_deadline(3.0):
        short, explicit = Store("flakytest://bucket/run"), Store("flakytest://bucket/run", deadline_seconds=30.0)
    assert (short.deadline_seconds, explicit.deadline_seconds) == (3.0, 30.0)
    assert Store("flakytest://bucket/run").deadline_seconds == storage.DEADLINE_SECONDS == 60.0
    FlakyFS.failures = 10**6
    with pytest.raises(StorageUnavailable):
        short.get_bytes("k")
    assert sum(flaky) <= 3.0


def test_persistent_fault_is_storage_unavailable(flaky):
    """Pins: faults outlasting the retries give StorageUnavailable naming the URI, the operation and
    the attempts, with the cause chained and secret-looking values redacted.
    Guards: an endless hang, or a raw ConnectionError that does not say which storage is down."""
    s = Store("flakytest://bucket/run", retries=2, backoff_seconds=0.01)
    FlakyFS.failures = 100
    with pytest.raises(StorageUnavailable) as info:
        s.put_bytes("buffer/groups/w0/000000000001.arrow", b"v")
    message = str(info.value)
    assert "flakytest://bucket/run" in message and "3 times" in message and "put buffer/groups" in message
    assert "abc123" not in message and "token=***" in message
    assert isinstance(info.value.__cause__, ConnectionError)
    assert FlakyFS.calls == 3


def test_retries_stop_at_the_total_deadline(flaky):
    """Pins: with attempts to spare, retrying stops once the next wait would pass `deadline_seconds`, and
    the error says how long it tried; an outage shorter than the deadline is waited out.
    Guards: a 10 s S3 restart failing a run (too few retries), or retrying for ever (no deadline)."""
    s = Store("flakytest://bucket/run", retries=1000, backoff_seconds=0.1, max_backoff_seconds=4.0,
              deadline_seconds=20.0)
    FlakyFS.failures = 10**6
    with pytest.raises(StorageUnavailable, match=r"failed \d+ times over \d+\.\d s"):
        s.put_bytes("k", b"v")
    assert 20 - 4 * 1.5 < sum(flaky) <= 20 and len(flaky) < 20  # stopped when the next wait would pass 20 s
    flaky.clear()
    FlakyFS.failures = 7  # waits of 0.1 .. 4 s nominal, at most 15.5 s jittered: inside the deadline
    s.put_bytes("k", b"v")
    assert s.get_bytes("k") == b"v" and len(flaky) == 7


@pytest.mark.parametrize("error", [PermissionError, FileNotFoundError, ValueError])
def test_permanent_errors_are_not_retried(flaky, error):
    """Pins: permission/not-found/logic errors fail on the first attempt.
    Guards: bad credentials or a missing bucket retried for a minute before the user sees them."""
    s = Store("flakytest://bucket/run", retries=5, backoff_seconds=0.01)
    FlakyFS.failures, FlakyFS.error = 1, error
    with pytest.raises((error, StorageError)):
        s.put_bytes("k", b"v")
    assert FlakyFS.calls == 1 and flaky == []


def test_s3_endpoint_where_nothing_listens(caplog):
    """Pins: a Store at an S3 endpoint with nothing listening raises StorageUnavailable naming the URI and
    the endpoint to check, and neither the message nor the logs contain the access key or secret.
    Guards: credentials in logs (§14); a hang or raw botocore error when storage is unreachable."""
    # caplog at DEBUG captures every library's records, so the secret check below covers botocore too.
    port = free_port()
    s = Store("s3://miles-bucket/runs/r1", retries=2, backoff_seconds=0.01,
              storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "key": FAKE_KEY, "secret": FAKE_SECRET})
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StorageUnavailable) as info:
        s.put_bytes("STATUS.json", b"{}")
    message = str(info.value)
    assert "s3://miles-bucket/runs/r1" in message and "MILES_S3_ENDPOINT_URL" in message
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("miles_core"))
    assert "retry" in ours
    for secret in (FAKE_KEY, FAKE_SECRET):
        assert secret not in message and secret not in ours and secret not in repr(s)
    # Even botocore's DEBUG logs (which do show the access key id in the signed Authorization header,
    # as AWS SDKs do) never contain the secret.
    assert FAKE_SECRET not in caplog.text
    with pytest.raises(StorageUnavailable):
        s.list("buffer")


def test_redaction_of_secret_looking_values():
    """Pins: key=/secret=/token=/password= values and presigned-URL credentials/signatures are masked.
    Guards: presigned URLs or connection strings with credentials ending up in StorageUnavailable."""
    text = storage._redact("GET https://x/y?X-Amz-Security-Token=abc&X-Amz-Credential=AKIAXYZ%2F20261130"
                           "&X-Amz-Signature=deadbeef password=hunter2 secret=s3cr aws_access_key=AKIA2")
    for leaked in ("abc", "AKIAXYZ", "deadbeef", "hunter2", "s3cr", "AKIA2"):
        assert leaked not in text
    assert "X-Amz-Credential=***" in text


# ----------------------------------------------------------------------------- names and keys

SAFE_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,60}", fullmatch=True).filter(lambda s: ".." not in s)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_validate_name_total(name):
    """Pins: validate_name accepts exactly one safe path segment and rejects everything else with InvalidName
    (never another exception); accepted names have no '/', '\\', '..' or control characters.
    Guards: a run id escaping the run root (`../other-run`) or breaking keys with control characters."""
    try:
        assert validate_name(name, "--run-id") == name
    except InvalidName as e:
        assert "--run-id" in str(e)
        return
    assert name and "/" not in name and "\\" not in name and ".." not in name
    assert all(32 <= ord(c) < 127 for c in name)


@settings(max_examples=100, deadline=None)
@given(SAFE_NAME)
def test_safe_names_accepted_and_rooted(name):
    """Pins: every name of the documented alphabet is accepted and its run root is {root}/runs/{name}.
    Guards: a validator stricter than the documented alphabet."""
    assert validate_name(name) == name
    assert run_root_uri("file:///srv/miles", name) == f"file:///srv/miles/runs/{name}"


@settings(max_examples=100, deadline=None)
@given(SAFE_NAME, st.sampled_from(["/", "..", "\x00", "\n", "\x1f", "\x7f", "\\"]), st.booleans())
def test_names_with_forbidden_parts_rejected(name, bad, at_end):
    """Pins: inserting '/', '..', '\\' or a control character anywhere makes a name invalid, with the reason.
    Guards: path traversal through --run-id or an eval dataset name (§3)."""
    candidate = name + bad if at_end else bad + name
    with pytest.raises(InvalidName) as info:
        validate_name(candidate, "--eval-prompt-data")
    assert "--eval-prompt-data" in str(info.value)


@pytest.mark.parametrize("key", ["..", "a/../b", "../x", "a/.."])
def test_store_keys_cannot_escape_root(key):
    """Pins: a key with a '..' segment is refused before touching storage.
    Guards: a crafted key reading or deleting outside the run root."""
    with pytest.raises(InvalidName):
        Store("memory://miles-test-esc/root").path(key)


def test_uris_and_local_paths(tmp_path):
    """Pins: a local path becomes an absolute file:// URI; URIs pass through without trailing '/'.
    Guards: the same run stored under two spellings of its root."""
    assert normalize_uri(str(tmp_path)) == f"file://{tmp_path}"
    assert normalize_uri("s3://b/p/") == "s3://b/p"
    assert Store(str(tmp_path)).uri("a/b") == f"file://{tmp_path}/a/b"
    with pytest.raises(InvalidName):
        run_root_uri("s3://b", "../escape")


def test_file_commits_fsync_the_directories_they_change(tmp_path, monkeypatch):
    """A rename or a new directory lives in its parent directory: each is fsynced, or a power loss
    could undo a commit whose file data was fsynced (issue 16 item 4)."""
    synced = []
    real = storage.fsync_dir
    monkeypatch.setattr(storage, "fsync_dir", lambda path: (synced.append(path), real(path)))
    s = Store(f"file://{tmp_path}/root")
    s.put_bytes("a/b/c.arrow", b"x")
    root = f"{tmp_path}/root"
    assert synced == [str(tmp_path), root, f"{root}/a", f"{root}/a/b"], synced  # 3 mkdirs, then the rename
    synced.clear()
    s.move("a/b/c.arrow", "q/c.arrow")
    assert synced == [root, f"{root}/q"], synced
    assert s.get_bytes("q/c.arrow") == b"x"


def test_an_attempt_that_never_answers_is_cut_at_the_deadline():
    """Guards (issue 36): an s3:// or gs:// client whose own retries, credential chain or name lookup
    outlast --storage-timeout (34 s against 5): one attempt on an asynchronous filesystem is cut at what
    is left of the deadline, and StorageUnavailable names the scheme's settings, not S3's for gs://."""
    import asyncio

    import fsspec.asyn

    class Hanging(fsspec.asyn.AsyncFileSystem):
        async def _exists(self, path, **kwargs):
            await asyncio.sleep(60)

    s = Store("memory://hang")
    s.fs, s.protocol, s.root_uri = Hanging(), "gs", "gs://bucket/hang"
    started = time.monotonic()
    with pytest.raises(StorageUnavailable) as info:
        s.deadline_seconds = 2
        s.exists("config.json")
    assert time.monotonic() - started < 6
    assert "storage.googleapis.com" in str(info.value) and "MILES_S3_ENDPOINT_URL" not in str(info.value)


def test_gs_without_credentials_is_refused_before_any_request(tmp_path, monkeypatch):
    """Guards (issue 36): gs:// without credentials reaching gcsfs, which probes a metadata server and
    retries for half a minute before a traceback."""
    from miles_core.storage import StorageNotConfigured

    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setattr("builtins.open", _no_dmi(open))
    with pytest.raises(StorageNotConfigured, match="GOOGLE_APPLICATION_CREDENTIALS"):
        Store("gs://bucket/run")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(StorageNotConfigured, match="missing.json is not a file"):
        Store("gs://bucket/run")


def _no_dmi(real_open):
    def fake(path, *args, **kwargs):
        if str(path) == "/sys/class/dmi/id/product_name":
            raise OSError("no DMI here")
        return real_open(path, *args, **kwargs)
    return fake


def test_tensors_reach_an_object_store_streamed_from_their_file(tmp_path, monkeypatch):
    """Pins: on a store that is not file:// `put_tensors` uploads the safetensors file it wrote with
    `Store.put_file` (streamed) and never passes its bytes through memory (`put_bytes`). Guards: every
    checkpoint file read whole into memory before its upload (tens of GB of optimizer state at 8B)."""
    import torch
    from safetensors.torch import load

    from miles_core.storage.tensor_files import put_tensors

    store = Store(f"memory://{tmp_path.name}")
    uploads = []
    real_put_file = Store.put_file
    monkeypatch.setattr(Store, "put_bytes", lambda *a, **k: pytest.fail("tensor bytes went through memory"))
    monkeypatch.setattr(Store, "put_file", lambda self, key, local: (uploads.append(key), real_put_file(self, key, local)))
    written = put_tensors(store, "ckpt/t.safetensors", {"w": torch.ones(4)})
    assert uploads == ["ckpt/t.safetensors"] and written["size"] == store.size("ckpt/t.safetensors")
    assert torch.equal(load(store.get_bytes("ckpt/t.safetensors"))["w"], torch.ones(4))


def test_put_file_on_file_store_is_atomic_and_leaves_no_temporary(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    store = Store(f"file://{tmp_path}/root")
    store.put_file("a/b.bin", str(src))
    assert store.get_bytes("a/b.bin") == b"x" * 1000 and store.list_temporaries("a") == {}


def test_s3_stores_of_a_process_share_one_filesystem_per_endpoint_and_credentials(monkeypatch):
    """Pins: every S3 Store of a process with the same endpoint and credential environment uses one
    filesystem (one client and connection pool: a Store's first request made its own client, 60-70 ms
    on SeaweedFS over loopback against 4-6 ms for a shared one); another endpoint or other credentials
    get their own, and each Store keeps its own root. No request is made (clients are made lazily)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id-a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-a")
    monkeypatch.setenv("MILES_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    a, b = Store("s3://bucket/runs/a"), Store("s3://bucket/runs/b")
    assert a.fs is b.fs and (a.root, b.root) == ("bucket/runs/a", "bucket/runs/b")
    assert a.child("x").fs is a.fs and a.child("x").root == "bucket/runs/a/x"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id-b")
    assert Store("s3://bucket/runs/a").fs is not a.fs  # other credentials: never another's client
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id-a")
    monkeypatch.setenv("MILES_S3_ENDPOINT_URL", "http://127.0.0.1:10")
    other = Store("s3://bucket/runs/a")
    assert other.fs is not a.fs and (a.fs.endpoint_url, other.fs.endpoint_url) == ("http://127.0.0.1:9",
                                                                                   "http://127.0.0.1:10")
