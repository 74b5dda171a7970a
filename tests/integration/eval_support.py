"""Shared pieces of the eval integration tests: tiny checkpoints, a stand-in exporter, engines."""

from __future__ import annotations

import os
import shutil

from miles_core.config import parse_flags
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer

from tests.support.timeouts import ENGINE_START_SECONDS

EVAL_FLAGS = ["--eval-prompt-data", "held=builtin:reverse4-heldout", "--eval-max-prompts", "12",
              "--n-samples-per-eval-prompt", "2", "--eval-temperature", "1.0"]


def config(tmp_path, *flags: str):
    return parse_flags(["--preset", "tiny-reverse4", "--storage-root", str(tmp_path / "store"), "--run-id", "r1", *EVAL_FLAGS, *flags])


def copy_snapshot(model_dir: str, dest_dir: str, marker: str | None = ".complete") -> None:
    """What the trainer's snapshot export leaves behind: the HF files, then the marker last."""
    os.makedirs(dest_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(dest_dir, name))
    if marker:
        open(os.path.join(dest_dir, marker), "wb").close()


def exporter_from(model_dir: str):
    def export(step: int, uri: str) -> None:
        copy_snapshot(model_dir, uri[len("file://"):])
    return export


def start_engine(model_dir: str, version: int = 0) -> EngineServer:
    server = EngineServer(EngineLaunchSpec("cpu", model_dir, weight_version=version,
                                           startup_timeout_seconds=ENGINE_START_SECONDS))
    server.start()
    return server
