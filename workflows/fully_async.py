"""fully_async_rl: plan, import_model -> prepare_data -> (train || eval_follower) -> report (docs/deployment.md).

    pyflyte run workflows/fully_async.py fully_async_rl --flags "--preset tiny-reverse4"   # the embedded default (CPU)
    pyflyte run workflows/fully_async.py fully_async_rl --flags "--preset tiny-reverse4 --rollout-batch-size 16"
    pyflyte run --remote workflows/fully_async.py fully_async_rl \\
        --storage_root s3://bucket/miles --run_id qwen-math \\
        --flags "--hf-checkpoint s3://... --prompt-data s3://... --rollout-batch-size 32 --n-samples-per-prompt 8 \\
                 --num-rollout 200 --engine-backend sglang"

`flags` is the miles command line (every flag of `miles validate --help`); `run_id`,
`storage_root` and `segment_steps` are typed shortcuts ("" / 0: as in flags or the default).
Locally the tasks run one after another (train, then the follower evaluates what it left);
on a cluster train and eval_follower run side by side. `plan` runs first locally and prints what the
execution will do (or that the run already finished, and how to continue it); nothing waits for it.
"""

from __future__ import annotations

from flytekit import workflow
from flytekit.types.file import HTMLPage

from tasks.data import data_fingerprint, prepare_data
from tasks.eval import eval_follower_sized
from tasks.model import import_model, model_fingerprint
from tasks.plan import plan
from tasks.report import report
from tasks.train import train


@workflow
def fully_async_rl(flags: str = "", run_id: str = "", storage_root: str = "", segment_steps: int = 0) -> HTMLPage:
    """Fully asynchronous RL post-training of an LLM; returns the run report (HTML).

    :param flags: miles flags: --hf-checkpoint, --prompt-data, --rollout-batch-size and --num-rollout, or a --preset that sets them (./dev run: "--preset tiny-reverse4"), then any others
    :param run_id: run id; the run root is {storage_root}/runs/{run_id} ("" : --run-id from flags, else "default")
    :param storage_root: object-storage prefix of runs, e.g. s3://bucket/miles ("" : --storage-root from flags, else ./.miles)
    :param segment_steps: train at most this many steps in this execution, then checkpoint and exit (0: to --num-rollout)
    """
    plan(flags=flags, run_id=run_id, storage_root=storage_root, segment_steps=segment_steps)  # the first lines
    model = import_model(flags=flags, run_id=run_id, storage_root=storage_root,
                         fingerprint=model_fingerprint(flags=flags, run_id=run_id, storage_root=storage_root))
    fingerprint = data_fingerprint(flags=flags, run_id=run_id, storage_root=storage_root)
    model >> fingerprint  # the tokenizer of text prompts comes from the imported model
    data = prepare_data(flags=flags, run_id=run_id, storage_root=storage_root, fingerprint=fingerprint)
    outcome = train(flags=flags, run_id=run_id, storage_root=storage_root, segment_steps=segment_steps)
    follower = eval_follower_sized(flags=flags, run_id=run_id, storage_root=storage_root)
    data >> outcome
    data >> follower
    page = report(outcome=outcome)
    follower >> page
    return page
