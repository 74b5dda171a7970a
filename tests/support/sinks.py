"""Readers of what the metric mirrors write: TensorBoard event files and W&B's offline run files.
Used by tests/unit/test_metrics_mirrors.py and the end-to-end run (tests/e2e/test_pyflyte_run.py)."""

from __future__ import annotations

import glob
import json
import os
import struct


def scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files under `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(run_dir: str) -> list[dict]:
    """History rows of an offline `.wandb` file: a 7-byte header, then LevelDB-log records
    (crc32, length, type; 32 KiB blocks) each holding one protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb").read()
    assert data[:4] == b":W&B"
    pos, chunks, rows = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows
