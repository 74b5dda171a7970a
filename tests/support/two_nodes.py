"""A two-node Ray cluster on one machine whose nodes share nothing local (DESIGN §15).

The head node (the driver and the trainer: resource `head_node`) runs as usual. The second node
(the engines: resource `engine_node`) runs `ray start` inside its own mount namespace
(`unshare -m`, private propagation) with fresh tmpfs mounts over every local directory the head
side writes: /tmp (the head's Ray temp dir, pytest's temp dirs, the head's node cache under
them) and ~/.cache (default node caches). Both nodes share the network namespace, so 127.0.0.1
reaches the head and the engines; the run root must be on object storage (SeaweedFS S3). Needs
root; without `unshare` the cluster refuses to start (tests fail loudly, never skip).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
ROOT = Path(__file__).resolve().parents[2]  # the checkout: its code and .venv must stay visible on both nodes
PRIVATE_DIRS = ("/tmp", os.path.expanduser("~/.cache"))


class TwoNodeError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodeCluster:
    def __init__(self, env: dict[str, str], head_cpus: int = 2, engine_cpus: int = 1):
        if shutil.which("unshare") is None or os.geteuid() != 0:
            raise TwoNodeError("the two-node cluster needs `unshare -m` as root (util-linux); it is not available")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, **env, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
        self.head_temp = f"/tmp/ray-head-{self.port}"
        self.head_cpus, self.engine_cpus = head_cpus, engine_cpus
        self.worker: subprocess.Popen | None = None
        self.stash: str | None = None

    def start(self) -> "TwoNodeCluster":
        """Start both nodes; on failure whatever started is stopped before the error propagates."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self._run([RAY, "start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1",
                   f"--num-cpus={self.head_cpus}", "--resources", json.dumps({"head_node": 1}),
                   f"--temp-dir={self.head_temp}", "--include-dashboard=false", "--disable-usage-stats"])
        mounts = self._private_mounts()
        worker = (f"{mounts} && exec {RAY} start --address={self.address} --node-ip-address=127.0.0.1 "
                  f"--num-cpus={self.engine_cpus} --resources='{json.dumps({'engine_node': 1})}' "
                  f"--temp-dir=/tmp/ray-engine-{self.port} --disable-usage-stats --block")
        self.worker = subprocess.Popen(["unshare", "-m", "--propagation", "private", "bash", "-c", worker],
                                       env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._wait_for_engine_node()

    def _private_mounts(self) -> str:
        """Shell commands: a tmpfs over each private dir; the checkout (code and venv) stays visible
        even when it lives under one of them (a CI clone in /tmp): it is bind-mounted aside first and
        back afterwards."""
        keep = [str(ROOT)] if any(str(ROOT).startswith(d.rstrip("/") + "/") for d in PRIVATE_DIRS) else []
        self.stash = tempfile.mkdtemp(prefix="miles-keep-", dir="/var/tmp") if keep else None
        cmds = [f"mount --bind {k} {self.stash}" for k in keep]
        cmds += [f"mkdir -p {d} && mount -t tmpfs tmpfs {d}" for d in PRIVATE_DIRS]
        cmds += [f"mkdir -p {k} && mount --bind {self.stash} {k}" for k in keep]
        return " && ".join(cmds)

    def _wait_for_engine_node(self, timeout: float = 120.0) -> None:
        probe = f"import ray; ray.init(address='{self.address}'); print(ray.cluster_resources().get('engine_node', 0))"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.worker.poll() is not None:
                out = self.worker.stdout.read().decode(errors="replace")
                raise TwoNodeError(f"the engine node exited with {self.worker.returncode}: {out[-3000:]}")
            if float(self._run([sys.executable, "-c", probe], timeout=60).strip().splitlines()[-1]) >= 1:
                return
            time.sleep(1)
        raise TwoNodeError(f"the engine node did not join {self.address} within {timeout:.0f} s")

    def _run(self, cmd: list[str], timeout: float = 180.0) -> str:
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise TwoNodeError(f"{cmd[:3]} failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-3000:]}")
        return p.stdout

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGTERM)
            try:
                self.worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait(10)
        self._kill_own_processes()  # not `ray stop`: that would stop every Ray on the machine
        shutil.rmtree(self.head_temp, ignore_errors=True)
        if self.stash:
            os.rmdir(self.stash)  # an empty mount point here: the bind mounts lived in the other namespace

    def _kill_own_processes(self) -> None:
        """SIGKILL every process of this cluster: their command lines name its GCS address or temp dir."""
        marks = (f":{self.port}", self.head_temp, f"/tmp/ray-engine-{self.port}")
        for _ in range(3):
            found = False
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if int(pid) != os.getpid() and "ray" in cmd and any(m in cmd for m in marks):
                    found = True
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not found:
                return
            time.sleep(1)
