"""The eval_backfill Flyte workflow, run locally end to end on the real eval functions (no stubs):
plan_backfill -> map_task(eval_snapshot) -> backfill_table over a finished run root with two
snapshots on the CPU engine. Pins the contract between tasks/eval.py and miles_core.eval (full
metric names in the table and Deck, results written to eval/step_{k}/{ds}.json).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.timeouts import SLOW_RUN_SECONDS

ROOT = Path(__file__).resolve().parents[2]
TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.mark.slow
def test_eval_backfill_workflow_runs_locally(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f'''
        import pyarrow as pa
        from miles_core.config import parse_flags
        from miles_core.models.builtin import materialize_checkpoint
        from miles_core.storage.run_root import FINISHED, write_config, write_status
        from miles_core.storage import Store
        from tests.integration.eval_support import copy_snapshot
        from workflows.eval_backfill import eval_backfill

        cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", {str(tmp_path / "store")!r}, "--eval-prompt-data",
                           "held=builtin:reverse4-heldout", "--eval-max-prompts", "8", "--eval-interval", "2"])
        store = Store(cfg.run_uri)
        write_config(store, cfg)
        model = materialize_checkpoint("builtin:tiny-gpt", 1, {str(tmp_path / "model")!r})
        for step in (1, 3):
            copy_snapshot(model, store.local_path(f"snapshots/step_{{step:08d}}"))
        write_status(store, FINISHED, last_step=3, segment=0)
        table = eval_backfill(run_uri=cfg.run_uri).open(pa.Table).all()
        metrics = set(table.column("metric").to_pylist())
        assert {{"eval/held", "eval/held/pass@1"}} <= metrics, metrics
        assert sorted(set(table.column("step").to_pylist())) == [1, 3]
        assert store.exists("eval/step_00000003/held.json")
        print("RUN_URI", cfg.run_uri)
        print("OK")
    '''))
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=SLOW_RUN_SECONDS)
    assert "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    if proc.returncode == -signal.SIGABRT and proc.stderr.rstrip().endswith(TEARDOWN_ABORT):
        # Seen once in CI (2026-12-01), after the workflow had returned and been checked; not
        # reproduced in 6 local runs. A native thread at interpreter teardown, not the workflow.
        warnings.warn(f"the interpreter aborted at teardown after the workflow succeeded: {TEARDOWN_ABORT}")
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run_uri = proc.stdout.split("RUN_URI ", 1)[1].split()[0]
    _pyflyte_run_shows_the_table_and_the_skips(run_uri, env)


def _pyflyte_run_shows_the_table_and_the_skips(run_uri: str, env: dict) -> None:
    """A local `pyflyte run` prints the rows it computed and names each skipped step with its reason
    (not only `StructuredDataset(uri=None, ...)`), and says where in the run root the table is."""
    pyflyte = str(Path(sys.executable).with_name("pyflyte"))
    proc = subprocess.run([pyflyte, "run", "workflows/eval_backfill.py", "eval_backfill", "--run_uri", run_uri,
                           "--steps", "[3, 7]", "--datasets",
                           '["held=builtin:reverse4-heldout", "held2=builtin:reverse4-heldout"]'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=SLOW_RUN_SECONDS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 or TEARDOWN_ABORT in out, out[-5000:]
    assert "eval backfill: " in out and "      3  held2        eval/held2 " in out, out[-5000:]
    assert "step 3 held: already evaluated (eval/step_00000003/held.json" in out, out[-5000:]
    assert "step 7 (every dataset): no complete snapshot under" in out, out[-5000:]
    rows, saved = out.split("eval backfill: ", 1)[1].split(" rows -> ", 1)
    table = pq.read_table(saved.split()[0])  # the table is in the run root, where the console says
    assert table.num_rows == int(rows) > 0 and set(table.column("dataset").to_pylist()) == {"held2"}
