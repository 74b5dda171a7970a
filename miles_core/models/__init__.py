"""Model checkpoints in HF format: the builtin tiny models and their tokenizer, and loading helpers."""
