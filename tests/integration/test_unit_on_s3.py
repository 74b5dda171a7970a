"""The unit tests written against any storage root, run here against a real S3 server (SeaweedFS).

tests/unit runs them on file:// only (it starts no servers); the same functions, collected again in
this module, get an S3 run root: a fresh prefix in the session's SeaweedFS bucket.
"""

from __future__ import annotations

import uuid

import pytest

from tests.unit.test_data import test_source_and_run_root_on_object_storage  # noqa: F401
from tests.unit.test_lease import (  # noqa: F401
    test_a_holder_whose_renewals_fail_is_fenced_before_its_lease_expires,
    test_of_many_contenders_exactly_one_wins_create_and_takeover,
    test_release_lets_the_next_writer_in_at_once,
    test_second_writer_is_refused_naming_the_holder,
    test_takeover_after_expiry_of_a_holder_that_stopped_renewing,
)
from tests.unit.test_metrics_sink import test_round_trip  # noqa: F401
from tests.unit.test_report import test_report_from_object_storage  # noqa: F401


@pytest.fixture(params=["s3"])
def storage_root(request, s3_bucket):
    return f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}"
