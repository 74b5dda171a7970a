"""A run's lineage: what a run root holds, where a group came from and went, and beyond the run's own
segments: fork a run into a new one, replay its recorded groups.

    miles fork RUN_URI --at-step K --new-run ID [FLAGS...]     # miles_core.lineage.fork
    miles replay RUN_URI [--steps N] [--from-step K] [FLAGS...] # miles_core.lineage.replay
    miles runs show RUN_URI                                     # miles_core.lineage.show
    miles runs list STORAGE_ROOT                                # miles_core.lineage.listing
    miles lineage RUN_URI GROUP_ID                              # miles_core.lineage.group_lineage

All of them read a run root through `recorded.RecordedRun` and never write into the source run's own
data: a fork is a new run root (docs/deployment.md), a replay writes under `replays/{id}/` (or `--out`).
`command.flags_of(cfg)` turns a config back into the miles command line that reproduces it.
"""
