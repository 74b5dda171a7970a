"""An independent reader of a run root: pyarrow, json and safetensors only, no miles_core import.

It knows only the documented layout (docs/data-path.md, miles_core/buffer/objects.py's docstring):
STATUS.json; buffer/groups/{writer}/{seq}.arrow (Arrow IPC streams, one row per sample, with
group_id and a JSON metadata column holding the data source's epoch and position);
buffer/consumed/{step:08d}.json (per-step manifests: consumed and rejected ids, objects done);
buffer/compacted/upto_{step:08d}.json (the fold of every manifest through a checkpointed step:
objects done as per-writer seq ranges, consumed ids of objects not done); checkpoints/LATEST naming
a step directory with a COMPLETE marker and safetensors files; metrics/{component}/*.jsonl events.
`check` returns the problems it finds (an empty list: the run root is consistent). Each rule is
one small function over the loaded `RunRoot`, so a layout change touches one reader.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa


@dataclass
class RunRoot:
    """What the checker reads, once: group objects, manifests, the compaction record, STATUS.json."""

    path: Path
    objects: dict[str, list[str]] = field(default_factory=dict)  # "writer/seq" -> its group ids
    positions: dict[str, tuple] = field(default_factory=dict)  # group id -> (epoch, position)
    manifests: dict[int, dict] = field(default_factory=dict)  # step -> manifest
    compacted: dict | None = None  # the newest upto_{step}.json
    status: dict = field(default_factory=dict)

    @property
    def consumed(self) -> list[str]:
        return [gid for step in sorted(self.manifests) for gid in self.manifests[step]["consumed"]]

    @property
    def rejected(self) -> set[str]:
        return {gid for m in self.manifests.values() for gid in m.get("rejected", [])}


def read_objects(run: Path) -> tuple[dict[str, list[str]], dict[str, tuple]]:
    objects, positions = {}, {}
    for f in sorted((run / "buffer" / "groups").glob("*/*.arrow")):
        table = pa.ipc.open_stream(pa.py_buffer(f.read_bytes())).read_all()
        ids = table.column("group_id").to_pylist()
        objects[f"{f.parent.name}/{f.stem}"] = list(dict.fromkeys(ids))
        for gid, meta in zip(ids, table.column("metadata").to_pylist()):
            m = json.loads(meta or "{}")
            if isinstance(m, dict) and isinstance(m.get("position"), int):  # a data-source prompt, not a synthetic one
                positions.setdefault(gid, (m.get("epoch"), m["position"]))
    return objects, positions


def read_manifests(run: Path) -> dict[int, dict]:
    return {int(f.stem): json.loads(f.read_text()) for f in (run / "buffer" / "consumed").glob("*.json")
            if f.stem.isdigit()}


def read_compacted(run: Path) -> dict | None:
    records = sorted((run / "buffer" / "compacted").glob("upto_*.json"))
    return json.loads(records[-1].read_text()) if records else None


def load(run: Path) -> RunRoot:
    objects, positions = read_objects(run)
    status = json.loads((run / "STATUS.json").read_text()) if (run / "STATUS.json").exists() else {}
    return RunRoot(run, objects, positions, read_manifests(run), read_compacted(run), status)


def committed_groups(run: Path) -> dict[str, str]:
    """group id -> "writer/seq" of the object holding it, over every committed group object."""
    return {gid: key for key, ids in read_objects(run)[0].items() for gid in ids}


def metric_total(run: Path, name: str) -> float:
    """The sum of every recorded value of metric `name` (metrics/**/*.jsonl)."""
    total = 0.0
    for f in sorted((run / "metrics").rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            event = json.loads(line) if line.strip() else {}
            total += event.get("value", 0.0) if event.get("name") == name else 0.0
    return total


# ---------------------------------------------------------------- the rules

def finished(r: RunRoot, steps: int, batch: int) -> list[str]:
    if r.status.get("state") != "finished" or r.status.get("last_step") != steps - 1:
        return [f"STATUS.json: {r.status}, expected finished at step {steps - 1}"]
    return []


def every_step_once(r: RunRoot, steps: int, batch: int) -> list[str]:
    p = []
    if sorted(r.manifests) != list(range(steps)):
        p.append(f"consumption manifests of steps {sorted(r.manifests)}, expected 0..{steps - 1}")
    short = [s for s, m in r.manifests.items() if len(m["consumed"]) != batch]
    if short:
        p.append(f"steps {short} did not consume {batch} groups each")
    return p


def consumed_exactly_once(r: RunRoot, steps: int, batch: int) -> list[str]:
    ids = r.consumed
    p = []
    if len(set(ids)) != len(ids):
        p.append(f"{len(ids) - len(set(ids))} group(s) consumed twice")
    trained = [r.positions.get(gid) for gid in ids if gid in r.positions]
    if len(set(trained)) != len(trained):
        p.append(f"{len(trained) - len(set(trained))} prompt position(s) trained twice")
    if set(ids) & r.rejected:
        p.append(f"group(s) both consumed and rejected: {sorted(set(ids) & r.rejected)[:3]}")
    return p


def consumed_were_committed(r: RunRoot, steps: int, batch: int) -> list[str]:
    held = {gid for ids in r.objects.values() for gid in ids}
    missing = set(r.consumed) - held
    return [f"{len(missing)} consumed group(s) have no committed object, e.g. {sorted(missing)[:3]}"] if missing else []


def compaction_agrees(r: RunRoot, steps: int, batch: int) -> list[str]:
    """The compaction record says only what its manifests say: an object it calls done holds no group
    that was neither consumed nor rejected through its step, and its consumed ids were."""
    if r.compacted is None:
        return []
    through = r.compacted["through_step"]
    settled = {gid for s, m in r.manifests.items() if s <= through for gid in (*m["consumed"], *m.get("rejected", []))}
    p = []
    for writer, runs in r.compacted.get("objects_done", {}).items():
        for lo, hi in runs:
            for seq in range(lo, hi + 1):
                open_ids = set(r.objects.get(f"{writer}/{seq:012d}", ())) - settled
                if open_ids:
                    p.append(f"compaction through step {through} calls {writer}/{seq:012d} done, but "
                             f"{sorted(open_ids)[:3]} were never consumed or rejected")
    unknown = set(r.compacted.get("consumed", ())) - settled
    if unknown:
        p.append(f"compaction through step {through} lists {len(unknown)} id(s) no manifest consumed")
    return p


def final_checkpoint_loads(r: RunRoot, steps: int, batch: int) -> list[str]:
    from safetensors.numpy import load_file

    latest_file = r.path / "checkpoints" / "LATEST"
    latest = latest_file.read_text().strip() if latest_file.exists() else ""
    step_dir = r.path / "checkpoints" / latest
    m = re.fullmatch(r"step_(\d+)", latest)
    if not latest or not (step_dir / "COMPLETE").exists() or not m or int(m.group(1)) != steps - 1:
        return [f"checkpoints/LATEST -> {latest!r}: not the complete checkpoint of step {steps - 1}"]
    tensors = sum(len(load_file(str(f))) for f in sorted(step_dir.glob("*.safetensors")))
    return [] if tensors else [f"{step_dir}: no tensors in its safetensors files"]


RULES = (finished, every_step_once, consumed_exactly_once, consumed_were_committed, compaction_agrees,
         final_checkpoint_loads)


def check(run: Path, steps: int, batch_groups: int, committed_before: set[str]) -> list[str]:
    """Every rule's problems; plus: no group committed before a kill (`committed_before`) is gone."""
    r = load(run)
    problems = [msg for rule in RULES for msg in rule(r, steps, batch_groups)]
    lost = committed_before - {gid for ids in r.objects.values() for gid in ids}
    if lost:
        problems.append(f"{len(lost)} group(s) committed before a kill are gone, e.g. {sorted(lost)[:3]}")
    return problems
