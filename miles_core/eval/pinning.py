"""Pin eval engines to one snapshot and prove it (docs/evaluation.md, Mode 2 and the eval follower).

Pinning = every engine loads the snapshot from disk and reports the pinned weight version; the
version is then read back from every engine, and a mismatch is a `pin_violation`. An eval also
checks the version each response reports, so an engine that was swapped underneath the eval
(restarted on other weights, or joined by a training weight push) cannot produce a silent,
wrongly attributed point.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from miles_core.engines.client import EngineControlError


class EvalSkip(Exception):
    """An eval that did not happen, with the `eval/skipped_{reason}` reason. Message-only constructor."""

    def __init__(self, message: str, reason: str = "crashed"):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # keep the reason across Ray/pickle boundaries
        return (EvalSkip, (str(self), self.reason))


class PinnableClient(Protocol):
    async def health_all(self) -> dict[str, bool]: ...
    async def update_weights_from_disk(self, model_path: str, weight_version: int, *, flush_cache: bool = False,
                                       abort_all_requests: bool = False) -> None: ...
    async def get_weight_version(self) -> dict[str, int | None]: ...


async def check_health(client: PinnableClient) -> None:
    health = await client.health_all()
    down = sorted(u for u, ok in health.items() if not ok)
    if down:
        raise EvalSkip(f"eval engine(s) not healthy: {', '.join(down)}", "unhealthy")


async def pin(client: PinnableClient, model_path: str, version: int) -> None:
    """Load `model_path` on every engine as `version`; raise EvalSkip(pin_violation|unhealthy)."""
    await check_health(client)
    try:
        await client.update_weights_from_disk(model_path, version, flush_cache=True)
        got = await client.get_weight_version()
    except EngineControlError as e:
        raise EvalSkip(f"could not load {model_path} on the eval engines: {e}", "unhealthy") from e
    verify_versions(got, version)


async def pin_by(load, client: PinnableClient, uri: str, version: int) -> None:
    """Like `pin`, with `load(uri, version)` doing the loading (each engine's actor copies the
    snapshot to its own node: EngineFleet.load_weights); raise EvalSkip(pin_violation|unhealthy)."""
    await check_health(client)
    try:
        await asyncio.to_thread(load, uri, version, True)
        got = await client.get_weight_version()
    except (EngineControlError, RuntimeError) as e:
        raise EvalSkip(f"could not load {uri} on the eval engines: {e}", "unhealthy") from e
    verify_versions(got, version)


def verify_versions(got: dict[str, int | None], version: int) -> None:
    bad = {u: v for u, v in got.items() if v != version}
    if bad:
        raise EvalSkip(f"eval engines pinned to version {version} report {bad}", "pin_violation")
