"""miles-flyte: fully asynchronous RL post-training for LLMs. This package never imports flytekit.

The package is layered; a part imports only from its own layer or the layers below it, and no two
parts import each other (docs/architecture.md; tests/unit/test_layering.py keeps it so). `LAYERS`
lists them from the ground up.
"""

__version__ = "0.1.0"

# (layer, its parts at the root of the package, what the layer owns), from the ground up.
LAYERS = (
    ("ground", ("storage", "failures", "samples", "rank_batches"),
     "object storage (atomic writes, retries, conditional writes), the run root's layout, STATUS and "
     "lease, node-local copies; which failures a retry can fix and the chaos crash points; the "
     "sample and group records with their Arrow schema, and a rollout cut into the trainer's "
     "data-parallel parts"),
    ("config", ("config",),
     "one typed config as plain data: sections, flags, presets, the config's own rules, the plug-in "
     "catalogue and loader, the config record in the run root"),
    ("models", ("models",),
     "model formats: what --hf-checkpoint names and where it lives, the builtin tiny models, "
     "tokenizers, safetensors directories"),
    ("metrics", ("metrics",),
     "metric names, the metric sinks in the run root, mirrors (TensorBoard, W&B) and the HTML report"),
    ("roles", ("engines", "weights", "buffer", "train", "rollout"),
     "the roles of a run: engines (client, CPU server, launcher), weights (snapshots, store and "
     "distributed pushes), the durable buffer, the Megatron trainer, the rollout producer and rewards"),
    ("prepare", ("prepare",),
     "what a run needs before any role starts: the prompt dataset, an imported model, the initial "
     "model, and the checks that load plug-ins and read model specs"),
    ("eval", ("eval",),
     "evaluation of snapshots: the modes, the in-run scheduler, the follower and backfills"),
    ("driver", ("driver",),
     "one training segment: placement of the roles on Ray, the roles wired into the loop, the loop"),
    ("elastic", ("elastic",),
     "producer jobs: engines in another cluster that join a running run through its run root alone"),
    ("lineage", ("lineage",),
     "what a run root holds and where a group came from and went; fork and replay"),
    ("cli", ("cli",),
     "the `miles` command and the generated references"),
)
