"""A two-node Ray cluster on one machine whose nodes share nothing local, not even a network.

The head node (the driver and the trainer: resource `head_node`) runs in this machine's namespaces.
The second node (the engines: resource `engine_node`) runs `ray start` inside its own network and
mount namespaces (`unshare -n -m`, private propagation), held open by a holder process:

- network: a veth pair, `mnh<port>` here with the head's address and `mnw<port>` inside with the
  engine node's, a /30 out of 198.18.0.0/15 (the range set aside for tests, RFC 2544; the block is
  picked from the GCS port and skipped when this machine uses it already). The engine node has
  its own loopback: 127.0.0.1 there is not the head's. Ray's nodes advertise their veth addresses.
- mounts: fresh tmpfs over every local directory the head side writes: /tmp (the head's Ray temp
  dir, pytest's temp dirs, the head's node cache under them) and ~/.cache (default node caches).
- storage: the run root must be on object storage, so the cluster starts its own SeaweedFS S3
  server on the head's address (`s3`; `env` points both nodes and the run at it).

Each node starts ahead of the machine's other work and is started again when Ray's startup timed
out (its raylet gives its agents 15 s to report their ports, which a loaded machine can miss).
`stop()` ends every process of the cluster (the head's by its address and temp dir on their command
lines and their descendants, the engine node's by their network namespace, never `ray stop`), the
S3 server, the holder and the veth pair, also after a failed start. Needs root with `unshare`,
`nsenter` and `ip`; without them the cluster refuses to start (tests fail loudly, never skip).
`start_network()` sets up only the namespaces and the veth pair, for a test of one connection across
the two networks (`engine_node_command` runs a process on the engine node's network).
"""

from __future__ import annotations

import ipaddress
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

from tests.support.seaweed import SeaweedS3, start_seaweed

JOIN_SECONDS = 120.0  # the engine node joins the head's Ray cluster
RAY_PROBE_SECONDS = 60  # one probe interpreter that connects to the cluster and reads its resources
NODE_COMMAND_SECONDS = 180.0  # one command run on a node (ray start, a probe)
RETRY_SECONDS = 1  # between probes of the cluster, and between rounds of SIGKILL while processes still show

RAY = str(Path(sys.executable).with_name("ray"))
ROOT = Path(__file__).resolve().parents[2]  # the checkout: its code and .venv must stay visible on both nodes
PRIVATE_DIRS = ("/tmp", os.path.expanduser("~/.cache"))
TEST_NET = ipaddress.ip_network("198.18.0.0/15")
BUCKET = "miles-test"
BOOST = ("nice", "-n", "-10")


class TwoNodeError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _test_block(port: int) -> ipaddress.IPv4Network:
    """A /30 of TEST_NET no interface of this machine has an address in, the first tried picked by `port`."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    blocks = list(TEST_NET.subnets(new_prefix=30))
    for i in range(len(blocks)):
        block = blocks[(port + i) % len(blocks)]
        if not any(f" {h}/" in used for h in block):
            return block
    raise TwoNodeError(f"no free /30 left in {TEST_NET}")


def namespace_holder(what: str) -> tuple[subprocess.Popen, str, str | None]:
    """(holder, its network namespace, stash): a process in new network and mount namespaces that mounts a
    tmpfs over each private dir there and then sleeps. The checkout (code and venv) stays visible even
    when it lives under a private dir (a CI clone in /tmp): it is bind-mounted aside into `stash` (an
    empty dir of this machine, removed by the caller when done) first and back afterwards."""
    keep = [str(ROOT)] if any(str(ROOT).startswith(d.rstrip("/") + "/") for d in PRIVATE_DIRS) else []
    stash = tempfile.mkdtemp(prefix="miles-keep-", dir="/var/tmp") if keep else None
    mounts = [f"mount --bind {k} {stash}" for k in keep]
    mounts += [f"mkdir -p {d} && mount -t tmpfs tmpfs {d}" for d in PRIVATE_DIRS]
    mounts += [f"mkdir -p {k} && mount --bind {stash} {k}" for k in keep]
    script = f"{' && '.join(mounts)} && ip link set lo up && echo ready && exec sleep infinity"
    holder = subprocess.Popen(["unshare", "-n", "-m", "--propagation", "private", "bash", "-c", script],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    line = holder.stdout.readline().decode(errors="replace").strip()
    if line != "ready":
        rest = holder.stdout.read().decode(errors="replace") if holder.poll() is not None else ""
        if stash:
            os.rmdir(stash)
        raise TwoNodeError(f"{what}'s namespaces could not be set up: {line} {rest[-2000:]}")
    return holder, os.readlink(f"/proc/{holder.pid}/ns/net"), stash


def _processes() -> dict[int, tuple[int, str, str]]:
    """Every process of this machine: pid -> (parent pid, command line, network namespace)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[int(pid)] = (int(stat[stat.rindex(")") + 2:].split()[1]), cmd, os.readlink(f"/proc/{pid}/ns/net"))
        except (OSError, ValueError, IndexError):
            continue
    return out


class TwoNodeCluster:
    def __init__(self, env: dict[str, str], head_cpus: int = 2, engine_cpus: int = 1):
        missing = [t for t in ("unshare", "nsenter", "ip") if shutil.which(t) is None]
        if missing or os.geteuid() != 0:
            raise TwoNodeError(f"the two-node cluster needs root with unshare, nsenter and ip (missing: {missing})")
        self.port = _free_port()
        block = _test_block(self.port)
        self.head_ip, self.engine_ip = (str(h) for h in block.hosts())
        self.prefix = block.prefixlen
        self.head_if, self.engine_if = f"mnh{self.port}", f"mnw{self.port}"  # at most 8 characters (15 allowed)
        self.address = f"{self.head_ip}:{self.port}"
        self.env = {**os.environ, **env, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
        self.head_temp = f"/tmp/ray-head-{self.port}"
        self.engine_temp = f"/tmp/ray-engine-{self.port}"  # inside the engine node's own /tmp
        self.head_cpus, self.engine_cpus = head_cpus, engine_cpus
        self.holder: subprocess.Popen | None = None  # holds the engine node's namespaces open
        self.netns: str | None = None  # its network namespace (`net:[inode]`)
        self.veth = False  # the pair is ours to delete
        self.worker: subprocess.Popen | None = None
        self.s3: SeaweedS3 | None = None
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
        self._namespaces()
        self._network()
        self.s3 = start_seaweed(ip=self.head_ip)
        self.env.update(self.s3.env())
        self._bucket()
        # Each node starts ahead of the machine's other work (`nice -n -10`, undone by `_renice` once both
        # are up): its raylet gives its agents 15 s to report their ports, which a loaded machine (CI's
        # two lanes on two cores) can miss; a start that timed out all the same is tried again.
        head = [*BOOST, RAY, "start", "--head", f"--port={self.port}", f"--node-ip-address={self.head_ip}",
                f"--num-cpus={self.head_cpus}", "--resources", json.dumps({"head_node": 1}),
                f"--temp-dir={self.head_temp}", "--include-dashboard=false", "--disable-usage-stats"]
        worker = [*BOOST, "nsenter", "-t", str(self.holder.pid), "-n", "-m", RAY, "start",
                  f"--address={self.address}", f"--node-ip-address={self.engine_ip}", f"--num-cpus={self.engine_cpus}",
                  "--resources", json.dumps({"engine_node": 1}), f"--temp-dir={self.engine_temp}",
                  "--disable-usage-stats", "--block"]
        self._attempts(lambda: self._run(head), head=True)
        self._attempts(lambda: self._start_worker(worker), head=False)
        self._renice()

    def start_network(self) -> "TwoNodeCluster":
        """Only the engine node's namespaces and the veth pair, no Ray and no S3 (a test of one connection
        across the two networks runs its processes there with `engine_node_command`); `stop()` as usual."""
        try:
            self._namespaces()
            self._network()
        except BaseException:
            self.stop()
            raise
        return self

    def engine_node_command(self, cmd: list[str]) -> list[str]:
        """`cmd` run in the engine node's network namespace (this node's files, the other network)."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", *cmd]

    def _attempts(self, start, head: bool, tries: int = 3) -> None:
        """`start()`, again after a Ray node that timed out during startup (what it left is killed first)."""
        for attempt in range(tries):
            try:
                return start()
            except TwoNodeError as e:
                if attempt == tries - 1 or "timed out during startup" not in str(e):
                    raise
                self._kill_own_processes(head=head, engine=not head)

    def _start_worker(self, cmd: list[str]) -> None:
        self.worker = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self._wait_for_engine_node()

    def _namespaces(self) -> None:
        """The holder (`namespace_holder`); the engine node's processes join its namespaces (`nsenter`)."""
        self.holder, self.netns, self.stash = namespace_holder("the engine node")

    def _network(self) -> None:
        """The veth pair: the head's end here, the engine node's end moved into the holder's namespace."""
        ns = str(self.holder.pid)
        self._run(["ip", "link", "add", self.head_if, "type", "veth", "peer", "name", self.engine_if, "netns", ns])
        self.veth = True
        self._run(["ip", "addr", "add", f"{self.head_ip}/{self.prefix}", "dev", self.head_if])
        self._run(["ip", "link", "set", self.head_if, "up"])
        self._run(["nsenter", "-t", ns, "-n", "ip", "addr", "add", f"{self.engine_ip}/{self.prefix}",
                   "dev", self.engine_if])
        self._run(["nsenter", "-t", ns, "-n", "ip", "link", "set", self.engine_if, "up"])

    def _bucket(self) -> None:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.s3.endpoint, key=self.s3.env()["AWS_ACCESS_KEY_ID"],
                          secret=self.s3.env()["AWS_SECRET_ACCESS_KEY"]).mkdir(BUCKET)

    def _wait_for_engine_node(self, timeout: float = JOIN_SECONDS) -> None:
        probe = f"import ray; ray.init(address='{self.address}'); print(ray.cluster_resources().get('engine_node', 0))"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.worker.poll() is not None:
                out = self.worker.stdout.read().decode(errors="replace")
                raise TwoNodeError(f"the engine node exited with {self.worker.returncode}: {out[-3000:]}")
            if float(self._run([sys.executable, "-c", probe], timeout=RAY_PROBE_SECONDS).strip().splitlines()[-1]) >= 1:
                return
            time.sleep(RETRY_SECONDS)
        raise TwoNodeError(f"the engine node did not join {self.address} within {timeout:.0f} s")

    def _run(self, cmd: list[str], timeout: float = NODE_COMMAND_SECONDS) -> str:
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise TwoNodeError(f"{cmd[:3]} failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-3000:]}")
        return p.stdout

    def stop(self) -> None:
        """End everything `start` began, whatever state it reached; never raises for what is already gone."""
        if self.worker is not None and self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGTERM)
            try:
                self.worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait(10)
        self._kill_own_processes()  # not `ray stop`: that would stop every Ray on the machine
        if self.s3 is not None:
            self.s3.stop()
        if self.holder is not None and self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait(10)
        # Deleting one end removes the pair; the namespace's end is gone already when the namespace is.
        if self.veth:
            subprocess.run(["ip", "link", "del", self.head_if], capture_output=True)
        shutil.rmtree(self.head_temp, ignore_errors=True)
        if self.stash:
            os.rmdir(self.stash)  # an empty mount point here: the bind mounts lived in the other namespace

    def _own_pids(self, head: bool = True, engine: bool = True) -> set[int]:
        """The processes of this cluster: on the head, those whose command lines name its address or temp
        dir, and their descendants (Ray's workers retitle themselves `ray::Name`); on the engine node,
        every process in its network namespace but the holder (Ray's, and the engine servers)."""
        marks = (f"{self.head_ip}:", f"{self.head_temp}/", f"{self.head_temp} ")
        procs = _processes()
        ours = {pid for pid, (_, cmd, netns) in procs.items()
                if (engine and self.netns is not None and netns == self.netns)
                or (head and "ray" in cmd and any(m in cmd for m in marks))}
        while more := {pid for pid, (ppid, _, _) in procs.items() if ppid in ours} - ours:
            ours |= more
        return ours - {os.getpid(), self.holder.pid if self.holder is not None else -1}

    def _kill_own_processes(self, head: bool = True, engine: bool = True) -> None:
        """SIGKILL every process of this cluster (`_own_pids`), until none is left."""
        for _ in range(5):
            ours = self._own_pids(head, engine)
            if not ours:
                return
            for pid in ours:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(RETRY_SECONDS)

    def _renice(self) -> None:
        """Back to the usual priority once both nodes are up (Ray's later workers inherit it)."""
        for pid in self._own_pids():
            try:
                os.setpriority(os.PRIO_PROCESS, pid, 0)
            except OSError:
                pass

    def engine_node_logs(self) -> list[Path]:
        """The engine node's Ray log files (its /tmp, seen through the holder's mount namespace, where the
        absolute `session_latest` link would lead back to the head's /tmp)."""
        temp = Path(f"/proc/{self.holder.pid}/root") / self.engine_temp.lstrip("/")
        return sorted(p for s in temp.glob("session_*") if not s.is_symlink()
                      for p in (s / "logs").glob("*") if p.is_file())

    def leftovers(self) -> list[str]:
        """What of this cluster is still there after `stop()` (a test asserts it is nothing)."""
        left = [f"process {pid}" for pid in sorted(self._own_pids())]
        if self.holder is not None and self.holder.poll() is None:
            left.append("the namespace holder")
        if self.veth and subprocess.run(["ip", "link", "show", self.head_if], capture_output=True).returncode == 0:
            left.append(f"interface {self.head_if}")
        if self.s3 is not None and self.s3.process.poll() is None:
            left.append("the S3 server")
        return left
