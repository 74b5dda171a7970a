"""`--engine-bind-host auto` (the default): where engine servers listen and what their URLs say.

Pins: auto binds 127.0.0.1 without Ray or on a one-node Ray cluster, and the engine's node address
(as Ray sees it) on more than one node, where the URL carries that address; 0.0.0.0 and explicit
addresses are kept. A run with auto is refused on a cluster of more than one node without
MILES_ENGINE_API_KEY, by validation given the cluster's shape and by the driver's check right after
it connects to Ray; with the token, or on one node, it passes.
Guards: engines bound to 127.0.0.1 on their node while the trainer or the rollout manager call them
from another node (refused connections on a real cluster).
"""

from __future__ import annotations

import sys
import types

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.driver import placement
from miles_core.engines.auth import TOKEN_ENV
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer, bind_address
from miles_core.prepare.checks import validate
from miles_core.prepare.resources import ClusterShape, Node

ONE_NODE = ClusterShape((Node("node 0", 4, 0),), "one node")
TWO_NODES = ClusterShape((Node("node 0", 4, 0), Node("node 1", 4, 0)), "two nodes")


def fake_ray(monkeypatch, alive: int, dead: int = 0, ip: str = "10.1.2.3"):
    nodes = [{"Alive": True}] * alive + [{"Alive": False}] * dead
    fake = types.SimpleNamespace(is_initialized=lambda: True, nodes=lambda: nodes,
                                 util=types.SimpleNamespace(get_node_ip_address=lambda: ip))
    monkeypatch.setitem(sys.modules, "ray", fake)


def test_auto_is_loopback_without_ray_and_on_one_node(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert bind_address("auto") == "127.0.0.1"
    fake_ray(monkeypatch, alive=1, dead=3)
    assert bind_address("auto") == "127.0.0.1"


def test_auto_is_the_node_address_on_more_than_one_node(monkeypatch, tmp_path):
    fake_ray(monkeypatch, alive=2)
    assert bind_address("auto") == "10.1.2.3"
    assert bind_address("0.0.0.0") == "0.0.0.0" and bind_address("127.0.0.1") == "127.0.0.1"
    fake_ray(monkeypatch, alive=1)
    server = EngineServer(EngineLaunchSpec("cpu", "/m", bind_host="auto"), log_dir=str(tmp_path))
    assert server.spec.bind_host == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")


def test_the_url_of_an_engine_on_a_multi_node_cluster_names_its_node(monkeypatch, tmp_path):
    """The server binds the node address (here this machine's loopback alias 127.0.0.2 stands in for
    it, so the port can be picked) and advertises the same address."""
    fake_ray(monkeypatch, alive=2, ip="127.0.0.2")
    server = EngineServer(EngineLaunchSpec("cpu", "/m", bind_host="auto"), log_dir=str(tmp_path))
    assert server.spec.bind_host == "127.0.0.2" and server.url.startswith("http://127.0.0.2:")


def test_validation_refuses_auto_on_more_than_one_node_without_the_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = parse_flags(["--preset", "tiny-reverse4"])
    assert cfg.engine.engine_bind_host == "auto"
    validate(cfg)  # the node count unknown: decided where it is known
    validate(cfg, cluster=ONE_NODE)
    with pytest.raises(ConfigError, match=rf"--engine-bind-host=auto on this 2-node cluster .*{TOKEN_ENV}"):
        validate(cfg, cluster=TWO_NODES)
    validate(parse_flags(["--preset", "tiny-reverse4", "--engine-bind-host", "127.0.0.1"]), cluster=TWO_NODES)
    monkeypatch.setenv(TOKEN_ENV, "t")
    validate(cfg, cluster=TWO_NODES)


def test_the_driver_refuses_auto_on_more_than_one_node_without_the_token(monkeypatch):
    """`check_fits` runs right after the driver connects to Ray, before any role starts."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setattr(placement, "cluster_shape", lambda: TWO_NODES)
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        placement.check_fits(parse_flags(["--preset", "tiny-reverse4"]))
    monkeypatch.setattr(placement, "cluster_shape", lambda: ONE_NODE)
    placement.check_fits(parse_flags(["--preset", "tiny-reverse4"]))
    monkeypatch.setattr(placement, "cluster_shape", lambda: TWO_NODES)
    monkeypatch.setenv(TOKEN_ENV, "t")
    placement.check_fits(parse_flags(["--preset", "tiny-reverse4"]))
