"""The data path between the producer and the trainer (docs/data-path.md).

    handler = build_unused_handler(cfg.buffer.async_unused_samples_handler, recycle=data_source.recycle)
    buffer = build_buffer(cfg, handler, consumed_through_step=resume_step)
    buffer.put(group)                              # producer side; blocks when full
    group = buffer.get(current_version=v)          # trainer side; waits when empty
    buffer.record_consumed(step, [g.group_id ...]) # with each training step (durable)
    buffer.compact(step)                           # after each complete checkpoint (bounded reopen)

Modules: `contract` (the DataBuffer slot, unused-samples handlers), `build` (build_buffer), `durable` (the
default buffer), `objects` (layout and codec in the run root), `window` (the per-window metric counters;
their names are in miles_core.metrics.names), `inspect` (`miles buffer inspect`).
"""

from miles_core.buffer.build import build_buffer
from miles_core.buffer.contract import (
    BufferClosed,
    BufferTimeout,
    DataBuffer,
    DataBufferError,
    DropUnused,
    RetryUnused,
    UnusedSamplesHandler,
    build_unused_handler,
    cleared_group,
)
from miles_core.buffer.durable import DurableBuffer

__all__ = [
    "BufferClosed",
    "BufferTimeout",
    "DataBuffer",
    "DataBufferError",
    "DropUnused",
    "DurableBuffer",
    "RetryUnused",
    "UnusedSamplesHandler",
    "build_buffer",
    "build_unused_handler",
    "cleared_group",
]
