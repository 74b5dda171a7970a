"""Engines as Ray actors (miles_core.engines.launcher.EngineFleet) on a local Ray instance.

Pins: the fleet starts N CPU engine servers and exposes healthy URLs; when an engine process is
killed, requests in flight on it come back aborted, its actor restarts it on the same URL with the
newest weights it was told about (`note_weights`), and the restart count shows it; shutdown stops
every process. Also pins the SGLang command line built from the config (real code, not runnable here).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from miles_core.config.sections import EngineSection
from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import EngineFleet, EngineLaunchSpec, server_command, server_env
from miles_core.models.builtin import materialize_checkpoint
from miles_core.storage import COMPLETE_MARKER

from tests.support.timeouts import ENGINE_START_SECONDS, HTTP_SECONDS

PROMPT = [1, 2, 3, 4, 10]


def test_a_port_answering_something_else_is_not_healthy():
    """Pins: a listener on the engine's port that answers with no HTTP status line (another process took
    the port) reads as not healthy, so the start goes on waiting or picks another port. Guards: the
    start failing with http.client.BadStatusLine, as CI saw once when a port collided."""
    import socket
    import threading

    from miles_core.engines.launcher import _alive, _healthy

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    served = threading.Event()

    def garbage():
        while not served.is_set():
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x01 not http at all\r\n\r\n")

    threading.Thread(target=garbage, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        assert _healthy(url, timeout=HTTP_SECONDS) is False and _alive(url, timeout=HTTP_SECONDS) is False
    finally:
        served.set()
        listener.close()


def test_sglang_command_from_config():
    """--engine-backend sglang launches `python -m sglang.launch_server` with model path, host, port,
    tp size, memory fraction, max running requests, the weight version, --disable-radix-cache and
    --incremental-streaming-output (once) and --sglang-extra-args, and asks SGLang for temperature-1
    log-probs."""
    eng = EngineSection(engine_backend="sglang", rollout_num_gpus_per_engine=2, sglang_mem_fraction_static=0.7,
                        sglang_extra_args="--context-length 4096 --log-level warning")
    spec = EngineLaunchSpec.from_config(eng, "/ckpt/qwen", weight_version=3)
    cmd = server_command(spec, spec.model_path, 3, 31000)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    args = cmd[3:]
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--model-path"] == "/ckpt/qwen" and pairs["--host"] == "127.0.0.1" and pairs["--port"] == "31000"
    assert pairs["--tp-size"] == "2" and pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--weight-version"] == "3" and pairs["--max-running-requests"] == "512"
    assert args[-4:] == ["--context-length", "4096", "--log-level", "warning"]
    assert server_env(spec)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    # RL engines: no prefix cache across weight updates, incremental stream chunks (docs/engines.md)
    assert "--disable-radix-cache" in args and "--incremental-streaming-output" in args
    again = EngineLaunchSpec.from_config(EngineSection(engine_backend="sglang", sglang_extra_args="--disable-radix-cache"),
                                         "/ckpt/qwen")
    assert server_command(again, again.model_path, 0, 1).count("--disable-radix-cache") == 1


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-fleet")
    v1 = materialize_checkpoint("builtin:tiny-gpt", 1, str(root / "v1"))
    v2 = materialize_checkpoint("builtin:tiny-gpt", 2, str(root / "v2"))
    (root / "v2" / COMPLETE_MARKER).touch()  # a snapshot the fleet loads is whole
    return v1, v2


@pytest.mark.slow  # Ray start-up plus three engine processes: about a minute on two busy cores
def test_fleet_restarts_a_killed_engine(ray_local, ckpts):
    """Kill -9 one engine of a fleet of 2 while requests are in flight on it: they return aborted,
    the actor restarts the process (restart count 1, new pid, same URL, the noted weights and version),
    and the other engine is untouched."""
    v1, v2 = ckpts
    spec = EngineLaunchSpec("cpu", f"file://{v1}", weight_version=1, startup_timeout_seconds=ENGINE_START_SECONDS,
                            health_interval_seconds=0.2)
    with EngineFleet(spec, 2, num_cpus_per_engine=0.5) as fleet:
        urls = fleet.urls()
        pids = fleet.pids()
        assert len(set(urls)) == 2 and fleet.restart_counts() == [0, 0]

        async def go():
            async with EngineClient(urls) as c:
                assert all((await c.health_all()).values())
                await asyncio.to_thread(fleet.load_weights, f"file://{v2}", 2)  # loads and notes them
                await c.pause_generation("in_place")
                tasks = [asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 4}, url=urls[0]))
                         for _ in range(3)]
                await asyncio.sleep(0.3)
                os.kill(pids[0], signal.SIGKILL)
                aborted = await asyncio.gather(*tasks)
                deadline = time.monotonic() + 90
                while fleet.restart_counts()[0] < 1:
                    assert time.monotonic() < deadline, "the actor did not restart the engine"
                    await asyncio.sleep(0.2)
                await c.continue_generation()
                return aborted, await c.get_weight_version(), await c.generate(PROMPT, {"max_new_tokens": 2},
                                                                                url=urls[0])

        aborted, versions, after = asyncio.run(go())
        assert all(r.finish_reason == "abort" for r in aborted)
        assert fleet.restart_counts() == [1, 0]
        new_pids = fleet.pids()
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
        assert fleet.urls() == urls
        assert versions == {urls[0]: 2, urls[1]: 2}  # restarted with the noted weights
        assert not after.aborted
    for pid in new_pids:  # shutdown stopped every process
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
