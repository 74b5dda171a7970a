"""import_model: bring the model --hf-checkpoint names into object storage once (docs/real-model.md).

A GGUF (a path or URI, or `import:NAME` for a packaged one) is converted into an HF safetensors
directory with its tokenizer and chat template under {storage root}/models/; a builtin model or
an HF directory needs nothing. Cached by `fingerprint` (model_fingerprint: the source's content
hash and whether the import is in place), like prepare_data.
"""

from __future__ import annotations

import uuid

from flytekit import Resources, task

from images import task_image
from miles_core.models.source import MARKER, model_uri, needs_import
from miles_core.prepare.initial_model import ensure_model
from miles_core.storage import Store
from tasks.cluster import TRAIN_CLUSTER
from tasks.inputs import run_config
from tasks.secrets import ENGINE_SECRETS

# Bump when import_model's output for the same inputs changes.
IMPORT_MODEL_CACHE_VERSION = "1"


@task(container_image=task_image("cpu"), requests=Resources(cpu="1", mem="2Gi"), secret_requests=ENGINE_SECRETS)
def model_fingerprint(flags: str, run_id: str, storage_root: str) -> str:
    """Where the initial model lives and whether it is there: import_model's cache key. An absent model
    gets a key of its own every time (an earlier execution's import at the same path, deleted since,
    must not be a cache hit)."""
    cfg = run_config(flags, run_id, storage_root, cluster=TRAIN_CLUSTER)
    if not needs_import(cfg.model.hf_checkpoint):
        return "no-import"
    uri = model_uri(cfg)
    return f"{uri}:present" if Store(uri).exists(MARKER) else f"{uri}:absent:{uuid.uuid4().hex}"


@task(cache=True, cache_version=IMPORT_MODEL_CACHE_VERSION, container_image=task_image("cpu"),
      secret_requests=ENGINE_SECRETS, requests=Resources(cpu="2", mem="6Gi"))
def import_model(flags: str, run_id: str, storage_root: str, fingerprint: str) -> str:
    """The URI of the run's initial HF directory, imported first when --hf-checkpoint is a GGUF."""
    cfg = run_config(flags, run_id, storage_root, cluster=TRAIN_CLUSTER)
    return ensure_model(cfg) if needs_import(cfg.model.hf_checkpoint) else model_uri(cfg)
