"""The Flyte secret that carries the engine API token (miles_core.engines.auth).

`MILES_ENGINE_API_KEY_SECRET=group:key` at registration makes every task that validates a run config
request that secret, mounted as the environment variable `MILES_ENGINE_API_KEY`; unset, no task
requests a secret (a loopback-bound run needs none). Flyte injects it into the task's pods; the
Ray plugin's head and worker pods of `train` get it from the same request.
"""

from __future__ import annotations

import os

from flytekit import Secret

from miles_core.engines.auth import TOKEN_ENV

SECRET_ENV = "MILES_ENGINE_API_KEY_SECRET"


def engine_secrets(spec: str | None = None) -> list[Secret]:
    """[] or the one secret named by `group:key` (default: $MILES_ENGINE_API_KEY_SECRET)."""
    spec = os.environ.get(SECRET_ENV, "") if spec is None else spec
    if not spec:
        return []
    group, sep, key = spec.partition(":")
    if not (sep and group and key):
        raise ValueError(f"{SECRET_ENV}={spec!r}: expected group:key (a Flyte secret)")
    return [Secret(group=group, key=key, mount_requirement=Secret.MountType.ENV_VAR, env_var=TOKEN_ENV)]


ENGINE_SECRETS = engine_secrets()
