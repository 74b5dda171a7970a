"""The wandb mirror in offline mode (wandb starts its own service process; tests/unit is one process).
"""

from __future__ import annotations

import glob
import os

from miles_core.config import parse_flags
from miles_core.metrics.mirrors import mirror_feed
from miles_core.storage import Store
from tests.support.sinks import wandb_history
from tests.unit.test_metrics_mirrors import _log_two_components, _run_id


def test_wandb_offline_gets_every_event_against_the_step_metric_and_never_the_key(tmp_path, monkeypatch):
    canary = "canary-wandb-key-5d1c"
    monkeypatch.setenv("WANDB_API_KEY", canary)
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = Store(f"file://{tmp_path}/runs/r1")
    cfg = parse_flags(["--preset", "tiny-reverse4", "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path / "wb"),
                       "--wandb-project", "p", "--run-id", "r1", "--storage-root", f"file://{tmp_path}"])
    with mirror_feed(cfg, store):
        _log_two_components(store)
    run_dirs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1 and run_dirs[0].endswith("-" + _run_id(cfg, store))  # one W&B run per run root
    rows = sorted((r["step"], k, v) for r in wandb_history(run_dirs[0]) for k, v in r.items()
                  if k not in ("step", "_step", "_runtime", "_timestamp"))
    assert rows == [(1, "rollout/reward/mean", 0.5), (2, "train/loss", 0.25), (3, "train/loss", 0.125)]
    for path in glob.glob(str(tmp_path / "**"), recursive=True):
        if os.path.isfile(path):
            assert canary.encode() not in open(path, "rb").read(), path
