"""Weights leaving the trainer: snapshot export/fetch and the engine weight sync (docs/fully-async.md)."""
