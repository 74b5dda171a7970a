"""Flyte task definitions: thin typed wrappers around miles_core (docs/deployment.md).

Importing this package registers the filesystem-aware Arrow StructuredDataset decoder once
(`tasks.structured`), so every task module gets it.
"""

from tasks import structured as _structured  # noqa: F401 - registers the decoder
