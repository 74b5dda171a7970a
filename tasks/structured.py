"""A pyarrow StructuredDataset decoder that reads through the right filesystem (flyte#5859).

flytekit's ParquetToArrowDecodingHandler strips the protocol and calls `pq.read_table(path)`
without a filesystem, so `s3://bucket/x` is looked up as the local path `bucket/x` and fails
with FileNotFoundError. This decoder hands pyarrow the fsspec filesystem flytekit itself uses
for the URI (credentials and endpoint from the Flyte data config). Registered for every
protocol, overriding the built-in one; imported once by `tasks/__init__.py`.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import strip_protocol
from flytekit import FlyteContext
from flytekit.models import literals
from flytekit.models.literals import StructuredDatasetMetadata
from flytekit.types.structured.structured_dataset import (
    PARQUET,
    StructuredDatasetDecoder,
    StructuredDatasetTransformerEngine,
)


class FsspecParquetToArrowDecoder(StructuredDatasetDecoder):
    def __init__(self):
        super().__init__(pa.Table, None, PARQUET)

    def decode(self, ctx: FlyteContext, flyte_value: literals.StructuredDataset,
               current_task_metadata: StructuredDatasetMetadata) -> pa.Table:
        uri = flyte_value.uri
        columns = None
        sd_type = current_task_metadata.structured_dataset_type
        if sd_type and sd_type.columns:
            columns = [c.name for c in sd_type.columns]
        fs = ctx.file_access.get_filesystem_for_path(uri)
        return pq.read_table(strip_protocol(uri), filesystem=fs, columns=columns)


_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    # protocol=None registers the generic ("fsspec") entry, where flytekit's own Arrow decoder
    # lives; override replaces it (flytekit's later lazy registration skips a duplicate).
    StructuredDatasetTransformerEngine.register(FsspecParquetToArrowDecoder(), override=True)
    _REGISTERED = True


register()
