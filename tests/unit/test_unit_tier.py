"""The unit tier's rule (tests/unit/conftest.py) refuses what would make a unit test an integration
test: a subprocess, another process, a server socket, Ray."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess

import pytest

# the rule raises conftest.UnitTierViolation, an AssertionError naming the rule
UnitTierViolation = AssertionError


def test_a_subprocess_is_refused_naming_the_rule():
    with pytest.raises(UnitTierViolation, match="tests/unit is one process.*tests/integration"):
        subprocess.run(["true"], check=True)


def test_another_process_is_refused():
    with pytest.raises(UnitTierViolation):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_listening_socket_is_refused_and_a_client_socket_is_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with pytest.raises(UnitTierViolation, match="a server"):
            s.listen()


def test_ray_is_refused():
    import ray

    with pytest.raises(UnitTierViolation, match="ray.init"):
        ray.init(num_cpus=1)


def test_the_s3_server_fixture_is_refused(request):
    with pytest.raises(UnitTierViolation, match="S3 server"):
        request.getfixturevalue("seaweed")
