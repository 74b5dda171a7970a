"""The tasks that render a Deck show their page, inputs, outputs and timeline, and never run
flytekit's Dependencies deck (a `pip freeze` subprocess in every execution)."""

from __future__ import annotations

from flytekit.deck import DeckField

from tasks.eval import backfill_table
from tasks.report import report


def test_deck_tasks_render_no_dependencies_deck():
    for t in (report, backfill_table):
        assert t.enable_deck
        assert DeckField.DEPENDENCIES not in t._deck_fields and DeckField.TIMELINE in t._deck_fields, t.name
