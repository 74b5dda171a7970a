"""An independent reader of a run root: pyarrow, json, numpy, zstandard, xxhash and safetensors only, no
miles_core import.

It knows only the documented layout (docs/data-path.md, miles_core/buffer/objects.py's docstring):
STATUS.json; buffer/groups/{writer}/{seq}.arrow (Arrow IPC streams, one row per sample, with
group_id and a JSON metadata column holding the data source's epoch and position);
buffer/consumed/{step:08d}.json (per-step manifests: consumed and rejected ids, objects done);
buffer/compacted/upto_{step:08d}.json (the fold of every manifest through a checkpointed step:
objects done as per-writer seq ranges, consumed ids of objects not done); checkpoints/LATEST naming
a step directory with a COMPLETE marker and safetensors files; metrics/{component}/*.jsonl events;
weights/step_{k:08d}/ weight versions (docs/weight-versions.md): bf16 anchor parts whose metadata holds
`miles.checksums` (xxh3-64 of each tensor's bytes) or zstd delta parts naming their base (`miles.base`)
and holding, per changed tensor, byte planes of int32 position gaps (`:i`) and int16 bits (`:v`), or its
whole bits (`:d`).
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


def _safetensors(data: bytes) -> tuple[dict, dict]:
    """({name: flat little-endian array}, metadata) of a safetensors buffer, parsed by hand (numpy has no
    bf16: BF16 comes back as int16 bits)."""
    import numpy as np

    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    dtypes = {"BF16": np.int16, "I16": np.int16, "I32": np.int32, "U8": np.uint8, "F32": np.float32}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        dtype = np.dtype(dtypes[info["dtype"]])
        a = np.frombuffer(data, dtype=dtype, count=(hi - lo) // dtype.itemsize, offset=8 + n + lo)
        out[name] = a.reshape(info["shape"]) if info["shape"] else a
    return out, header.get("__metadata__") or {}


def _unplanes(planes, dtype):
    import numpy as np

    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1)


def _rebuild_part(weights: Path, version: str, part: str, delta: str, depth: int = 0) -> dict:
    """{tensor: int16 bits} of `part` (an anchor file name) of `version`, back along its deltas' bases."""
    import numpy as np
    import xxhash
    import zstandard

    if depth > 1000:
        raise ValueError(f"{version}: no anchor within 1000 versions")
    d = weights / version
    if (d / delta).exists():
        tensors, meta = _safetensors(zstandard.ZstdDecompressor().decompress((d / delta).read_bytes()))
        state = {k: v.copy() for k, v in _rebuild_part(weights, meta["miles.base"], part, delta, depth + 1).items()}
        for name in json.loads(meta["miles.checksums"]):
            if f"{name}:d" in tensors:
                state[name] = tensors[f"{name}:d"].reshape(-1).copy()
            elif f"{name}:i" in tensors:
                where = np.cumsum(_unplanes(tensors[f"{name}:i"], np.int32), dtype=np.int64)
                try:
                    state[name][where] = _unplanes(tensors[f"{name}:v"], np.int16)
                except (IndexError, ValueError, KeyError) as e:
                    raise ValueError(f"{version}: {name}: the delta's positions do not fit the tensor its checksums "
                                     f"name ({e})") from e
    elif (d / part).exists():
        tensors, meta = _safetensors((d / part).read_bytes())
        state = {k: v.reshape(-1) for k, v in tensors.items()}
    else:
        raise ValueError(f"{version} holds neither {part} nor {delta}: its chain is broken")
    sums = json.loads(meta.get("miles.checksums", "{}"))
    bad = [n for n, want in sums.items() if xxhash.xxh3_64_hexdigest(state[n].tobytes()) != want]
    if bad or (sums and set(sums) != set(state)):
        raise ValueError(f"{version}/{part}: tensors {bad or sorted(set(sums) ^ set(state))} differ from its checksums")
    return state


def weight_versions_rebuild(r: RunRoot, steps: int, batch: int) -> list[str]:
    """Every sealed weight version whose chain is still stored rebuilds to its checksums; the newest one
    does (a retained version is never broken). A superseded one being deleted may have lost its base."""
    weights = r.path / "weights"
    sealed = sorted(d.name for d in weights.glob("step_*") if (d / ".complete").exists()) if weights.exists() else []
    p = []
    for version in sealed:
        d = weights / version
        parts = set()
        for f in d.iterdir():
            if f.name == "model.safetensors":
                parts.add((1, 1))
            elif m := re.fullmatch(r"(?:model|delta)-(\d{5})-of-(\d{5})\.safetensors(?:\.zst)?", f.name):
                parts.add((int(m.group(1)), int(m.group(2))))
        for i, n in sorted(parts):
            model = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            delta = f"delta-{i:05d}-of-{n:05d}.safetensors.zst"
            if (d / model).exists() and (d / delta).exists():
                p.append(f"weight version {version}: both an anchor and a delta of part {i} of {n} "
                         "(one of them left by a publish killed midway)")
            try:
                _rebuild_part(weights, version, model, delta)
            except ValueError as e:
                if version == sealed[-1] or "checksums" in str(e):
                    p.append(f"weight version {version}: {e}")
    return p


def weight_kinds(run: Path) -> dict[str, str]:
    """version -> "anchor" or "delta" for every weight version directory left in the run root."""
    weights = run / "weights"
    return {d.name: ("delta" if any(d.glob("delta-*")) else "anchor")
            for d in sorted(weights.glob("step_*"))} if weights.exists() else {}


RULES = (finished, every_step_once, consumed_exactly_once, consumed_were_committed, compaction_agrees,
         final_checkpoint_loads, weight_versions_rebuild)


def check(run: Path, steps: int, batch_groups: int, committed_before: set[str]) -> list[str]:
    """Every rule's problems; plus: no group committed before a kill (`committed_before`) is gone."""
    r = load(run)
    problems = [msg for rule in RULES for msg in rule(r, steps, batch_groups)]
    lost = committed_before - {gid for ids in r.objects.values() for gid in ids}
    if lost:
        problems.append(f"{len(lost)} group(s) committed before a kill are gone, e.g. {sorted(lost)[:3]}")
    return problems
