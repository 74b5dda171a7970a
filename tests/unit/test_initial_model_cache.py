"""A builtin initial model is made once per machine: the node cache's entry is copied into each new
run root (miles_core/prepare/initial_model.py)."""

from __future__ import annotations

import os

import pytest

from miles_core.config import embedded_default, replace_fields
from miles_core.models.source import MARKER, model_uri
from miles_core.prepare import initial_model
from miles_core.storage import Store


def _cfg(tmp_path, run_id: str, **fields):
    return replace_fields(embedded_default(), storage_root=f"file://{tmp_path}/store", run_id=run_id, **fields)


@pytest.fixture
def made(monkeypatch, tmp_path):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = initial_model.materialize_checkpoint

    def counted(*args, **kwargs):
        calls.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(initial_model, "materialize_checkpoint", counted)
    return calls


def _files(uri: str) -> dict[str, bytes]:
    store = Store(uri)
    return {k: store.get_bytes(k) for k in sorted(store.list(""))}


def test_a_second_run_copies_the_cached_model_and_a_new_seed_makes_a_new_one(tmp_path, made):
    first = initial_model.ensure_model(_cfg(tmp_path, "a"))
    second = initial_model.ensure_model(_cfg(tmp_path, "b"))
    assert made == [("builtin:tiny-gpt", 1)]
    assert first != second and _files(first) == _files(second)
    assert MARKER in _files(second) and initial_model.CACHED_MARKER not in _files(second)
    initial_model.ensure_model(_cfg(tmp_path, "c", seed=2))
    assert made == [("builtin:tiny-gpt", 1), ("builtin:tiny-gpt", 2)]
    assert len(os.listdir(tmp_path / "cache" / "builtin")) == 2


def test_an_entry_without_its_marker_is_made_again(tmp_path, made):
    cfg = _cfg(tmp_path, "a")
    entry = initial_model.builtin_files(cfg)
    os.remove(os.path.join(entry, initial_model.CACHED_MARKER))  # a writer killed before publishing
    initial_model.ensure_model(cfg)
    assert len(made) == 2 and os.path.exists(os.path.join(entry, initial_model.CACHED_MARKER))
    assert Store(model_uri(cfg)).exists(MARKER)
