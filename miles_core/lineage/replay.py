"""`miles replay RUN_URI [--steps N] [--from-step K] [--out URI] [FLAGS...]`: retrain on the recorded groups.

    result = replay_run(run_uri, steps=N, from_step=K, out=URI, flags=[...])   # ReplayResult

A fresh trainer in this process (no Ray, no engine, no generation) trains on exactly the groups
the run trained on, in the recorded order: step s trains the groups of `buffer/consumed/{s}.json`
in the manifest's order (the driver's order: sorted by prompt index), read from the buffer's Arrow
objects (a fork's shared history from the run it was forked from), with the run's
--rollout-sample-filter-path applied again (its marks are not stored).
The trainer starts as the run's step 0 did (--hf-checkpoint, --ref-load, --load) or, with
--from-step K, from step K's checkpoint, and replays steps K+1 on. It uses the torch thread count
of the run's trainer rank (--num-cpus-trainer), so on CPU the same settings reproduce the
recorded train/* metrics (docs/fork-replay.md: tolerance and limits).

FLAGS change training settings for loss ablations (--eps-clip, --kl-loss-coef, --use-tis, --lr,
...). A flag of generation, data, model, evaluation, parallel layout or checkpointing means nothing
without generation and is refused by name.

Output goes to a new location, never into the source run's data: `{RUN_URI}/replays/{UTC time}-{random}/`
or an empty `--out URI`. It holds config.json (the replay's config: `miles report` reads the
location as a run), metrics/trainer/*.jsonl (train/* per step, as a run logs them) and
REPLAY.json (source, steps, overrides, recorded vs replayed train/loss per step).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass

from miles_core.buffer import objects as O
from miles_core.config import ConfigError, RunConfig, parse_flags, replace_fields
from miles_core.config.sections import TrainSection
from miles_core.lineage.command import FLAGS, changed_fields, overrides
from miles_core.lineage.recorded import LineageError, RecordedRun
from miles_core.metrics.names import LOSS
from miles_core.metrics.sink import MetricsSink, read_metrics
from miles_core.prepare.checks import validate
from miles_core.prepare.initial_model import ensure_model
from miles_core.rollout.drain import apply_sample_filter, load_sample_filter
from miles_core.storage import Store, normalize_uri
from miles_core.storage.node_local import localize, require_uri
from miles_core.storage.run_root import write_config
from miles_core.train.initial_weights import apply_load, apply_ref_load
from miles_core.train.trainer import Trainer

REPLAY_KEY = "REPLAY.json"
# Training settings that a single in-process trainer cannot honour or that write elsewhere.
NOT_REPLAYABLE = ("actor_num_nodes", "actor_num_gpus_per_node", "tensor_model_parallel_size",
                  "pipeline_model_parallel_size", "context_parallel_size", "balance_data", "save", "save_interval",
                  "save_hf")
REPLAYABLE = tuple(f.name for f in dataclasses.fields(TrainSection) if f.name not in NOT_REPLAYABLE)


@dataclass(frozen=True)
class StepLoss:
    step: int
    recorded: float | None  # None: the run logged no train/loss at that step
    replayed: float | None

    @property
    def abs_diff(self) -> float | None:
        if self.recorded is None or self.replayed is None:
            return None
        return abs(self.recorded - self.replayed)


@dataclass(frozen=True)
class ReplayResult:
    out_uri: str
    source_run: str
    first_step: int
    overrides: dict
    losses: list[StepLoss]

    @property
    def max_abs_diff(self) -> float | None:
        diffs = [d for s in self.losses if (d := s.abs_diff) is not None]
        return max(diffs) if diffs else None


def replay_run(run_uri: str, *, steps: int | None = None, from_step: int | None = None, out: str | None = None,
               flags: list[str] = ()) -> ReplayResult:
    src = RecordedRun.open(run_uri)
    cfg = replay_config(src, list(flags))
    first = 0 if from_step is None else from_step + 1
    if from_step is not None:
        src.require_checkpoint(from_step)
    manifests = src.manifests(_last_step(src, first, steps), start=first)
    dest = _output(src, out)
    batches = recorded_batches(src, manifests)
    write_config(dest, cfg, 0)
    losses = _train(src, cfg, dest, from_step, batches, _recorded_losses(src))
    result = ReplayResult(dest.root_uri, src.uri, first, overrides(src.cfg, cfg), losses)
    dest.put_json(REPLAY_KEY, {"source_run": src.uri, "from_step": from_step, "first_step": first,
                               "steps": len(losses), "overrides": result.overrides,
                               "max_abs_loss_diff": result.max_abs_diff, "written_at": time.time(),
                               "losses": [dataclasses.asdict(s) | {"abs_diff": s.abs_diff} for s in losses]})
    return result


def replay_config(src: RecordedRun, flags: list[str]) -> RunConfig:
    """The recorded config with FLAGS on top; ConfigError naming any flag a replay cannot honour."""
    cfg = validate(parse_flags(flags, base=src.cfg))
    refused = sorted(FLAGS[name] for name in changed_fields(src.cfg, cfg) if name not in REPLAYABLE)
    if refused:
        raise ConfigError(f"{', '.join(refused)}: a replay retrains one in-process trainer on the recorded groups "
                           "(no generation, data, engines, evaluation or checkpoints), so only training settings "
                           f"can change: {', '.join(FLAGS[n] for n in REPLAYABLE)}")
    return replace_fields(cfg, tensor_model_parallel_size=1)  # one process; DP=N makes the DP=1 update


def _last_step(src: RecordedRun, first: int, steps: int | None) -> int:
    recorded = src.recorded_steps()
    if not recorded or recorded[-1] < first:
        raise LineageError(f"{src.uri} has no recorded step from step {first} on (recorded steps: "
                           f"{f'0..{recorded[-1]}' if recorded else 'none'})")
    if steps is not None and (steps < 1 or first + steps - 1 > recorded[-1]):
        raise LineageError(f"--steps {steps}: {src.uri} recorded steps up to {recorded[-1]}, so from step {first} at "
                           f"most {recorded[-1] - first + 1} can be replayed")
    return recorded[-1] if steps is None else first + steps - 1


def _output(src: RecordedRun, out: str | None) -> Store:
    stamp = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    dest = Store(normalize_uri(out)) if out else src.store.child(f"replays/{stamp}")
    if dest.list(""):
        raise LineageError(f"{dest.root_uri} is not empty; a replay writes only to a new location (--out)")
    return dest


def recorded_batches(src: RecordedRun, manifests: list[dict]) -> list[tuple[int, list]]:
    """(step, groups in the recorded order) of each manifest, decoded from the buffer's objects."""
    rows = _stored_rows(src, {gid for m in manifests for gid in m["consumed"]})
    missing = [(int(m["step"]), gid) for m in manifests for gid in m["consumed"] if gid not in rows]
    if missing:
        raise LineageError(f"{len(missing)} recorded groups are no longer stored in {src.store.uri(O.GROUPS)} (the "
                           f"first: {missing[0][1]!r} of step {missing[0][0]}); a run with "
                           "--buffer-delete-consumed-objects keeps only the manifests of what it trained")
    return [(int(m["step"]), [O.rows_to_group(rows[gid]) for gid in m["consumed"]]) for m in manifests]


def _stored_rows(src: RecordedRun, wanted: set[str]) -> dict:
    """group id -> Arrow rows of the wanted groups, from the run's objects, then (for the history a
    fork shares) from the run it was forked from, and so on up the lineage."""
    rows: dict = {}
    run = src
    while run is not None:
        for _, _, groups in run.read_objects(run.group_keys()):
            rows.update((g.group_id, g.rows) for g in groups if g.group_id in wanted)
        run = run.source() if wanted - rows.keys() else None
    return rows


def _recorded_losses(src: RecordedRun) -> dict[int, float | None]:
    """The loss (`LOSS`, train/loss) per step as the run logged it (the last event of a step: a resumed segment's)."""
    return {e["step"]: e["value"] for e in read_metrics(src.store, "trainer") if e["name"] == LOSS}


def _train(src: RecordedRun, cfg: RunConfig, dest: Store, from_step: int | None, batches: list,
           recorded: dict) -> list[StepLoss]:
    sample_filter = load_sample_filter(cfg.rollout.rollout_sample_filter_path)
    losses = []
    with _trainer(src, cfg, from_step) as trainer, MetricsSink(dest, "trainer", background=False) as sink:
        for step, groups in batches:
            if sample_filter is not None:
                apply_sample_filter(sample_filter, groups)
            metrics = trainer.train_step(step, groups)
            sink.log(step, metrics)
            losses.append(StepLoss(step, recorded.get(step), metrics.get(LOSS)))
    return losses


def _trainer(src: RecordedRun, cfg: RunConfig, from_step: int | None):
    """A trainer set up as the run's trainer rank was at step 0, or restored from `from_step`."""
    import torch

    torch.set_num_threads(cfg.run.rank_threads)  # as TrainerWorker: the same threads give the same float sums
    trainer = Trainer(cfg.train, localize(require_uri(ensure_model(cfg), "--hf-checkpoint"), "models"),
                      seed=cfg.run.seed, optimizer_steps=cfg.optimizer_steps_per_rollout)
    apply_ref_load(trainer, cfg.train.ref_load)
    if from_step is None:
        apply_load(trainer, cfg.train.load, src.checkpoints.store)
    else:
        src.checkpoints.load(from_step, trainer)
    return trainer


def render_replay(result: ReplayResult) -> str:
    """The recorded and replayed train/loss per step, and where the replay went."""
    lines = [f"{'step':>6}  {'recorded ' + LOSS:>22}  {'replayed ' + LOSS:>22}  {'|diff|':>10}"]
    lines += [f"{s.step:>6}  {_fmt(s.recorded):>22}  {_fmt(s.replayed):>22}  {_fmt(s.abs_diff):>10}"
              for s in result.losses]
    return "\n".join(lines + [f"replay of {result.source_run} (overrides: {result.overrides or 'none'}) written to "
                              f"{result.out_uri}"])


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.9g}"
