"""Shared fixtures: storage roots on file:// and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.seaweed import start_seaweed


@pytest.fixture(scope="session")
def seaweed():
    server = start_seaweed()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(seaweed):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=seaweed.endpoint, key=None, secret=None)
    bucket = "miles-test"
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    return bucket


@pytest.fixture(params=["file", "s3"])
def storage_root(request, tmp_path):
    """A fresh storage root URI on each backend; the S3 one is a new prefix in a real S3 server."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{uuid.uuid4().hex[:12]}"
