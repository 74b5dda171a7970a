"""Object storage against a real S3 server (SeaweedFS `weed mini` on 127.0.0.1) and file:// (docs/quickstart.md#where-the-run-lives).

The `storage_root` fixture runs each test on file:// and on a fresh prefix of the session's S3
server; the S3 cases must run in CI, so nothing here is skipped. The outage test starts a private
server and stops it mid-test, the way a real outage happens: from outside the process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import uuid

import pytest

from miles_core.samples import Group, Sample, SampleStatus, groups_to_ipc, ipc_to_groups
from miles_core.storage import TMP_MARK, ObjectNotFound, StorageUnavailable, Store
from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, start_seaweed

pytestmark = pytest.mark.s3


def test_object_contract(storage_root):
    """Pins: put/get/exists/list/list_sizes/move/delete/delete_prefix behave the same on S3 and file://.
    Guards: an s3fs behaviour (directory markers, listing cache) leaking into what callers see."""
    store = Store(storage_root)
    store.put_json("STATUS.json", {"state": "running"})
    store.put_bytes("buffer/groups/w0/000000000002.arrow", b"bb")
    store.put_bytes("buffer/groups/w0/000000000001.arrow", b"a")
    assert store.get_json("STATUS.json") == {"state": "running"}
    assert store.exists("buffer/groups/w0/000000000001.arrow") and not store.exists("buffer/groups/w0/nope")
    assert store.list("buffer") == ["buffer/groups/w0/000000000001.arrow", "buffer/groups/w0/000000000002.arrow"]
    assert store.list_sizes("buffer/groups") == {"buffer/groups/w0/000000000001.arrow": 1,
                                                 "buffer/groups/w0/000000000002.arrow": 2}
    store.move("buffer/groups/w0/000000000002.arrow", "buffer/quarantine/000000000002.arrow")
    assert store.list("buffer/groups") == ["buffer/groups/w0/000000000001.arrow"]
    assert store.get_bytes("buffer/quarantine/000000000002.arrow") == b"bb"
    with pytest.raises(ObjectNotFound):
        store.get_bytes("buffer/groups/w0/000000000002.arrow")
    store.delete_prefix("buffer")
    # SeaweedFS (a filer) keeps the emptied "directories"; they must never come back as keys.
    assert store.list("buffer") == [] and store.list("buffer/groups/w0") == [] and store.list() == ["STATUS.json"]
    assert store.list_sizes("buffer") == {}
    assert store.list("no/such/prefix") == []


def test_listing_sorted_zero_padded(storage_root):
    """Pins: keys written in random order list back sorted; zero-padded steps sort numerically, across
    prefixes that share a stem (step_9 vs step_10 would not). Guards: resume scanning per step (§3)."""
    store = Store(storage_root)
    steps = random.Random(0).sample(range(1, 500), 25)
    for k in steps:
        store.put_bytes(f"buffer/consumed/{k:06d}.json", b"[]")
    keys = store.list("buffer/consumed")
    assert keys == [f"buffer/consumed/{k:06d}.json" for k in sorted(steps)]


def test_temporary_objects_hidden(storage_root):
    """Pins: an object under a temporary name (an unfinished upload/rename) is not listed.
    Guards: a reader decoding a partial buffer object from the listing (§14)."""
    store = Store(storage_root)
    store.put_bytes("buffer/groups/w0/000000000001.arrow", b"ok")
    store.fs.pipe_file(store.path(f"buffer/groups/w0/000000000002.arrow{TMP_MARK}{uuid.uuid4().hex}"), b"part")
    assert store.list("buffer/groups") == ["buffer/groups/w0/000000000001.arrow"]
    assert list(store.list_sizes("buffer/groups")) == ["buffer/groups/w0/000000000001.arrow"]


def _payload(i: int) -> bytes:
    body = os.urandom(random.randint(1, 300_000)) + str(i).encode()
    return hashlib.sha256(body).digest() + body


def test_concurrent_writer_reader_never_see_partial(storage_root):
    """Pins: readers racing a writer that overwrites one key and commits new keys only ever get whole
    objects (embedded hash) and only list committed keys.
    Guards: a multipart or in-place write exposing a partial object on S3 (§3: a single PUT is atomic)."""
    store = Store(storage_root)
    store.put_bytes("hot", _payload(0))
    stop, errors, reads = threading.Event(), [], [0]

    def writer():
        try:
            for i in range(1, 25):
                store.put_bytes("hot", _payload(i))
                store.put_bytes(f"seq/{i:012d}", _payload(i))
        finally:
            stop.set()

    def reader():
        reader_store = Store(storage_root)  # its own client, like a trainer in another process
        while not stop.is_set():
            data = reader_store.get_bytes("hot")
            if hashlib.sha256(data[32:]).digest() != data[:32]:
                errors.append(f"partial read ({len(data)} bytes)")
            for key in reader_store.list("seq"):
                data = reader_store.get_bytes(key)
                if TMP_MARK in key or hashlib.sha256(data[32:]).digest() != data[:32]:
                    errors.append(f"partial or temporary object listed: {key}")
            reads[0] += 1

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert reads[0] > 0 and len(store.list("seq")) == 24


def test_sample_batches_round_trip_through_storage(storage_root):
    """Pins: a buffer object (Arrow IPC of groups) committed to storage reads back as the same groups.
    Guards: byte-level corruption or truncation between samples and storage (text/encoding modes)."""
    store = Store(storage_root)
    groups = [Group(f"g{i}", i, [Sample(f"g{i}", i, j, [1, 2], [3, 4], [-0.5, -0.25], [1, 1], [1, 2], reward=None,
                                        status=SampleStatus.COMPLETED, metadata='{"epoch": 0, "position": %d}' % i)
                                 for j in range(3)]) for i in range(4)]
    store.put_bytes("buffer/groups/w0/000000000001.arrow", groups_to_ipc(groups))
    assert ipc_to_groups(store.get_bytes("buffer/groups/w0/000000000001.arrow")) == groups


def test_server_stopped_mid_test_is_storage_unavailable(caplog):
    """Pins: when the S3 server goes away mid-run, every operation ends in StorageUnavailable after its
    retries, naming the run URI and never the credentials; data written before the outage was intact.
    Guards: a hang, a raw botocore/aiohttp error, or a secret in the message when storage dies (§14)."""
    import s3fs

    server = start_seaweed()
    try:
        opts = {"endpoint_url": server.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}
        s3fs.S3FileSystem(skip_instance_cache=True, **opts).mkdir("outage")
        store = Store("s3://outage/runs/r1", retries=2, backoff_seconds=0.05, storage_options=opts)
        store.put_bytes("checkpoints/LATEST", b"step_000001")
        assert store.get_bytes("checkpoints/LATEST") == b"step_000001"
        assert store.list("checkpoints") == ["checkpoints/LATEST"]
    finally:
        server.stop()
    caplog.set_level(logging.WARNING)
    operations = {
        "get": lambda: store.get_bytes("checkpoints/LATEST"),
        "put": lambda: store.put_bytes("checkpoints/LATEST", b"step_000002"),
        "list": lambda: store.list("checkpoints"),
        "exists": lambda: store.exists("checkpoints/LATEST"),
    }
    for name, op in operations.items():
        with pytest.raises(StorageUnavailable) as info:
            op()
        message = str(info.value)
        assert "s3://outage/runs/r1" in message and "3 times" in message, name
        assert ACCESS_KEY not in message and SECRET_KEY not in message
    assert SECRET_KEY not in caplog.text and ACCESS_KEY not in caplog.text


def test_default_s3_store_uses_endpoint_from_environment(seaweed, s3_bucket):
    """Pins: a Store built from a bare s3:// URI reaches the endpoint in MILES_S3_ENDPOINT_URL with the
    credentials from the standard AWS variables (how tasks get them; nothing in the config).
    Guards: credentials or endpoints having to be put into the run config (§14)."""
    assert os.environ["MILES_S3_ENDPOINT_URL"] == seaweed.endpoint
    store = Store(f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}")
    store.put_bytes("x", b"1")
    assert store.get_bytes("x") == b"1"


def test_a_large_file_is_uploaded_streamed_in_parts(storage_root, tmp_path):
    """Pins: `Store.put_file` commits a local file of 72 MiB (more than s3fs's 50 MiB part: a
    multipart upload on S3) byte for byte, leaving no temporary; `put_tensors` goes through it with
    the digest of the file it wrote. Guards: a checkpoint's optimizer state read whole into memory
    before its upload (tens of GB at 8B)."""
    import torch

    from miles_core.storage.tensor_files import put_tensors

    store = Store(storage_root)
    local = tmp_path / "big.bin"
    data = random.Random(1).randbytes(72 << 20)
    local.write_bytes(data)
    store.put_file("ckpt/big.bin", str(local))
    assert store.size("ckpt/big.bin") == len(data)
    assert hashlib.sha256(store.get_bytes("ckpt/big.bin")).digest() == hashlib.sha256(data).digest()
    assert store.list("ckpt") == ["ckpt/big.bin"] and store.list_temporaries("ckpt") == {}
    written = put_tensors(store, "ckpt/t.safetensors", {"w": torch.arange(1000, dtype=torch.float32)})
    assert written["sha256"] == hashlib.sha256(store.get_bytes("ckpt/t.safetensors")).hexdigest()
