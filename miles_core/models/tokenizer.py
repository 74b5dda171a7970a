"""The tokenizer of a model URI: the digit tokenizer of the builtin models, else the HF
tokenizer files of the directory (copied to this node first, like the weights)."""

from __future__ import annotations

import functools

from miles_core.models.builtin import digit_tokenizer
from miles_core.storage.node_local import localize


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str):
    """A transformers tokenizer for `model`: a `builtin:*` name, or an HF directory URI or path."""
    if model.startswith("builtin:"):
        return digit_tokenizer()
    from transformers import AutoTokenizer

    path = localize(model, "models") if "://" in model else model
    return AutoTokenizer.from_pretrained(path)
