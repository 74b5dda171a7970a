"""Weights leaving the trainer: snapshot export/fetch and the engine weight sync (DESIGN §5.4)."""
