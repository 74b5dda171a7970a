"""miles-flyte: fully asynchronous RL post-training for LLMs. This package never imports flytekit."""

__version__ = "0.1.0"
