"""prepare_data: normalize the prompt dataset into the run root, cached by content (docs/deployment.md)."""

from __future__ import annotations

import uuid

from flytekit import Resources, task

from images import task_image
from miles_core.models.source import tokenizer_source
from miles_core.prepare.dataset import dataset_fingerprint, prepare_dataset
from miles_core.rollout.prompts import DatasetError, stored_dataset_info
from miles_core.storage import Store
from tasks.cluster import TRAIN_CLUSTER
from tasks.failures import one_line_on_the_command_line
from tasks.inputs import run_config
from tasks.secrets import ENGINE_SECRETS
from tasks.types import PreparedData

# Bump when prepare_data's output for the same inputs changes (format, columns, tokenization).
PREPARE_DATA_CACHE_VERSION = "1"


@task(container_image=task_image("cpu"), requests=Resources(cpu="1", mem="2Gi"), secret_requests=ENGINE_SECRETS)
def data_fingerprint(flags: str, run_id: str, storage_root: str) -> str:
    """Content hash of the source dataset and of what the run root holds now: prepare_data's cache key.

    Including the run root's current dataset makes a deleted or replaced run root miss the cache,
    so a cache hit always means the normalized data is in place; absent data never hits it.
    """
    cfg = run_config(flags, run_id, storage_root, cluster=TRAIN_CLUSTER)
    stored = stored_dataset_info(Store(cfg.run_uri))
    source = dataset_fingerprint(cfg.data, tokenizer_source=tokenizer_source(cfg))
    return f"{source}:{stored.content_hash}" if stored else f"{source}:absent:{uuid.uuid4().hex}"


@task(cache=True, cache_version=PREPARE_DATA_CACHE_VERSION, container_image=task_image("cpu"),
      secret_requests=ENGINE_SECRETS, requests=Resources(cpu="1", mem="4Gi"))
def prepare_data(flags: str, run_id: str, storage_root: str, fingerprint: str) -> PreparedData:
    """Normalize --prompt-data (JSONL/Parquet/Arrow, local or object storage, or builtin:*) into
    {run root}/data/prompts.arrow. Bad rows fail the task with every bad row named (file, row, field).
    Cached by `fingerprint` (data_fingerprint's content hash) together with the run inputs.
    """
    cfg = run_config(flags, run_id, storage_root, cluster=TRAIN_CLUSTER)
    with one_line_on_the_command_line():  # every bad row named, without the frames that found them
        info = prepare_dataset(cfg.data, Store(cfg.run_uri), tokenizer_source=tokenizer_source(cfg))
    if not fingerprint.startswith(info.content_hash):
        raise DatasetError(f"{info.source} changed while the run was starting (hash {fingerprint[:12]} -> "
                           f"{info.content_hash[:12]}); start the run again.")
    return PreparedData(info.uri, info.content_hash, info.num_rows, info.source)
