"""`build_buffer(cfg, ...)`: the run's data buffer, the custom class of
`--custom-async-data-buffer-path` (checked against the DataBuffer slot) or the durable default."""

from __future__ import annotations

import inspect
import logging

from miles_core.buffer.contract import (
    BUFFER_FLAG,
    BUFFER_METHODS,
    DataBuffer,
    UnusedSamplesHandler,
    load_dynamic_filter,
)
from miles_core.buffer.durable import DurableBuffer
from miles_core.config import RunConfig
from miles_core.config.plugins import load_plugin
from miles_core.storage import Store

log = logging.getLogger(__name__)


def build_buffer(cfg: RunConfig, unused_handler: UnusedSamplesHandler, *, consumed_through_step: int,
                 store: Store | None = None, writer_id: str | None = None) -> DataBuffer:
    """The run's data buffer: the custom class of `--custom-async-data-buffer-path`, else the durable one.

    `consumed_through_step` is the step of the checkpoint a resume starts from, -1 without one (no
    default: see `DurableBuffer.open`). A bad plugin path raises PluginError naming the flag.
    """
    store = store if store is not None else Store(cfg.run_uri)
    path = cfg.buffer.custom_async_data_buffer_path
    if path:
        return _build_plugin(load_plugin(path, BUFFER_FLAG, BUFFER_METHODS), cfg, unused_handler, store,
                             consumed_through_step)
    return DurableBuffer.open(
        store,
        capacity_groups=cfg.buffer_capacity_groups,
        max_weight_staleness=cfg.rollout.max_weight_staleness,
        unused_handler=unused_handler,
        dynamic_filter=load_dynamic_filter(cfg.rollout.dynamic_sampling_filter_path),
        coalesce_seconds=cfg.buffer.buffer_coalesce_seconds,
        consumed_through_step=consumed_through_step,
        writer_id=writer_id,
        foreign_poll_seconds=cfg.buffer.producer_poll_seconds if cfg.buffer.allow_rollout_producers else None,
    )


def _build_plugin(cls, cfg, unused_handler, store, consumed_through_step: int) -> DataBuffer:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_kwargs or {"store", "consumed_through_step"} <= params.keys():
        return cls(cfg, unused_handler, store=store, consumed_through_step=consumed_through_step)
    log.warning("%s: %s.__init__ takes no store= and consumed_through_step= keywords, so it is built without "
                "them: it cannot find the run's committed groups after a crash or resume, nor tell which were "
                "consumed; exactly-once across segments is lost unless it keeps its own record",
                BUFFER_FLAG, cls.__qualname__)
    return cls(cfg, unused_handler)

