"""The engine API token (miles_core.engines.auth; issue 16 item 7).

A real CPU engine process started by the launcher with `MILES_ENGINE_API_KEY` in its environment:
every endpoint answers 401 without the token or with a wrong one (SGLang's rule, Bearer or
x-api-key), and the project's own callers (the launcher's probes and weight loads, EngineClient's
generate and control calls) send it, so a run works end to end. A run bound beyond loopback without
a token is refused at validation; SGLang gets the token as `--api-key`, masked in the logged command.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from miles_core.config import parse_flags
from miles_core.config.tree import ConfigError
from miles_core.engines.auth import TOKEN_ENV, authorized, redact_command
from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer, server_command
from miles_core.models.builtin import materialize_checkpoint
from miles_core.prepare.checks import validate
from miles_core.weights.snapshot import MARKER

from tests.support.timeouts import COMMAND_SECONDS, ENGINE_START_SECONDS

TOKEN = "canary-engine-token-7f3a9c"
# Every route of the CPU engine (cpu_server.CpuEngineServer.app) with its method.
ROUTES = [("POST", "/generate"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
          ("POST", "/flush_cache"), ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
          ("POST", "/update_weights_from_distributed"), ("POST", "/destroy_weights_update_group"),
          ("POST", "/begin_weight_update"), ("POST", "/end_weight_update"), ("GET", "/get_model_info"),
          ("GET", "/model_info"), ("POST", "/abort_request"), ("GET", "/health"), ("GET", "/health_generate"),
          ("GET", "/no_such_route")]


@pytest.fixture(scope="module")
def guarded_engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_ENV, TOKEN)
    path = materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("auth") / "gpt"))
    server = EngineServer(EngineLaunchSpec("cpu", path, weight_version=1, startup_timeout_seconds=ENGINE_START_SECONDS))
    server.start()  # the launcher's /health probe passes only if it sends the token
    yield server, path
    server.stop()
    mp.undo()


async def _status(url: str, method: str, headers: dict) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json={}, headers=headers) as r:
            return r.status


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_endpoint_refuses_a_request_without_the_token(guarded_engine, method, path):
    server, _ = guarded_engine
    url = server.url + path
    assert asyncio.run(_status(url, method, {})) == 401
    assert asyncio.run(_status(url, method, {"Authorization": "Bearer wrong"})) == 401
    assert asyncio.run(_status(url, method, {"x-api-key": TOKEN + "x"})) == 401


def test_the_token_opens_the_endpoints(guarded_engine):
    server, _ = guarded_engine
    assert asyncio.run(_status(server.url + "/model_info", "GET", {"Authorization": f"Bearer {TOKEN}"})) == 200
    assert asyncio.run(_status(server.url + "/model_info", "GET", {"x-api-key": TOKEN})) == 200


def test_project_callers_send_the_token(guarded_engine, monkeypatch):
    server, path = guarded_engine
    monkeypatch.setenv(TOKEN_ENV, TOKEN)

    async def generate_and_pause():
        async with EngineClient([server.url]) as client:
            result = await client.generate([1, 2, 3, 4, 10], {"max_new_tokens": 3, "temperature": 0.0})
            await client.pause_generation("in_place")
            await client.continue_generation()
            return result

    result = asyncio.run(generate_and_pause())
    assert result.finish_reason != "abort" and len(result.output_ids) >= 1
    (Path(path) / MARKER).touch()  # a complete snapshot, as the trainer exports them
    server.load_weights(Path(path).as_uri(), 2)  # /update_weights_from_disk through the launcher's urllib path


def test_a_client_without_the_token_is_refused(guarded_engine, monkeypatch):
    server, _ = guarded_engine
    monkeypatch.delenv(TOKEN_ENV)

    async def generate():
        async with EngineClient([server.url]) as client:
            return await client.generate([1, 2, 3], {"max_new_tokens": 2})

    with pytest.raises(Exception, match="401"):
        asyncio.run(generate())


def test_binding_beyond_loopback_needs_a_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"--engine-bind-host=0.0.0.0 .*{TOKEN_ENV}"):
        validate(parse_flags(["--preset", "tiny-reverse4", "--engine-bind-host", "0.0.0.0"]))
    validate(parse_flags(["--preset", "tiny-reverse4", "--engine-bind-host", "127.0.0.1"]))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    validate(parse_flags(["--preset", "tiny-reverse4", "--engine-bind-host", "0.0.0.0"]))


def test_sglang_gets_the_token_as_api_key_and_the_log_masks_it(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cmd = server_command(EngineLaunchSpec("sglang", "/m"), "/m", 0, 30000)
    assert cmd[cmd.index("--api-key") + 1] == TOKEN
    assert TOKEN not in " ".join(redact_command(cmd)) and "--api-key ***" in " ".join(redact_command(cmd))


def test_authorized_follows_sglang():
    assert authorized({"Authorization": f"Bearer {TOKEN}"}, TOKEN)
    assert authorized({"Authorization": f"bearer {TOKEN}"}, TOKEN)
    assert authorized({"x-api-key": TOKEN}, TOKEN)
    assert not authorized({"Authorization": TOKEN}, TOKEN)
    assert not authorized({"Authorization": f"Basic {TOKEN}"}, TOKEN)
    assert not authorized({}, TOKEN)


def test_flyte_tasks_request_the_secret_as_the_token_variable():
    from flytekit import Secret

    from tasks.secrets import engine_secrets

    assert engine_secrets("") == []
    (secret,) = engine_secrets("miles:engine-api-key")
    assert (secret.group, secret.key, secret.env_var) == ("miles", "engine-api-key", TOKEN_ENV)
    assert secret.mount_requirement == Secret.MountType.ENV_VAR
    with pytest.raises(ValueError, match="group:key"):
        engine_secrets("just-a-key")


def test_the_train_task_requests_the_wandb_key_secret_when_registered_with_one():
    """MILES_WANDB_API_KEY_SECRET=group:key at registration: `train` requests it as WANDB_API_KEY."""
    import subprocess
    import sys

    code = ("from tasks.train import train; print(sorted((s.group, s.key, s.env_var) "
            "for s in train.security_context.secrets))")
    env = dict(os.environ, MILES_WANDB_API_KEY_SECRET="miles:wandb-key", MILES_ENGINE_API_KEY_SECRET="miles:engine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=COMMAND_SECONDS,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(sorted([("miles", "engine", TOKEN_ENV), ("miles", "wandb-key", "WANDB_API_KEY")]))
