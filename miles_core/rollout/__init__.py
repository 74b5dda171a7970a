"""The rollout side (docs/fully-async.md): what is generated, when, and how it reaches the trainer.

- `data_source`: the prompt order with a durable cursor and the recycle queue;
- `admission`: the submission budget (group / sample granularity) and staleness admission;
- `rewards`: built-in rewards, the `--custom-rm-path` slot, failure-safe scoring;
- `producer`: the continuous generation loop (pause, stop, worker-error slot);
- `feed_record`: the record producer jobs read (`producers/FEED.json`);
- `drain`: exactly one training batch from the buffer (and the sync / one-step-off batch path);
- `batch_metrics`: the rollout metrics of a consumed batch (their names: miles_core.metrics.names);
- `manager`: all of the above in one object, runnable as a Ray actor;
- `builtin_tasks`: the builtin verifiable tasks of the embedded default;
- `episodes`: the `--custom-generate-function-path` slot (agentic multi-turn episodes, docs/agentic.md);
- `multiturn`: the builtin two-turn environment; `calculator_tool`: a tool environment for a chat model.

Importing this package imports nothing else; import the submodules you need.
"""
