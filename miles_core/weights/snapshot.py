"""Snapshots: HF checkpoints of the trainer's weights under `{run root}/snapshots/step_{k:08d}/`.

`export_snapshot(trainer, store, step)` writes model.safetensors, config.json and tokenizer files,
then `.complete` last (readers never trust a directory without it, docs/quickstart.md#where-the-run-lives).
Engines get the snapshot's URI and copy it to their own node (`miles_core.storage.node_local.localize`).

Written by several ranks at once (`parts` > 1: docs/training.md, "Weight export"): the HF tensors are
cut into `parts` shards of about equal bytes (`partition`, the same on every rank that holds them);
part i is written by the i-th writer (`export_part`) as `model-0000{i+1}-of-0000{n}.safetensors`, and
part 0's writer also writes `model.safetensors.index.json` (HF's sharded layout, which SGLang,
transformers and the CPU engine read) and the small files. No writer writes `.complete`: whoever saw
every writer finish seals the directory (`seal`), so a reader never finds a part missing.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from miles_core.failures import chaos
from miles_core.storage import COMPLETE_MARKER, Store
from miles_core.storage.tensor_files import put_tensors
from miles_core.storage.weight_versions import PartStats, PartWriter, in_version, model_file

MARKER = COMPLETE_MARKER
_STEP = re.compile(r"^step_(\d{8})$")


def snapshot_key(step: int, prefix: str = "snapshots") -> str:
    return f"{prefix}/step_{step:08d}" if prefix else f"step_{step:08d}"


class SnapshotError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def export_snapshot(trainer, store: Store, step: int, *, prefix: str = "snapshots", dtype=None,
                    key: str | None = None, parts: int = 1) -> str:
    """Write the snapshot of `trainer` for `step` (at `key`, default `{prefix}/step_{k:08d}`); return
    its key. `.complete` is written last; with `parts` > 1 this writes part 0, the index and the small
    files, and the other writers' parts and `seal` complete it."""
    key = snapshot_key(step, prefix) if key is None else key.strip("/")

    def copy(name: str) -> None:
        store.put_bytes(in_version(key, name), trainer.aux_files[name])

    # The small files (config, tokenizer) commit in parallel with the weights: each put is fsynced.
    with ThreadPoolExecutor(max_workers=4) as pool:
        small = [pool.submit(copy, name) for name in trainer.aux_files]
        state = trainer.hf_state_dict(dtype)
        if parts == 1:
            put_tensors(store, in_version(key, "model.safetensors"), state,
                        digest=False)  # nothing lists a snapshot's digest: write the bytes once, never read them back
        else:
            export_part(state, store, key, 0, parts)
            store.put_json(in_version(key, INDEX), index(state, parts))
        for f in small:
            f.result()
    if parts == 1:
        seal(store, key)
    return key


INDEX = "model.safetensors.index.json"


def partition(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """The tensor names cut into `parts` lists of about equal bytes: the largest first, each to the part
    with the fewest bytes so far (ties: the lower part); deterministic, so every writer computes the same."""
    load = [0] * parts
    out: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = min(range(parts), key=lambda p: (load[p], p))
        out[i].append(name)
        load[i] += sizes[name]
    return [sorted(names) for names in out]


def _sizes(state: dict) -> dict[str, int]:
    return {name: t.numel() * t.element_size() for name, t in state.items()}


def export_part(state: dict, store: Store, key: str, i: int, parts: int) -> int:
    """Write part i of `parts` of the HF tensors `state` (every writer holds the same names and shapes);
    returns its bytes."""
    names = partition(_sizes(state), parts)[i]
    return put_tensors(store, in_version(key, model_file(i, parts)), {n: state[n] for n in names}, digest=False)["size"]


def index(state: dict, parts: int) -> dict:
    """HF's `model.safetensors.index.json` of `state` cut into `parts`."""
    return _index(_sizes(state), parts)


def _index(sizes: dict[str, int], parts: int) -> dict:
    weight_map = {n: model_file(i, parts) for i, names in enumerate(partition(sizes, parts)) for n in names}
    return {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}


def export_version(state: dict, store: Store, key: str, writer: PartWriter, i: int = 0, parts: int = 1,
                   aux_files: dict[str, bytes] | None = None) -> PartStats:
    """Write part i of `parts` of the published weight version at `key` from the HF tensors `state`: bf16, an
    anchor or a delta against the part `writer` wrote before (docs/weight-versions.md). The writer of part 0
    passes `aux_files` (config, tokenizer) and writes them and, with several parts, HF's index. Not sealed:
    `seal` it once every part is written."""
    sizes = {n: t.numel() * 2 for n, t in state.items()}  # the published dtype's bytes: every writer cuts the same
    with ThreadPoolExecutor(max_workers=4) as pool:
        small = [pool.submit(store.put_bytes, in_version(key, name), data) for name, data in (aux_files or {}).items()]
        stats = writer.write(store, key, state, i, parts, partition(sizes, parts)[i])
        if not stats.anchor:
            chaos.point("weights.delta")  # a delta part written, the version not sealed
        if aux_files is not None and parts > 1:
            store.put_json(in_version(key, INDEX), _index(sizes, parts))
        for f in small:
            f.result()
    return stats


def seal(store: Store, key: str = "") -> None:
    """Mark the snapshot at `key` complete (its last write: every part and small file is there). The marker
    holds a token of its own: a directory written again under the same name (a trainer restarted from a
    checkpoint publishes its steps again) is another entry in every node cache, never the copy of the old
    contents (miles_core.storage.weight_versions.localize_weights)."""
    import uuid

    store.put_bytes(in_version(key, MARKER), uuid.uuid4().hex.encode())


def seal_uri(uri: str) -> None:
    """`seal` the snapshot directory at `uri` (the driver, once every writer rank answered)."""
    seal(Store(uri))


def complete_snapshots(store: Store, prefix: str = "snapshots") -> list[int]:
    steps = []
    for k in store.list(prefix):
        parts = k[len(prefix):].strip("/").split("/")
        if len(parts) == 2 and parts[1] == MARKER and (m := _STEP.match(parts[0])):
            steps.append(int(m.group(1)))
    return sorted(steps)
