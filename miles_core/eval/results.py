"""Eval results in the run root: `eval/step_{k:08d}/{dataset}.json`, one object per snapshot and
dataset, committed atomically. A snapshot that could not be evaluated gets
`eval/step_{k:08d}/_skipped.json` (reason) instead, so the scheduler can tell "settled" from
"pending". Dataset names never start with '_' (storage.validate_name), so the two cannot collide.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass, field

from miles_core.metrics import names as N
from miles_core.storage import ObjectNotFound, StorageError, StorageUnavailable, Store

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval"
REQUESTS_PREFIX = "eval/requests"
SKIPPED_NAME = "_skipped"
_RESULT_RE = re.compile(r"^eval/step_(\d+)/([^/]+)\.json$")
_REQUEST_RE = re.compile(r"^eval/requests/step_(\d+)\.json$")


def step_dir(step: int) -> str:
    return f"{EVAL_PREFIX}/step_{step:08d}"


def result_key(step: int, dataset: str) -> str:
    return f"{step_dir(step)}/{dataset}.json"


def request_key(step: int) -> str:
    return f"{REQUESTS_PREFIX}/step_{step:08d}.json"


@dataclass
class EvalResult:
    step: int
    dataset: str
    metrics: dict[str, float]
    n_prompts: int = 0
    n_samples: int = 0
    weight_version: int | None = None
    snapshot_uri: str = ""
    dataset_uri: str = ""
    sampling: dict = field(default_factory=dict)
    mode: str = ""
    duration_seconds: float = 0.0
    lag_steps: int | None = None
    evaluated_at: float = field(default_factory=time.time)
    failed_samples: int = 0  # samples whose reward failed (each scored 0)
    error: str = ""  # the first of their errors

    @property
    def failed(self) -> bool:
        """Every sample's reward failed: the metrics are zeros that say nothing about the model."""
        return self.n_samples > 0 and self.failed_samples >= self.n_samples

    def to_row(self) -> dict:
        """A flat table row (the backfill's StructuredDataset)."""
        row = {"step": self.step, "dataset": self.dataset, "weight_version": self.weight_version,
               "n_prompts": self.n_prompts, "n_samples": self.n_samples, "mode": self.mode,
               "duration_seconds": self.duration_seconds, "snapshot_uri": self.snapshot_uri,
               "evaluated_at": self.evaluated_at}
        prefix = N.eval_reward_metric(self.dataset)
        for name, value in self.metrics.items():
            col = "mean_reward" if name == prefix else name[len(prefix) + 1:] if name.startswith(prefix + "/") else name
            row[col] = float(value)
        return row


def write_result(store: Store, result: EvalResult) -> str:
    key = result_key(result.step, result.dataset)
    store.put_json(key, asdict(result))
    return key


def read_result(store: Store, step: int, dataset: str) -> EvalResult | None:
    try:
        d = store.get_json(result_key(step, dataset))
    except ObjectNotFound:
        return None
    known = set(EvalResult.__dataclass_fields__)
    return EvalResult(**{k: v for k, v in d.items() if k in known})


def write_skipped(store: Store, step: int, reason: str, detail: str = "") -> None:
    store.put_json(f"{step_dir(step)}/{SKIPPED_NAME}.json",
                   {"step": step, "reason": reason, "detail": detail[:2000], "at": time.time()})


def evaluated(store: Store) -> dict[int, set[str]]:
    """step -> dataset names with a result ('_skipped' included when the snapshot was skipped)."""
    out: dict[int, set[str]] = {}
    for key in store.list(EVAL_PREFIX):
        m = _RESULT_RE.match(key)
        if m:
            out.setdefault(int(m.group(1)), set()).add(m.group(2))
    return out


def all_results(store: Store) -> list[EvalResult]:
    """Every eval result, in step order; one that does not parse (truncated, garbage) is skipped with a
    warning naming it, so one bad file never stops `miles runs show`, `miles lineage` or the report."""
    rows = []
    for step, names in sorted(evaluated(store).items()):
        for ds in sorted(names):
            if ds == SKIPPED_NAME:
                continue
            r = _result_or_none(store, step, ds)
            if r is not None:
                rows.append(r)
    return rows


def _result_or_none(store: Store, step: int, dataset: str) -> EvalResult | None:
    try:
        return read_result(store, step, dataset)
    except StorageUnavailable:
        raise
    except (StorageError, ValueError, TypeError, AttributeError) as e:
        log.warning("eval result %s skipped: it does not parse (%s)", store.uri(result_key(step, dataset)), e)
        return None


def write_request(store: Store, step: int, snapshot_uri: str, version: int | None) -> None:
    """Mode 3: ask the eval follower to evaluate `step` (its snapshot is complete)."""
    store.put_json(request_key(step), {"step": step, "snapshot_uri": snapshot_uri, "weight_version": version,
                                       "requested_at": time.time()})


def requests(store: Store) -> dict[int, dict]:
    out = {}
    for key in store.list(REQUESTS_PREFIX):
        m = _REQUEST_RE.match(key)
        if m:
            try:
                out[int(m.group(1))] = store.get_json(key)
            except ObjectNotFound:
                continue
    return out


def record_evals(store: Store, evals, *, step: int, version: int | None, snapshot_uri: str, datasets,
                 sampling, mode: str, lag_steps: int | None, duration_seconds: float,
                 metrics=None) -> dict[str, float]:
    """Write one snapshot's results (one object per dataset) and log its metrics at `step`.

    `evals`: DatasetEval list; `datasets`: the EvalDatasets they came from (for their URIs);
    `metrics`: a sink with log(step, dict), or None. Returns the metrics logged.
    """
    uris = {d.name: d.uri for d in datasets}
    logged: dict[str, float] = {}
    for ev in evals:
        write_result(store, EvalResult(
            step=step, dataset=ev.dataset, metrics=ev.metrics, n_prompts=ev.n_prompts, n_samples=ev.n_samples,
            weight_version=version, snapshot_uri=snapshot_uri, dataset_uri=uris.get(ev.dataset, ""),
            sampling=sampling.to_dict(), mode=mode, duration_seconds=ev.duration_seconds, lag_steps=lag_steps,
            failed_samples=getattr(ev, "failed_samples", 0), error=getattr(ev, "error", "")))
        logged.update(ev.metrics)
    logged[N.EVAL_DURATION_SECONDS] = float(duration_seconds)
    if lag_steps is not None:
        logged[N.EVAL_LAG_STEPS] = float(lag_steps)
    if metrics is not None:
        metrics.log(step, logged)
    return logged


def record_skip(store: Store | None, step: int, reason: str, detail: str = "", metrics=None) -> dict[str, float]:
    """Count a skipped eval: `eval/skipped_{reason}` = 1 at `step`, and a `_skipped` marker when `store`."""
    name = N.eval_skipped_metric(reason)
    if store is not None:
        try:
            write_skipped(store, step, reason, detail)
        except Exception:  # noqa: BLE001 - the metric below still records the skip
            pass
    if metrics is not None:
        metrics.log(step, {name: 1.0})
    return {name: 1.0}


def settled_steps(store: Store, dataset_names) -> set[int]:
    """Steps with a result for every dataset in `dataset_names`, or a skip marker."""
    need = set(dataset_names)
    return {s for s, have in evaluated(store).items() if SKIPPED_NAME in have or need <= have}


HEARTBEAT_KEY = "eval/follower_heartbeat.json"


def write_heartbeat(store: Store) -> None:
    """The eval follower is alive (Mode 3); the trainer's scheduler applies its in-flight limit only then."""
    store.put_json(HEARTBEAT_KEY, {"updated_at": time.time()})


def follower_alive(store: Store, max_age_seconds: float = 60.0) -> bool:
    """True when an eval follower wrote its heartbeat within `max_age_seconds` (wall clock)."""
    try:
        beat = store.get_json(HEARTBEAT_KEY)
    except ObjectNotFound:
        return False
    except Exception:  # noqa: BLE001 - unreadable: assume alive, so backpressure still bounds the pending set
        return True
    return time.time() - float(beat.get("updated_at", 0.0)) <= max_age_seconds
