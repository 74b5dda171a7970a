"""The Flyte secrets a run's tasks request: the engine API token (miles_core.engines.auth) and the
W&B key (--use-wandb, miles_core.metrics.mirrors).

At registration, `MILES_ENGINE_API_KEY_SECRET=group:key` makes every task that validates a run config
request that secret, mounted as the environment variable `MILES_ENGINE_API_KEY`, and
`MILES_WANDB_API_KEY_SECRET=group:key` makes the training task request that one, mounted as
`WANDB_API_KEY` (W&B reads it there; nothing of ours does). Unset, no secret is requested (a
loopback-bound run needs no token; W&B offline needs no key). Flyte injects them into the task's
pods; the Ray plugin's head and worker pods of `train` get them from the same request.
"""

from __future__ import annotations

import os

from flytekit import Secret

from miles_core.engines.auth import TOKEN_ENV

SECRET_ENV = "MILES_ENGINE_API_KEY_SECRET"
WANDB_SECRET_ENV = "MILES_WANDB_API_KEY_SECRET"
WANDB_KEY_ENV = "WANDB_API_KEY"


def env_secret(spec: str, env_var: str, names: str) -> list[Secret]:
    """[] or the one secret named by `group:key`, mounted as `env_var`; `names` is the setting it came from."""
    if not spec:
        return []
    group, sep, key = spec.partition(":")
    if not (sep and group and key):
        raise ValueError(f"{names}={spec!r}: expected group:key (a Flyte secret)")
    return [Secret(group=group, key=key, mount_requirement=Secret.MountType.ENV_VAR, env_var=env_var)]


def engine_secrets(spec: str | None = None) -> list[Secret]:
    """The engine token's secret (default spec: $MILES_ENGINE_API_KEY_SECRET)."""
    return env_secret(os.environ.get(SECRET_ENV, "") if spec is None else spec, TOKEN_ENV, SECRET_ENV)


def wandb_secrets(spec: str | None = None) -> list[Secret]:
    """The W&B key's secret (default spec: $MILES_WANDB_API_KEY_SECRET)."""
    return env_secret(os.environ.get(WANDB_SECRET_ENV, "") if spec is None else spec, WANDB_KEY_ENV, WANDB_SECRET_ENV)


ENGINE_SECRETS = engine_secrets()
TRAIN_SECRETS = ENGINE_SECRETS + wandb_secrets()
