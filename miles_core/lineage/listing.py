"""`miles runs list STORAGE_ROOT [--json]`: every run under a storage root, one line each, read-only.

    runs = list_runs("s3://bucket/miles")    # [{"run_id", "run_uri", "state", "steps_done", ...}]
    print(render_runs(runs))

A run is a directory `{storage_root}/runs/{run_id}/`; for each, STATUS.json gives the state, the last
trained step and the last update, and the latest segment's config its --num-rollout. A directory
with neither (a run that never started a segment) is listed as `not started`. Reads two small
objects per run (in parallel), never the buffer or the checkpoints.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

from miles_core.storage import Store, normalize_uri
from miles_core.storage.run_root import get_json_or_none, read_config, read_status, segment_config_key

RUNS_PREFIX = "runs"
READ_THREADS = 16  # object-store latency, not CPU, bounds reading many runs


def list_runs(storage_root: str) -> list[dict]:
    """One record per run under `storage_root`, sorted by run id."""
    root = Store(normalize_uri(storage_root))
    ids = root.list_dirs(RUNS_PREFIX)
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="runs-list") as pool:
        return list(pool.map(lambda run_id: _run(root.child(f"{RUNS_PREFIX}/{run_id}"), run_id), ids))


def _run(store: Store, run_id: str) -> dict:
    status = read_status(store)
    cfg = read_config(store) or {}
    num_rollout = cfg.get("run", {}).get("num_rollout")
    updated = status.updated_at if status else (get_json_or_none(store, segment_config_key(0)) or {}).get("written_at")
    return {"run_id": run_id, "run_uri": store.root_uri, "state": status.state if status else "not started",
            "steps_done": status.last_step + 1 if status else 0, "num_rollout": num_rollout,
            "segment": status.segment if status else None, "updated_at": updated}


def render_runs(runs: list[dict], storage_root: str) -> str:
    if not runs:
        return f"no runs under {normalize_uri(storage_root)}/{RUNS_PREFIX}/ (is that the runs' --storage-root?)"
    width = max(len("RUN"), *(len(r["run_id"]) for r in runs))
    steps = max(len("STEPS"), *(len(_steps(r)) for r in runs))
    lines = [f"{'RUN':<{width}}  {'STATE':<12}  {'STEPS':>{steps}}  LAST UPDATE"]
    lines += [f"{r['run_id']:<{width}}  {r['state']:<12}  {_steps(r):>{steps}}  {_when(r['updated_at'])}"
              for r in runs]
    return "\n".join(lines)


def _steps(r: dict) -> str:
    return f"{r['steps_done']}/{r['num_rollout'] if r['num_rollout'] is not None else '?'}"


def _when(t: float | None) -> str:
    if not t:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
