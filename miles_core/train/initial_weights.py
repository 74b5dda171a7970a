"""Where a trainer's weights come from before its first step: miles' --ref-load and --load.

Order (as in miles): the run's own latest checkpoint (--save, which --load names by default)
wins; else, when --load names another location, the latest checkpoint there (weights, optimizer
state and RNG; the step counter, data cursor and buffer belong to a run root, so the new run
starts at step 0); else --ref-load (an HF directory or a checkpoint location); else
--hf-checkpoint. --ref-load is also the KL reference of --use-kl-loss. Every rank applies the
same sources to its own TP shard.
"""

from __future__ import annotations

import logging

from miles_core.storage import Store, normalize_uri
from miles_core.storage.node_local import localize
from miles_core.train.checkpoint import CheckpointError, CheckpointManager

log = logging.getLogger(__name__)


def apply_ref_load(trainer, ref_load: str) -> None:
    """Initial and reference weights from --ref-load (no-op when empty)."""
    if not ref_load:
        return
    store = Store(normalize_uri(ref_load))
    if store.exists("config.json"):
        trainer.load_hf_weights(localize(store.uri(), "models"))
        return
    manager = CheckpointManager(store)
    step = manager.latest_verified()
    if step is None:
        raise CheckpointError(f"--ref-load={ref_load!r} is neither an HF directory (no config.json) nor a "
                              "checkpoint location (no step_*/COMPLETE)")
    tensors, meta, _ = manager.read(step)
    trainer.load_model_state(tensors["model"], meta, reference=True)
    log.info("--ref-load: initial and reference weights from %s step %d", store.uri(), step)


def apply_load(trainer, load: str, own: Store | None) -> int | None:
    """A run without a checkpoint of its own starts from --load's latest checkpoint when --load
    names another location; returns that step (None: nothing loaded)."""
    if not load or (own is not None and Store(normalize_uri(load)).uri() == own.uri()):
        return None
    manager = CheckpointManager(Store(normalize_uri(load)))
    step = manager.latest_verified()
    if step is None:  # miles: an empty --load falls back to the reference weights
        log.warning("--load=%s holds no checkpoint; starting from --ref-load / --hf-checkpoint", load)
        return None
    manager.load(step, trainer)
    log.info("--load: weights and optimizer state from %s step %d (this run starts at step 0)", load, step)
    return step
