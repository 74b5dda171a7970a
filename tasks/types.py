"""Typed values passed between tasks (flytekit serializes dataclasses field by field, no pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from flytekit.deck import DeckField

# The decks of the tasks that render one (report, eval backfill): their own page, inputs, outputs and
# timeline. Not flytekit's default Dependencies deck (a `pip freeze` subprocess in every execution)
# nor the task's source code.
DECK_FIELDS = (DeckField.INPUT, DeckField.OUTPUT, DeckField.TIMELINE)


@dataclass
class PreparedData:
    """The normalized prompt dataset in the run root (miles_core.prepare.dataset.DatasetInfo)."""

    uri: str = ""
    content_hash: str = ""
    num_rows: int = 0
    source: str = ""


@dataclass
class TrainOutcome:
    """How a train segment ended, read back from the run root's STATUS.json."""

    run_uri: str = ""
    state: str = ""  # running | segment_done | finished | failed (miles_core.storage.run_root)
    last_step: int = -1
    segment: int = 0


@dataclass
class EvalJob:
    """One snapshot x dataset of an eval backfill."""

    run_uri: str = ""
    step: int = 0
    dataset: str = ""
    dataset_uri: str = ""
    n_samples: int = 1
    temperature: float = 0.0
    max_response_len: int = 0  # 0: the run's --eval-max-response-len / --rollout-max-response-len


@dataclass
class EvalPoint:
    step: int = 0
    dataset: str = ""
    metrics: Dict[str, float] = field(default_factory=dict)
