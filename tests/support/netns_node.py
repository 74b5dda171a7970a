"""A network-isolated test node on this machine: its own network and mount namespaces, nothing else.

`IsolatedNode().start()` starts a holder process in new network and mount namespaces (`unshare -n -m`,
private propagation) that mounts a fresh tmpfs over /tmp and ~/.cache there (the checkout, its code
and venv, stays visible) and then sleeps; a veth pair joins it to this machine: `host_if` with
`host_ip` here, the node's end with `ip` inside, a /30 of TEST-NET (tests/support/two_nodes.py).
The node has its own loopback (127.0.0.1 there is not this machine's) and reaches only its /30 and
the addresses of this machine given to `route_to` (e.g. an S3 server's). No Ray runs there until a
process started with `command` brings its own. Unlike TwoNodeCluster's engine node, it is no part
of any cluster: a whole job (a producer with its own local Ray) runs there.

`stop()` kills every process in the node's network namespace, the holder and the pair, also after a
failed start; `leftovers()` says what of the node is still there. Needs root with unshare, nsenter, ip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from tests.support.two_nodes import ROOT, TwoNodeError, _free_port, _processes, _test_block, namespace_holder

IP_COMMAND_SECONDS = 60  # one `ip`/`nsenter` command that sets the node up or takes it down
KILL_RETRY_SECONDS = 1  # between rounds of SIGKILL while the node's processes still show


def missing_tools() -> list[str]:
    """What an isolated node needs and this machine lacks (root, unshare, nsenter, ip)."""
    missing = [t for t in ("unshare", "nsenter", "ip") if shutil.which(t) is None]
    return missing + ([] if os.geteuid() == 0 else ["root"])


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_COMMAND_SECONDS)
    if p.returncode != 0:
        raise TwoNodeError(f"{cmd} failed ({p.returncode}): {p.stdout[-1000:]}{p.stderr[-2000:]}")


class IsolatedNode:
    def __init__(self):
        if missing_tools():
            raise TwoNodeError(f"an isolated node needs root with unshare, nsenter and ip (missing: {missing_tools()})")
        self.seed = _free_port()  # picks the /30 and names the interfaces
        self.host_if, self.node_if = f"mni{self.seed}", f"mnj{self.seed}"
        self.host_ip = self.ip = ""
        self.holder: subprocess.Popen | None = None
        self.netns: str | None = None
        self.veth = False  # the pair is ours to delete
        self.stash: str | None = None

    def start(self) -> "IsolatedNode":
        """The namespaces and the veth pair; on failure whatever started is stopped before the error propagates."""
        try:
            self._namespaces()
            self._network()
        except BaseException:
            self.stop()
            raise
        return self

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` run on the node: its network and its private dirs, in the checkout."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", f"--wd={ROOT}", *cmd]

    def route_to(self, ip: str) -> None:
        """Let the node reach `ip`, an address of this machine outside its /30, through its pair."""
        _run(["nsenter", "-t", str(self.holder.pid), "-n", "ip", "route", "add", f"{ip}/32", "via", self.host_ip])

    def _namespaces(self) -> None:
        self.holder, self.netns, self.stash = namespace_holder("an isolated node")

    def _network(self) -> None:
        block = _test_block(self.seed)
        self.host_ip, self.ip = (str(h) for h in block.hosts())
        inside = ["nsenter", "-t", str(self.holder.pid), "-n", "ip"]
        _run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.node_if,
              "netns", str(self.holder.pid)])
        self.veth = True
        _run(["ip", "addr", "add", f"{self.host_ip}/{block.prefixlen}", "dev", self.host_if])
        _run(["ip", "link", "set", self.host_if, "up"])
        _run([*inside, "addr", "add", f"{self.ip}/{block.prefixlen}", "dev", self.node_if])
        _run([*inside, "link", "set", self.node_if, "up"])

    def pids(self) -> set[int]:
        """Every process on the node but the holder."""
        if self.netns is None:
            return set()
        return {pid for pid, (_, _, netns) in _processes().items() if netns == self.netns} - {self.holder.pid}

    def stop(self) -> None:
        """End everything on the node, the holder and the pair; never raises for what is already gone."""
        for _ in range(5):
            if not (left := self.pids()):
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(KILL_RETRY_SECONDS)
        if self.holder is not None and self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait(10)
        if self.veth:  # deleting our end removes the pair
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        if self.stash:
            os.rmdir(self.stash)  # an empty mount point here: the bind mounts lived in the other namespace
            self.stash = None

    def leftovers(self) -> list[str]:
        """What of the node is still there after `stop()` (a test asserts it is nothing)."""
        left = [f"process {pid}" for pid in sorted(self.pids())]
        if self.holder is not None and self.holder.poll() is None:
            left.append("the namespace holder")
        if self.veth and subprocess.run(["ip", "link", "show", self.host_if], capture_output=True).returncode == 0:
            left.append(f"interface {self.host_if}")
        return left
