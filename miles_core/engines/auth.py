"""The engine API token: who may call an engine server (docs/engines.md).

An engine bound to loopback is reachable only from its own node. Bound beyond loopback (its node's
address, which `--engine-bind-host auto` picks on a multi-node cluster, or 0.0.0.0) anyone on the
network could generate, pause, abort or load weights, so validation then requires a token. `auto`
is decided by the cluster's node count, so it is checked where that is known: against the cluster's
shape (the driver, right after it connects to Ray; the Flyte tasks, against the train cluster).
The token is read from the environment variable `MILES_ENGINE_API_KEY` of every process that starts
or calls an engine; on Flyte it comes from a secret (`MILES_ENGINE_API_KEY_SECRET=group:key` at
registration, see docs/deployment.md). It never travels in flags, configs, Ray task arguments or logs.

The rule is SGLang's (`python/sglang/srt/utils/auth.py`, `decide_request_auth`): a request carries
`Authorization: Bearer <token>` or `x-api-key: <token>`, compared in constant time; otherwise 401.
SGLang's server takes the token as `--api-key` and exempts /health, /ready and /metrics; the CPU
engine checks every endpoint, /health included (the launcher's probes send the token).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from typing import Mapping

TOKEN_ENV = "MILES_ENGINE_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
AUTO = "auto"  # --engine-bind-host: loopback on a one-node cluster, else the engine's node address


def engine_token() -> str | None:
    """The token of this process's environment (an empty value counts as unset)."""
    return os.environ.get(TOKEN_ENV) or None


def auth_headers() -> dict[str, str]:
    """Headers every request to an engine carries ({} without a token)."""
    token = engine_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(headers: Mapping[str, str], token: str) -> bool:
    """SGLang's check: `Authorization: Bearer <token>` or `x-api-key: <token>`, constant-time."""
    scheme, _, value = (headers.get("Authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(value.encode(), token.encode()):
        return True
    api_key = headers.get("x-api-key")
    return bool(api_key) and secrets.compare_digest(api_key.encode(), token.encode())


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_problem(bind_host: str, nodes: int | None = None) -> str | None:
    """Validation: an engine bound beyond loopback without a token is refused, naming both. `auto` binds
    beyond loopback only on a cluster of more than one node: with `nodes` unknown it passes here."""
    if is_loopback(bind_host) or engine_token():
        return None
    if bind_host == AUTO:
        if nodes is None or nodes <= 1:
            return None
        return (f"--engine-bind-host={AUTO} on this {nodes}-node cluster binds each engine server to its node's "
                f"address, reachable from the other nodes; set the API token in {TOKEN_ENV} on every node "
                f"(on Flyte: a secret, MILES_ENGINE_API_KEY_SECRET=group:key; docs/deployment.md).")
    return (f"--engine-bind-host={bind_host} exposes the engine servers beyond this node; set the API token "
            f"in {TOKEN_ENV} (on Flyte: a secret, MILES_ENGINE_API_KEY_SECRET=group:key; docs/deployment.md), "
            f"or bind 127.0.0.1.")


def redact_command(cmd: list[str]) -> list[str]:
    """A command line fit for a log: the value after `--api-key` masked."""
    return [("***" if i and cmd[i - 1] == "--api-key" else a) for i, a in enumerate(cmd)]
