"""Scheduled continuation of a run lineage (docs/deployment.md).

`fully_async_rl_nightly` runs `fully_async_rl` on a cron schedule with a fixed run id and a
segment length: each execution resumes the run from its latest complete checkpoint (trainer,
data-source cursor, buffer index), trains `segment_steps` more steps, checkpoints and exits.
The run id, storage root, schedule and segment length are read once, at registration, from
MILES_SCHEDULE_* variables (docs/deployment.md); activate the plan after registering it.
"""

from __future__ import annotations

import os

from flytekit import CronSchedule, LaunchPlan

from workflows.fully_async import fully_async_rl

SCHEDULE_CRON = os.environ.get("MILES_SCHEDULE_CRON", "0 2 * * *")
SCHEDULE_RUN_ID = os.environ.get("MILES_SCHEDULE_RUN_ID", "nightly")
SCHEDULE_STORAGE_ROOT = os.environ.get("MILES_SCHEDULE_STORAGE_ROOT", "s3://miles-flyte/runs-root")
SCHEDULE_SEGMENT_STEPS = int(os.environ.get("MILES_SCHEDULE_SEGMENT_STEPS", "200"))
SCHEDULE_FLAGS = os.environ.get("MILES_SCHEDULE_FLAGS", "")

fully_async_rl_nightly = LaunchPlan.get_or_create(
    workflow=fully_async_rl,
    name="fully_async_rl_nightly",
    schedule=CronSchedule(schedule=SCHEDULE_CRON),
    # Fixed: a lineage is one run id in one place, advanced one segment per execution.
    fixed_inputs={"run_id": SCHEDULE_RUN_ID, "storage_root": SCHEDULE_STORAGE_ROOT,
                  "segment_steps": SCHEDULE_SEGMENT_STEPS},
    default_inputs={"flags": SCHEDULE_FLAGS},
)
