"""Eval tasks: the follower that runs beside train, and the backfill pieces (docs/evaluation.md).

miles_core.eval does the work; it is imported on use (it pulls in engines and torch), so these
definitions register without it. Contract with miles_core.eval:
    follower.follow_snapshots(cfg) -> summary          runs until STATUS.json leaves `running`
    backfill.plan_and_skips(run_uri, steps, datasets) -> ([(step, dataset name, dataset uri), ...],
                                                          [(step, name or "*", why skipped), ...])
    backfill.evaluate_snapshot(run_uri, step, name, uri, *, n_samples, temperature,
                               max_response_len) -> {metric name: value}   (writes eval/step_k/name.json)
    backfill.rows_table(rows), backfill_table_uri(run_uri), backfill_text(rows, skipped, uri)
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

from flytekit import Deck, Resources, StructuredDataset, dynamic, map_task, task

from images import task_image
from miles_core.storage import normalize_uri
from tasks.failures import recoverable_infrastructure
from tasks.inputs import on_cluster, run_config
from tasks.node_disk import NODE_DISK, pod_template
from tasks.secrets import ENGINE_SECRETS
from tasks.types import DECK_FIELDS, EvalJob, EvalPoint


# A GPU eval pod: the node-local volume at the node cache (the model, the snapshot in use and the next)
# and the temp directory (tasks/node_disk.py); its ephemeral-storage request is in the task's requests,
# which flytekit puts over the template's.
EPHEMERAL = NODE_DISK.ephemeral()
EVAL_POD = pod_template("primary", {})


@task(container_image=task_image("gpu"), requests=Resources(cpu="4", mem="16Gi", ephemeral_storage=EPHEMERAL),
      secret_requests=ENGINE_SECRETS, pod_template=EVAL_POD)
def eval_follower(flags: str, run_id: str, storage_root: str) -> None:
    """Evaluate each complete snapshot under {run root}/snapshots/ as it lands, until the run's
    STATUS.json leaves `running`. Nothing to do when the run has no eval datasets or evaluates
    inside the train task (--eval-mode shared|dedicated).
    """
    cfg = run_config(flags, run_id, storage_root)
    if not cfg.eval.eval_prompt_data or cfg.eval.eval_mode != "tasks":
        return
    from miles_core.eval.follower import follow_snapshots

    # Locally the workflow runs its tasks one after another, so the follower starts after train
    # has finished: the terminal STATUS it sees is this run's, not a previous segment's.
    follow_snapshots(cfg, start_grace_seconds=300.0 if on_cluster() else 0.0)


def eval_resources(engine) -> dict:
    """`with_overrides` arguments of an eval task for the run's `EngineSection`: an SGLang engine
    needs its GPUs (--rollout-num-gpus-per-engine); the CPU engine needs none. The requests replace the
    task's whole, so they repeat its ephemeral-storage request."""
    if engine.engine_backend != "sglang":
        return {"requests": Resources(cpu="4", mem="16Gi", ephemeral_storage=EPHEMERAL)}
    gpus = str(max(1, engine.rollout_num_gpus_per_engine))
    return {"requests": Resources(cpu="4", mem="16Gi", gpu=gpus, ephemeral_storage=EPHEMERAL),
            "limits": Resources(gpu=gpus)}


@dynamic(container_image=task_image("cpu"), requests=Resources(cpu="1", mem="1Gi"), secret_requests=ENGINE_SECRETS)
def eval_follower_sized(flags: str, run_id: str, storage_root: str) -> None:
    """`eval_follower` with the resources the run's engine backend needs (a GPU for SGLang)."""
    cfg = run_config(flags, run_id, storage_root)
    eval_follower(flags=flags, run_id=run_id, storage_root=storage_root).with_overrides(**eval_resources(cfg.engine))


@dynamic(container_image=task_image("cpu"), requests=Resources(cpu="1", mem="1Gi"))
def evaluate_jobs(run_uri: str, jobs: List[EvalJob], concurrency: int) -> List[EvalPoint]:
    """`eval_snapshot` over `jobs` (map_task), sized for the run's engine backend (a GPU for SGLang)."""
    from miles_core.eval.backfill import run_config_of

    sized = eval_resources(run_config_of(normalize_uri(run_uri)).engine)
    return map_task(eval_snapshot, concurrency=concurrency)(job=jobs).with_overrides(**sized)


BackfillPlan = NamedTuple("BackfillPlan", [("jobs", List[EvalJob]), ("skipped", List[str])])


@task(container_image=task_image("cpu"), requests=Resources(cpu="1", mem="2Gi"))
def plan_backfill(run_uri: str, steps: Optional[List[int]], datasets: Optional[List[str]], n_samples: int,
                  temperature: float, max_response_len: int) -> BackfillPlan:
    """The (snapshot, dataset) pairs to evaluate: the given steps (default: every complete snapshot
    without results) on the given `name=uri` datasets (default: the run's --eval-prompt-data); and
    one line per step (or step x dataset) left out, saying why.
    """
    from miles_core.eval.backfill import plan_and_skips

    uri = normalize_uri(run_uri)
    pairs, skipped = plan_and_skips(uri, steps, datasets)
    return BackfillPlan([EvalJob(uri, step, name, ds_uri, n_samples, temperature, max_response_len)
                         for step, name, ds_uri in pairs],
                        [f"step {step} {'(every dataset)' if name == '*' else name}: {why}" for step, name, why in skipped])


@task(container_image=task_image("gpu"), requests=Resources(cpu="4", mem="16Gi", ephemeral_storage=EPHEMERAL),
      retries=1, pod_template=EVAL_POD)
def eval_snapshot(job: EvalJob) -> EvalPoint:
    """Evaluate one snapshot on one dataset; writes eval/step_{k}/{dataset}.json in the run root."""
    from miles_core.eval.backfill import evaluate_snapshot

    with recoverable_infrastructure():  # its retry re-evaluates the snapshot
        metrics = evaluate_snapshot(job.run_uri, job.step, job.dataset, job.dataset_uri, n_samples=job.n_samples,
                                    temperature=job.temperature, max_response_len=job.max_response_len or None)
    return EvalPoint(job.step, job.dataset, {k: float(v) for k, v in metrics.items()})


@task(container_image=task_image("cpu"), enable_deck=True, deck_fields=DECK_FIELDS,
      requests=Resources(cpu="1", mem="2Gi"))
def backfill_table(run_uri: str, points: List[EvalPoint], skipped: List[str]) -> StructuredDataset:
    """One row per (step, dataset, metric), saved in the run root under eval/backfill/{time}/ and
    returned; printed (with the skipped steps and why) for the console, and the eval curves as the Deck."""
    from miles_core.eval.backfill import backfill_table_uri, backfill_text, rows_table
    from miles_core.metrics.report import eval_figure

    rows = [{"step": p.step, "dataset": p.dataset, "metric": name, "value": value}
            for p in points for name, value in sorted(p.metrics.items())]
    uri = backfill_table_uri(normalize_uri(run_uri))
    print(backfill_text(rows, skipped, uri), flush=True)
    # evaluate_snapshot returns full metric names (eval/{ds}, eval/{ds}/pass@1, eval/lag_steps, ...);
    # short per-dataset names ("mean", "pass@1") are accepted too.
    events = [{"step": r["step"], "time": 0.0, "value": r["value"],
               "name": r["metric"] if r["metric"].startswith("eval/") else
               f"eval/{r['dataset']}" if r["metric"] in ("", "mean") else f"eval/{r['dataset']}/{r['metric']}"}
              for r in rows]
    Deck("eval curves", eval_figure(events).to_html(full_html=False, include_plotlyjs=True))
    return StructuredDataset(dataframe=rows_table(rows), uri=uri)
