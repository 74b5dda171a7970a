"""Which address a gloo weight-update group listens on (miles_core.engines.weight_group).

Pins: the local address is the source address of the route to the rendezvous host (127.0.0.1 for a
loopback rendezvous: the one-machine default stays on loopback), None for a host that does not
resolve; the rendezvous host is read from `tcp://` or `env://` (MASTER_ADDR); a gloo group gets the
address-bound backend unless GLOO_SOCKET_IFNAME is set or no address is known (plain gloo, torch's
default device). Across two networks: tests/integration/test_weight_group_two_nodes.py.
"""

from __future__ import annotations

from miles_core.engines.weight_group import GLOO_AT_ADDRESS, _gloo_device, local_address_for, rendezvous_host


def test_local_address_is_the_routes_source_address():
    assert local_address_for("127.0.0.1") == "127.0.0.1"
    assert local_address_for("no-such-host.invalid") is None


def test_rendezvous_host(monkeypatch):
    assert rendezvous_host("tcp://10.1.2.3:29500") == "10.1.2.3"
    assert rendezvous_host("tcp://[fd00::1]:29500") == "fd00::1"
    monkeypatch.setenv("MASTER_ADDR", "10.9.8.7")
    assert rendezvous_host("env://") == "10.9.8.7"
    assert rendezvous_host("file:///tmp/rendezvous") is None


def test_gloo_binds_the_address_unless_the_interface_is_named(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert _gloo_device("tcp://127.0.0.1:29500", None) == (GLOO_AT_ADDRESS, "127.0.0.1")
    assert _gloo_device("tcp://no-such-host.invalid:29500", None) == ("gloo", None)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert _gloo_device("tcp://127.0.0.1:29500", None) == ("gloo", None)
