"""The run's config as the run root records it (`config.json`, one per resumed segment), read back
as a RunConfig. The layout of those files is `miles_core.storage.run_root`'s."""

from __future__ import annotations

from miles_core.config.tree import RunConfig, config_from_dict
from miles_core.storage import Store
from miles_core.storage.run_root import read_config


def read_run_config(store: Store, segment: int | None = None) -> RunConfig | None:
    """The config of `segment` (default: the latest segment with one) as a RunConfig; None when absent."""
    d = read_config(store, segment)
    return None if d is None else config_from_dict(d)
