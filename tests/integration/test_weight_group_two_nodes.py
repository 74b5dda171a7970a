"""The weight-update group between two nodes that share no network but a veth pair (no Ray, no S3).

tests/support/two_nodes.py `start_network()`: the head here, the engine node in its own network
namespace (its own 127.0.0.1) with one test address on each side of the veth pair. This machine's
hostname resolves to 127.0.0.1, as on many machines, so torch's default gloo device would advertise
loopback to the other node.

Pins: a gloo group formed by `init_custom_process_group` between a process here (rank 0, the
rendezvous host) and one on the engine node forms and a broadcast lands, each side listening on the
address through which it reaches the rendezvous host (its veth address); the `distributed` weight
transport pushes to a real CPU engine server on the engine node, which then serves the pushed weights
(its greedy first token and log-prob equal a reference forward on them) and reports the new version.
Guard: with each side on torch's default device, the same group does not form (shown by hand when
this test was written: the engine side fails at once with "Connection refused, remote=[127.0.0.1]",
rank 0 at its timeout).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
import torch

from miles_core.engines.auth import TOKEN_ENV, auth_headers
from miles_core.engines.client import EngineClient
from miles_core.engines.model import CausalLM, read_safetensors
from miles_core.models.builtin import SEP_ID, materialize_checkpoint
from miles_core.weights.distributed import DistributedWeightTransport
from miles_core.weights.sync import WeightSync
from tests.support.timeouts import ENGINE_START_SECONDS, PROBE_SECONDS
from tests.support.two_nodes import TwoNodeCluster

TIMEOUT = 10  # seconds: the group's timeout; a broken group fails well within the test's bound
PROMPT = [1, 2, 3, 4, SEP_ID]
ENGINE_PORT = 30000  # the engine node's network is the test's own: nothing else listens there

PEER = """
import json, sys, torch
from datetime import timedelta
from miles_core.engines.weight_group import (broadcast_bucket, destroy_custom_process_group,
                                             init_custom_process_group, local_address_for)
host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {"address": local_address_for(host)}
try:
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}", world_size=2, rank=rank,
                                   timeout=timedelta(seconds=%d), group_name="miles-weights")
    t = torch.arange(6.0) if rank == 0 else torch.zeros(6)
    broadcast_bucket([t], pg)
    out["received"] = t.tolist()
    destroy_custom_process_group(pg)
except Exception as e:
    out["error"] = str(e)[:500]
print(json.dumps(out))
""" % TIMEOUT


@pytest.fixture()
def net():
    c = TwoNodeCluster({})
    try:
        yield c.start_network()
    finally:
        c.stop()
    assert c.leftovers() == []


def _finish(proc: subprocess.Popen, deadline: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": "still waiting at the test's deadline"}
    lines = out.decode(errors="replace").strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": f"no output (exit {proc.returncode})"}


def test_gloo_group_forms_across_two_networks(net):
    port = 47000 + net.port % 1000
    cmd = [sys.executable, "-c", PEER, net.head_ip, str(port)]
    master = subprocess.Popen([*cmd, "0"], stdout=subprocess.PIPE)
    peer = subprocess.Popen(net.engine_node_command([*cmd, "1"]), stdout=subprocess.PIPE)
    deadline = time.monotonic() + 3 * TIMEOUT
    results = [_finish(master, deadline), _finish(peer, deadline)]
    assert [r.get("received") for r in results] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 2, results
    assert [r["address"] for r in results] == [net.head_ip, net.engine_ip]


def _engine(net: TwoNodeCluster, model_dir: str, log_path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "miles_core.engines.cpu_server", "--model-path", model_dir,
           "--host", net.engine_ip, "--port", str(ENGINE_PORT), "--dist-timeout-seconds", str(TIMEOUT)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(net.engine_node_command(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_healthy(url: str, proc: subprocess.Popen, log_path, timeout: float = ENGINE_START_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/health", headers=auth_headers()),
                                   timeout=PROBE_SECONDS)
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the engine at {url} did not answer /health: {log_path.read_text()[-3000:]}")


async def _push_and_generate(transport: DistributedWeightTransport, url: str):
    async with EngineClient([url]) as client:
        sync = WeightSync([client], transport, pause_mode="retract")
        try:
            await sync.push(1, 1)
        finally:
            await transport.close()
        version = (await client.model_info(url))["weight_version"]
        out = await client.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True})
        return version, out


def _reference_first_token(model_dir: str) -> tuple[int, float]:
    model = CausalLM.load(model_dir)
    logits = model.prefill(model.new_cache(1, len(PROMPT)), 0, torch.tensor([PROMPT]), torch.tensor([len(PROMPT)]))
    logprobs = torch.log_softmax(logits[0], -1)
    token = int(logprobs.argmax())
    return token, float(logprobs[token])


def test_distributed_push_reaches_a_cpu_engine_on_the_other_node(net, tmp_path, monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv(TOKEN_ENV, token)  # an engine bound beyond loopback needs one
    served = materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path / "served"))
    pushed = materialize_checkpoint("builtin:tiny-gpt", 6, str(tmp_path / "pushed"))
    url = f"http://{net.engine_ip}:{ENGINE_PORT}"
    log_path = tmp_path / "engine.log"
    engine = _engine(net, served, log_path, {**net.env, TOKEN_ENV: token})
    try:
        _wait_healthy(url, engine, log_path)
        state = read_safetensors(pushed)
        transport = DistributedWeightTransport(lambda: state, [url], master_address=net.head_ip, backend="gloo",
                                               bucket_bytes=1 << 20, timeout_seconds=TIMEOUT)
        version, out = asyncio.run(_push_and_generate(transport, url))
    finally:
        engine.terminate()
        engine.wait(30)
    record = transport.history[-1]
    assert record["attempts"] == 1 and record["failures"] == [], (record, log_path.read_text()[-3000:])
    assert version == "1"
    token, logprob = _reference_first_token(pushed)
    assert out.output_ids == [token] and abs(out.output_logprobs[0] - logprob) < 1e-4
    assert _reference_first_token(served) != (token, logprob)  # the served weights did change
