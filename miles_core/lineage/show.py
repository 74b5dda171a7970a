"""`miles runs show RUN_URI [--json]`: what a run root holds, read-only, in one screen.

    summary = run_summary("s3://bucket/miles/runs/r1")   # RunNotFound / LineageError on a bad root
    print(render_summary(summary))

State and steps (STATUS.json), segments (config.json, config_segment_{n}.json), the lease holder
(LEASE.json), complete checkpoints and LATEST, complete snapshots, the buffer's counts
(`miles buffer inspect`), eval results per dataset, the origin of a forked run (FORK.json), and the
producer jobs that fed it (miles_core.lineage.producers).
"""

from __future__ import annotations

import datetime
import time

from miles_core.buffer.inspect import inspect_buffer
from miles_core.eval.results import all_results
from miles_core.eval.snapshots import SnapshotLayout
from miles_core.lineage.producers import TRAINER, producer_rows
from miles_core.lineage.recorded import FORK_KEY, RecordedRun
from miles_core.storage import ObjectNotFound
from miles_core.storage.lease import LEASE_KEY, LeaseError, LeaseRecord
from miles_core.storage.run_root import get_json_or_none, read_status, segment_config_key


def run_summary(run_uri: str) -> dict:
    run = RecordedRun.open(run_uri)
    status = read_status(run.store)
    checkpoints = run.checkpoints
    return {
        "run_uri": run.uri,
        "status": None if status is None else {"state": status.state, "last_step": status.last_step,
                                               "segment": status.segment, "updated_at": status.updated_at,
                                               "message": status.message},
        "num_rollout": run.cfg.run.num_rollout,
        "segments": _segments(run, 0 if status is None else status.segment),
        "lease": _lease(run),
        "checkpoints": _checkpoints(checkpoints),
        "snapshots": SnapshotLayout.from_config(run.cfg, run.uri).complete_steps(),
        "buffer": inspect_buffer(run.uri),
        "eval": _evals(run),
        "forked_from": get_json_or_none(run.store, FORK_KEY),
        "producers": producer_rows(run.store, run.later_manifests(-1)),
    }


def _segments(run: RecordedRun, last: int) -> list[dict]:
    out = []
    for segment in range(last + 1):
        record = get_json_or_none(run.store, segment_config_key(segment))
        if record is not None:
            out.append({"segment": segment, "config": segment_config_key(segment),
                        "written_at": record.get("written_at")})
    return out


def _lease(run: RecordedRun) -> dict | None:
    try:
        record = LeaseRecord.from_bytes(run.store.get_bytes(LEASE_KEY), run.store.uri(LEASE_KEY))
    except ObjectNotFound:
        return None
    except LeaseError as e:  # one bad file never stops the summary: said instead
        return {"error": str(e)}
    return {"holder": record.holder, "released": record.released, "acquired_at": record.acquired_at,
            "expires_at": record.expires_at, "expired": record.expires_at < time.time()}


def _evals(run: RecordedRun) -> dict[str, list[dict]]:
    """dataset -> [{"step", "mean_reward", ...pass@k}] in step order."""
    out: dict[str, list[dict]] = {}
    for result in all_results(run.store):
        row = result.to_row()
        keep = {k: v for k, v in row.items() if k == "mean_reward" or k.startswith("pass@")}
        if result.failed_samples:
            keep.update(failed_samples=result.failed_samples, n_samples=result.n_samples, error=result.error)
        out.setdefault(result.dataset, []).append({"step": result.step, **keep})
    return out


# ----------------------------------------------------------------------------- text


def render_summary(s: dict) -> str:
    lines = [f"run          {s['run_uri']}", _status_line(s), _steps_line(s),
             "segments     " + (", ".join(f"{g['segment']} ({_when(g['written_at'])})" for g in s["segments"])
                               or "none"),
             _lease_line(s["lease"]), _checkpoints_line(s["checkpoints"]),
             "snapshots    " + (_steps(s["snapshots"]) or "none"), _buffer_line(s["buffer"])]
    lines += _eval_lines(s["eval"])
    if s["forked_from"]:
        f = s["forked_from"]
        lines.append(f"forked from  {f.get('source_run')} at step {f.get('at_step')}")
    return "\n".join(lines + _producer_lines(s.get("producers") or []))


PRODUCER_COLUMNS = ("PRODUCER", "HOST", "STATE", "FIRST HEARTBEAT", "LAST HEARTBEAT", "COMMITTED", "CONSUMED",
                    "REJECTED AT GET", "TOKENS/S")


def _producer_lines(rows: list[dict]) -> list[str]:
    """A table of the producer jobs (and the run's own rollout) when any producer fed the run."""
    if not rows:
        return ["producers    none (a run with --allow-rollout-producers takes them: docs/elastic.md)"]
    table = [PRODUCER_COLUMNS, *(_producer_cells(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(PRODUCER_COLUMNS))]
    joined = len(rows) - 1
    return [f"producers    {joined} joined; rejected at get: too stale, or another writer's duplicate"] + [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]


def _producer_cells(r: dict) -> tuple[str, ...]:
    if r["producer_id"] == TRAINER:
        return (TRAINER, "-", "(the run's own rollout)", "-", "-", "-", str(r["groups_consumed"]),
                str(r["groups_rejected_at_get"]), "-")
    if r["state"] is None:
        return (r["producer_id"], "?", "(no heartbeat record)", "?", "?", "?", str(r["groups_consumed"]),
                str(r["groups_rejected_at_get"]), "?")
    state = r["state"] + (f": {r['stop_reason']}" if r["stop_reason"] else "")
    if r["silent_seconds"] is not None:
        state += f" (silent {r['silent_seconds']:.0f} s: killed?)"
    return (r["producer_id"], r["host"], state, _when(r["started_at"]), _when(r["heartbeat_at"]),
            str(r["groups_committed"]), str(r["groups_consumed"]), str(r["groups_rejected_at_get"]),
            f"{r['tokens_per_second']:.1f}")


def _status_line(s: dict) -> str:
    st = s["status"]
    if st is None:
        return "state        never started a segment (no STATUS.json)"
    message = f": {st['message']}" if st["message"] else ""
    return f"state        {st['state']} (segment {st['segment']}, updated {_when(st['updated_at'])}){message}"


def _steps_line(s: dict) -> str:
    done = 0 if s["status"] is None else s["status"]["last_step"] + 1
    return f"steps        {done} of {s['num_rollout']} trained (--num-rollout)"


def _lease_line(lease: dict | None) -> str:
    if lease is None:
        return "lease        none (no segment ever held it)"
    if lease.get("error"):
        return f"lease        unreadable: {lease['error']}"
    if lease["released"]:
        return f"lease        released by {lease['holder']}"
    state = "expired" if lease["expired"] else "held"
    return f"lease        {state}: {lease['holder']} (expires {_when(lease['expires_at'])})"


def _checkpoints(mgr) -> dict:
    """Complete checkpoints, the newest (LATEST), those that do not verify against their COMPLETE
    (sizes: nothing but the listing is read) and the one a resume starts from."""
    steps = mgr.complete_steps() if mgr.store else []
    wrong = {step: mgr.verify(step, checksums=False) for step in steps}
    unverified = {str(step): "; ".join(w) for step, w in wrong.items() if w}
    verified = [step for step in steps if not wrong[step]]
    return {"steps": steps, "latest": steps[-1] if steps else None, "unverified": unverified,
            "resume_from": verified[-1] if verified else None}


def _checkpoints_line(c: dict) -> str:
    if not c["steps"]:
        return "checkpoints  none"
    latest, bad = c["latest"], c["unverified"]
    if str(latest) in bad:
        start = "none verifies" if c["resume_from"] is None else f"a resume starts after step {c['resume_from']}"
        mark = f": DOES NOT VERIFY ({bad[str(latest)][:160]}); {start}"
    else:
        mark = ""
    older = sorted(int(s) for s in bad if int(s) != latest)
    more = f"; steps {_steps(older)} do not verify" if older else ""
    return f"checkpoints  {_steps(c['steps'])} (LATEST {latest}{mark}){more}"


def _buffer_line(b: dict) -> str:
    return (f"buffer       {b['committed']} groups committed, {b['consumed']} consumed, {b['rejected']} rejected, "
            f"{b['available']} available, {b['quarantined']} quarantined ({b['objects']} objects, "
            f"{b['bytes'] / 1e6:.1f} MB)" + "".join(_unreadable_lines(b)))


def _unreadable_lines(b: dict) -> list[str]:
    """What the buffer counts cannot see: manifests that do not parse, a compaction record that does not."""
    bad = b.get("unreadable_manifests") or []
    covered = [r["step"] for r in bad if r["covered_by_compaction"]]
    after = [r["step"] for r in bad if not r["covered_by_compaction"]]
    lines, unattributed = [], b.get("consumed_or_rejected_unattributed", 0)
    rebuilt = b.get("rebuilt_manifests") or []
    if (unattributed or covered) and rebuilt:
        lines.append(f"\n             + {unattributed} consumed or rejected at steps whose manifest does not parse "
                     f"({_steps(covered) or 'none'}) or was rebuilt from the compaction record ({_steps(rebuilt)}), "
                     "which does not say which")
    elif unattributed or covered:
        lines.append(f"\n             + {unattributed} consumed or rejected at steps whose "
                     f"manifest does not parse ({_steps(covered) or 'none'}; counted from the compaction record)")
    if after:
        lines.append(f"\n             manifests of steps {_steps(after)} do not parse (after the last compaction): "
                     "their groups are counted as available, which they may not be; a resume refuses them")
    if b.get("compaction_error"):
        lines.append(f"\n             compaction record skipped: {b['compaction_error']}")
    return lines


def _eval_lines(evals: dict[str, list[dict]]) -> list[str]:
    if not evals:
        return ["eval         none"]
    return [f"eval {name:<8}" + ", ".join(_eval_cell(r) for r in rows) for name, rows in sorted(evals.items())]


def _eval_cell(r: dict) -> str:
    """One eval result: its mean reward; FAILED when every sample's reward failed (with the first error)."""
    failed, n = r.get("failed_samples", 0), r.get("n_samples", 0)
    if n and failed >= n:
        return f"step {r['step']}: FAILED (reward failed on all {n} samples; first: {r.get('error', '')})"
    cell = f"step {r['step']}: {r.get('mean_reward', float('nan')):.3f}"
    return cell + (f" ({failed} of {n} samples' reward failed)" if failed else "")


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{', '.join(map(str, steps[:5]))}, ... " \
        f"{', '.join(map(str, steps[-5:]))} ({len(steps)})"


def _when(t: float | None) -> str:
    if not t:
        return "?"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
