"""Engine processes as Ray actors: start the server, wait for /health, restart it when it dies.

`EngineFleet` starts N `EngineActor`s. Each actor owns one server process, either the CPU engine
(`python -m miles_core.engines.cpu_server`) or SGLang (`python -m sglang.launch_server` with the
model path, tensor-parallel size, memory fraction, host and port from the config,
`--disable-radix-cache --incremental-streaming-output` (see docs/engines.md: no KV shared across a
weight update; increments, not the whole output, in every chunk), plus `--sglang-extra-args`).

Start: the actor waits for `/health` to answer 200. SGLang's `/health` generates one token, so a 200
proves the model serves.

Watchdog: a monitor thread polls the process and a liveness probe that does not generate,
`GET /model_info` (answered by SGLang's HTTP process from its own state). SGLang's `/health` cannot be
the watchdog's probe: it queues a one-token request, which waits while generation is paused for a
weight update and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), so three failed probes would
restart every engine paused for a slow load, and it adds a generate request every interval. So an
engine paused for an update is never restarted (its /model_info answers). A dead scheduler ends
SGLang's server process (the CPU engine's dead batching loop ends its process too), which the process
poll sees. When the process exits or `/model_info` fails `health_failures_before_restart` times in a row
(the HTTP server is gone or hung), the actor kills what is left and starts it again on the same port
with the newest weights it was told about (`note_weights`), so the URL stays valid and a restarted
engine does not serve stale weights. Requests that were in flight on the dead process are answered
by `EngineClient` as aborted (their connection drops); the run goes on (docs/engines.md).

`load_weights` sends `/update_weights_from_disk` once: never again after a timeout (a slow load may
still be running, and a second would load twice).

`restart()` (`EngineServer`, `EngineActor`; `EngineFleet.restart(i)`) does the same on demand and
blocks until the engine is healthy: the distributed weight transport calls it for an engine that
stopped answering mid-push. The restart count is the engine's generation: it changes with every
restart, whoever made it, so the weight transport knows to form its group again
(`EngineFleet.restart_counts()`). A monitor restart never undoes an on-demand one: the monitor only
replaces the process it judged dead.

Bind host: `--engine-bind-host auto` (the default) is decided by `bind_address` where the server
starts, which knows its node: 127.0.0.1 unless this process is connected to a Ray cluster of more
than one node, else this node's address as Ray sees it (`ray.util.get_node_ip_address()`). The
engine's URL (`EngineServer.url`, what `EngineFleet.urls()` hands every role) carries that address,
or the node's address when bound to 0.0.0.0.

Token: with `MILES_ENGINE_API_KEY` set (required when bound beyond loopback), every probe and
load sends it and the server requires it (`miles_core.engines.auth`); SGLang gets it as `--api-key`,
masked in the logged command line.

Placement: an engine's GPUs (`--rollout-num-gpus-per-engine`, SGLang's tensor-parallel size) are one
Ray placement-group bundle, so always on one node. The engines a fleet starts with are one placement
group of a bundle each, PACK: Ray puts them on as few nodes as possible instead of spreading
one-GPU engines over every worker (which leaves no node whole for a trainer node,
driver/placement.py), and places all of them or none. An engine spawned later gets a free bundle of
the fleet (one a removed engine held) or a placement group of its own (STRICT_PACK). The groups go
with the fleet's `shutdown`. Engines without GPUs (the CPU engine) use no placement group.

Resizing: a run's fleet changes while it goes on (miles_core.driver.fleet_reconciler): `spawn` starts one
more engine in the background, `lost` finds the engines whose actor died, `remove` shuts one down in
the background. The other methods of `EngineFleet` block (they wait on the actors) and see the serving
engines only. This module never calls `ray.init`: inside a Flyte Ray task the plugin has done it; tests
do it themselves.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from miles_core.engines.auth import AUTO, auth_headers, engine_token, redact_command
from miles_core.engines.client import EngineClient, EngineControlError
from miles_core.storage.node_local import discard_entry, is_cache_entry, localize, require_uri
from miles_core.storage.weight_versions import READS, localize_weights, staged_read, sum_reads

log = logging.getLogger(__name__)


def custom_resource(name: str) -> dict[str, float]:
    """A sliver of custom resource `name` (pins an actor to nodes offering it; many fit on one)."""
    return {name: 0.001} if name else {}


class EngineLoadError(RuntimeError):
    """An engine did not load the weights it was given."""

    def __init__(self, message: str):
        super().__init__(message)


class EngineStartError(RuntimeError):
    """An engine process did not become healthy in time (the message carries its log tail)."""

    def __init__(self, message: str):
        super().__init__(message)


class EnginesLost(RuntimeError):
    """Engines of a fleet whose actors are gone (their node lost or preempted): an infrastructure
    failure that ends a producer job, so its task's retries start it again on other nodes."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass(frozen=True)
class EngineLaunchSpec:
    backend: str  # "cpu" | "sglang"
    model_path: str
    weight_version: int = 0
    bind_host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    max_running_requests: int = 512
    extra_args: str = ""
    startup_timeout_seconds: float = 900.0
    health_interval_seconds: float = 1.0
    health_failures_before_restart: int = 3
    # capture each token's routed experts (--use-rollout-routing-replay): both servers'
    # --enable-return-routed-experts, without which a request's return_routed_experts is refused
    return_routed_experts: bool = False
    # what model_path is, for the node cache: "models" (the initial model) or "weights" (a published weight
    # version, rebuilt from its anchor and deltas: a producer job's engines start on the feed's version)
    model_kind: str = "models"

    @staticmethod
    def from_config(engine, model_path: str, weight_version: int = 0, *,
                    routed_experts: bool = False, model_kind: str = "models") -> "EngineLaunchSpec":
        """From the `EngineSection` of the run config (`routed_experts`: the train section's
        --use-rollout-routing-replay)."""
        return EngineLaunchSpec(return_routed_experts=routed_experts, model_kind=model_kind,
            backend=engine.engine_backend, model_path=model_path, weight_version=weight_version,
            bind_host=engine.engine_bind_host, tp_size=engine.rollout_num_gpus_per_engine,
            mem_fraction_static=engine.sglang_mem_fraction_static,
            max_running_requests=engine.engine_max_running_requests, extra_args=engine.sglang_extra_args,
            startup_timeout_seconds=engine.engine_startup_timeout_seconds,
        )


def server_command(spec: EngineLaunchSpec, model_path: str, weight_version: int, port: int) -> list[str]:
    """The command line that starts one engine server."""
    host = bind_address(spec.bind_host)  # `EngineServer` hands it decided already
    if spec.backend == "cpu":
        return [sys.executable, "-m", "miles_core.engines.cpu_server", "--model-path", model_path,
                "--host", host, "--port", str(port), "--weight-version", str(weight_version),
                "--max-running-requests", str(spec.max_running_requests), *_routes_args(spec)]
    if spec.backend == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
                "--host", host, "--port", str(port), "--tp-size", str(spec.tp_size),
                "--mem-fraction-static", str(spec.mem_fraction_static),
                "--max-running-requests", str(spec.max_running_requests),
                "--weight-version", str(weight_version), *_sglang_token_args(), *_routes_args(spec),
                *[a for a in SGLANG_RL_ARGS if a not in shlex.split(spec.extra_args)], *shlex.split(spec.extra_args)]
    raise ValueError(f"--engine-backend={spec.backend!r}; expected one of cpu, sglang")


def _routes_args(spec: EngineLaunchSpec) -> list[str]:
    """The launch option both servers name alike that makes them capture each token's routed experts."""
    return ["--enable-return-routed-experts"] if spec.return_routed_experts else []


def _sglang_token_args() -> list[str]:
    """SGLang reads its token from `--api-key` only (the CPU engine from the environment)."""
    token = engine_token()
    return ["--api-key", token] if token else []


def server_env(spec: EngineLaunchSpec) -> dict[str, str]:
    env = dict(os.environ)
    if spec.backend == "sglang":
        # Log-probs of the unmodified logits (temperature 1), like the CPU engine and the trainer.
        env.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def port_taken(error: Exception) -> bool:
    """Whether `error` (a server's or a rank's, with its log or traceback) says its port was bound by another
    process: a port picked by `free_port` is free only when picked."""
    text = str(error).lower()
    return "eaddrinuse" in text or "address already in use" in text


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_address(bind_host: str) -> str:
    """`bind_host`, with `auto` decided for this process's node: 127.0.0.1 unless connected to a Ray
    cluster of more than one node, else this node's address as Ray sees it."""
    if bind_host != AUTO:
        return bind_host
    if "ray" not in sys.modules:  # not connected to Ray (an engine server started without it)
        return "127.0.0.1"
    import ray  # imported already (checked above): this import costs nothing

    if not ray.is_initialized() or sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _url_host(bind_host: str) -> str:
    if bind_host in ("0.0.0.0", "::", ""):
        import ray

        return ray.util.get_node_ip_address()
    return bind_host


def _answers(url: str, path: str, timeout: float) -> bool:
    """`path` answers 200. False for anything else, also a listener on the port that does not speak HTTP
    (another process took the port picked free before the engine bound it: the engine then exits, and
    its start picks another port)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=auth_headers()), timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


def _healthy(url: str, timeout: float = 5.0) -> bool:
    """SGLang's /health: 200 once the engine generated a token (503 while starting or paused)."""
    return _answers(url, "/health", timeout)


def _alive(url: str, timeout: float = 5.0) -> bool:
    """The watchdog's liveness probe: GET /model_info, which does not generate and answers during a pause."""
    return _answers(url, "/model_info", timeout)


PORT_ATTEMPTS = 3  # an engine port taken between picking it free and binding it: pick again
SGLANG_RL_ARGS = ("--disable-radix-cache", "--incremental-streaming-output")


class EngineServer:
    """One engine server process, its log file and its restarts (usable without Ray)."""

    def __init__(self, spec: EngineLaunchSpec, name: str = "engine", log_dir: str | None = None):
        self.spec = replace(spec, bind_host=bind_address(spec.bind_host))
        self.name = name
        self.model_path, self.weight_version = spec.model_path, spec.weight_version
        self.model_kind = spec.model_kind  # node-cache kind of model_path: the initial one, then pushed weights
        self._pick_port()
        log_dir = log_dir or tempfile.mkdtemp(prefix="miles-engine-")
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self._lock = threading.RLock()  # the process: start, restart, stop (held while a launch waits for health)
        self._noted = threading.Lock()  # the weights a restart loads: never waits for a launch (see note_weights)
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    def _pick_port(self) -> None:
        bind = self.spec.bind_host
        self.port = free_port(bind if bind not in ("0.0.0.0", "::") else "")
        self.url = f"http://{_url_host(bind)}:{self.port}"

    def start(self) -> str:
        """Start the process and wait until it is healthy; then watch it. Returns the URL. The port is
        picked free, then bound by the process seconds later: when another process took it meanwhile,
        the engine starts again on another (its URL is not handed out before it is healthy)."""
        with self._lock:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                try:
                    self._launch()
                    break
                except EngineStartError as e:
                    if attempt == PORT_ATTEMPTS or not port_taken(e):
                        raise
                    log.warning("%s: port %d was taken before the engine bound it; starting on another "
                                "(attempt %d of %d)", self.name, self.port, attempt + 1, PORT_ATTEMPTS)
                    self._pick_port()
        self._monitor = threading.Thread(target=self._watch, name=f"{self.name}-monitor", daemon=True)
        self._monitor.start()
        return self.url

    def note_weights(self, model_path: str, weight_version: int) -> None:
        """Weights the engine has been given since; a restart loads these instead of the initial ones. Not under
        the process lock: a load that lands on an engine restarted meanwhile (the delivery paused it, so its
        /health fails until the delivery resumes it) must not wait for that restart to see /health."""
        with self._noted:
            self.model_path, self.weight_version, self.model_kind = model_path, weight_version, "weights"

    def load_weights(self, uri: str, weight_version: int, *, flush_cache: bool = False) -> None:
        """Copy the weight version at `uri` to this node and load it (`/update_weights_from_disk` with the
        local path); the server reports `weight_version` from then on, and restarts load it too. A version
        stored as a delta is rebuilt on this node first (miles_core.storage.weight_versions)."""
        try:
            self._with_local_copy(uri, lambda path: asyncio.run(self._update_from_disk(path, weight_version,
                                                                                       flush_cache)))
        except EngineControlError as e:
            raise EngineLoadError(f"{self.name}: loading {uri} failed: {e}") from e
        self.note_weights(uri, weight_version)

    def _with_local_copy(self, uri: str, use: Callable[[str], Any]) -> Any:
        """`use(path)` of this node's copy of the weight version at `uri`; when the engine fails to read a
        node-cache copy (removed or damaged between the copy and the read: a clean-up, an evicted host path)
        the copy is discarded and made once more."""
        path = localize_weights(uri)
        try:
            return use(path)
        except EngineControlError as e:
            if not is_cache_entry(path):
                raise  # the run root's own files, read in place: the engine's own failure
            log.warning("%s: the engine could not read this node's copy of %s (%s); copying it again once",
                        self.name, uri, e)
            discard_entry(path)  # removed or damaged under the read: a fresh copy (a failure of the
        return use(localize_weights(uri))  # engine's own fails again, and is raised)

    def stage_weights(self, uri: str) -> dict:
        """Before a pause: copy (or rebuild) the weight version at `uri` on this node and have the server read
        it and build its model beside the served one (`/stage_weights_from_disk`), so the `load_weights` of
        the same URI that follows only swaps it in. The answer: "staged", False when the server has no
        staging (SGLang: the copy is made all the same, so its load reads the local disk alone), and what
        rebuilding the version read (`staged_read`)."""
        before = READS.snapshot()
        staged = self._with_local_copy(uri, lambda path: asyncio.run(self._stage(path)))
        return {"staged": bool(staged), **staged_read(before, READS.snapshot())}

    async def _stage(self, path: str) -> list[str]:
        async with EngineClient([self.url], control_timeout_seconds=self.spec.startup_timeout_seconds) as client:
            return await client.stage_weights_from_disk(path)

    async def _update_from_disk(self, path: str, weight_version: int, flush_cache: bool) -> None:
        async with EngineClient([self.url], control_timeout_seconds=self.spec.startup_timeout_seconds) as client:
            await client.update_weights_from_disk(path, weight_version, flush_cache=flush_cache)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def restart(self) -> str:
        """Kill the process (whatever state it is in) and start it again on the same port with the newest
        noted weights; block until it is healthy (EngineStartError otherwise). Returns the URL."""
        with self._lock:
            log.warning("%s: restart requested", self.name)
            self._terminate()
            self._launch()
            self.restarts += 1
        return self.url

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._terminate()
        if self._monitor is not None:
            self._monitor.join(timeout=10)

    # ---- internals ----------------------------------------------------------------------------
    def _launch(self) -> None:
        # A URI (the Ray roles hand engines URIs only) is copied to this node first; a local path
        # (an EngineServer made directly, on this node) is used as is.
        with self._noted:
            model_path, weight_version, kind = self.model_path, self.weight_version, self.model_kind
        if "://" not in model_path:
            path = model_path
        elif kind == "weights":
            path = localize_weights(model_path)
        else:
            path = localize(model_path, kind)
        cmd = server_command(self.spec, path, weight_version, self.port)
        log.info("%s: starting %s", self.name, shlex.join(redact_command(cmd)))
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=server_env(self.spec),
                                         start_new_session=True)
        deadline = time.monotonic() + self.spec.startup_timeout_seconds
        while time.monotonic() < deadline and not self._stop.is_set():
            if self.proc.poll() is not None:
                raise EngineStartError(f"{self.name}: the engine process exited with code {self.proc.returncode} "
                                       f"before it was healthy.\n{self._log_tail()}")
            if _healthy(self.url, timeout=2.0):
                log.info("%s: healthy at %s (pid %d)", self.name, self.url, self.proc.pid)
                return
            time.sleep(0.2)
        self._terminate()
        raise EngineStartError(f"{self.name}: no healthy /health at {self.url} within "
                               f"{self.spec.startup_timeout_seconds:.0f} s (--engine-startup-timeout-seconds).\n"
                               f"{self._log_tail()}")

    def _terminate(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:  # the server may have children (SGLang's scheduler/detokenizer): end its process group
            os.killpg(p.pid, signal.SIGTERM)
            os.killpg(p.pid, signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
            p.wait(timeout=15)
        except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(timeout=15)

    def _watch(self) -> None:
        failures = 0
        backoff = 1.0
        while not self._stop.wait(self.spec.health_interval_seconds):
            with self._lock:
                judged = self.proc
                exited = judged is None or judged.poll() is not None
            if not exited:  # liveness only: never /health, which fails during a pause (module doc)
                failures = 0 if _alive(self.url, timeout=10.0) else failures + 1
                if failures < self.spec.health_failures_before_restart:
                    continue
            if self._stop.is_set():
                return
            with self._lock:
                if self.proc is not judged:  # restarted on demand meanwhile: judge the new process afresh
                    failures = 0
                    continue
                code = judged.returncode if judged is not None else None
                log.warning("%s: engine %s (exit code %s); restarting", self.name,
                            "exited" if exited else "stopped answering /model_info", code)
                self._terminate()
                try:
                    self._launch()
                    self.restarts += 1
                    failures, backoff = 0, 1.0
                except EngineStartError as e:
                    log.error("%s: restart failed: %s", self.name, e)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 60.0)

    def _log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"


class EngineActor:
    """Ray actor body around `EngineServer` (see `EngineFleet`)."""

    def __init__(self, spec: EngineLaunchSpec, name: str):
        logging.basicConfig(level=logging.INFO)
        logging.getLogger("aiobotocore").setLevel(logging.WARNING)  # a line per S3 client: every weight copy
        require_uri(spec.model_path, f"{name} model")
        self.server = EngineServer(spec, name)

    def start(self) -> str:
        return self.server.start()

    def url(self) -> str:
        return self.server.url

    def pid(self) -> int | None:
        return self.server.pid()

    def restart_count(self) -> int:
        return self.server.restarts

    def log_path(self) -> str:
        return self.server.log_path

    def load_weights(self, uri: str, weight_version: int, flush_cache: bool = False) -> None:
        self.server.load_weights(require_uri(uri, f"{self.server.name} weights"), weight_version,
                                 flush_cache=flush_cache)

    def stage_weights(self, uri: str) -> dict:
        return self.server.stage_weights(require_uri(uri, f"{self.server.name} weights"))

    def restart(self) -> str:
        return self.server.restart()

    def shutdown(self) -> None:
        self.server.stop()


STARTING, SERVING, DRAINING = "starting", "serving", "draining"


@dataclass
class FleetMember:
    """One engine actor of a fleet. `state` is the fleet owner's word for it: starting (and the phases a
    driver adds before it serves), serving, draining; `urls()` and the index-based methods see the
    serving ones."""

    name: str
    actor: Any
    started: Any  # the Ray ref of actor.start(): the URL once healthy
    url: str = ""
    state: str = STARTING
    since: float = field(default_factory=time.time)
    detail: dict = field(default_factory=dict)  # JSON-able notes of the owner (the version it joined at)
    loading: Any = None  # the Ray ref of a load in the background (`begin_load`)
    slot: Any = None  # (placement group, bundle index) the engine runs in; None without GPUs


class EngineFleet:
    """Engine actors. `with EngineFleet(spec, n) as fleet: fleet.urls()`; the methods named like actions
    block, except the ones that change the fleet while a run goes on (`spawn`, `remove`, `reap`): a
    spawned engine starts in the background (`started` tells when its URL is known) and a removed one
    shuts down in the background. Engines are named `{prefix}-{k}` with k growing, never reused."""

    def __init__(self, spec: EngineLaunchSpec, num_engines: int, *, num_cpus_per_engine: float = 1.0,
                 name_prefix: str = "engine", resources: dict[str, float] | None = None):
        import ray

        gpus = spec.tp_size if spec.backend == "sglang" else 0
        self._actor_cls = ray.remote(EngineActor)
        self._actor_options = dict(num_cpus=num_cpus_per_engine, num_gpus=gpus, max_concurrency=8,
                                   resources=resources or None)
        # one engine's placement-group bundle: the same resources its actor asks for (module doc)
        self._bundle = {"CPU": num_cpus_per_engine, **({"GPU": gpus} if gpus else {}), **(resources or {})}
        self._groups: list = []  # the fleet's placement groups, removed by `shutdown`
        self._free_slots: list[tuple[Any, int]] = []  # bundles of those that no engine holds
        self.spec, self.name_prefix, self._next = spec, name_prefix, 0
        self.members: list[FleetMember] = []
        self._retiring: list[tuple[Any, Any, float]] = []  # (actor, its shutdown ref, kill deadline)
        if gpus and num_engines:
            self._reserve(num_engines, "PACK")
        for _ in range(num_engines):
            self.spawn()

    def _reserve(self, n: int, strategy: str) -> None:
        """A placement group of `n` engine bundles; its bundles join the free ones."""
        from ray.util.placement_group import placement_group

        group = placement_group([self._bundle] * n, strategy=strategy)
        self._groups.append(group)
        self._free_slots.extend((group, i) for i in range(n))

    def start(self) -> "EngineFleet":
        """Wait for every engine spawned so far to be healthy (EngineStartError otherwise); they serve."""
        import ray

        starting = [m for m in self.members if m.state == STARTING]
        for m, url in zip(starting, ray.get([m.started for m in starting])):
            m.url, m.state, m.since = url, SERVING, time.time()
        return self

    def __enter__(self) -> "EngineFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def actors(self) -> list:
        return [m.actor for m in self.serving()]

    def serving(self) -> list[FleetMember]:
        return [m for m in self.members if m.state == SERVING]

    def urls(self) -> list[str]:
        return [m.url for m in self.serving()]

    def restart_counts(self) -> list[int]:
        import ray

        return ray.get([a.restart_count.remote() for a in self.actors])

    def pids(self) -> list[int | None]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def actor_handles(self) -> list:
        """The Ray actor handles, engine i at index i (to call from other actors, e.g. a trainer rank)."""
        return self.actors

    def restart(self, i: int) -> str:
        """Restart engine i now (kill, start on the same port with the noted weights) and block until it
        is healthy; its restart count goes up by one. Returns its URL."""
        import ray

        return ray.get(self.actors[i].restart.remote())

    def load_weights(self, uri: str, weight_version: int, flush_cache: bool = False) -> None:
        """Every engine copies the snapshot at `uri` to its own node and loads it (blocking)."""
        import ray

        ray.get([a.load_weights.remote(uri, weight_version, flush_cache) for a in self.actors])

    def stage_weights(self, uri: str) -> dict:
        """Every engine copies the snapshot at `uri` to its own node and stages it beside the model it
        serves (blocking; engines go on generating): the `load_weights` of `uri` that follows, while
        paused, only swaps it in. The answer: what rebuilding it read, all engines' nodes together (`sum_reads`)."""
        import ray

        return sum_reads(ray.get([a.stage_weights.remote(uri) for a in self.actors]))

    # ---- changes while a run goes on ------------------------------------------------------------
    def spawn(self) -> FleetMember:
        """A new engine, starting in the background (Ray places it when the cluster has room)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name = f"{self.name_prefix}-{self._next}"
        self._next += 1
        options, slot = dict(self._actor_options), None
        if self._actor_options["num_gpus"]:
            if not self._free_slots:
                self._reserve(1, "STRICT_PACK")
            slot = self._free_slots.pop(0)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(slot[0], placement_group_bundle_index=slot[1])
        actor = self._actor_cls.options(**options).remote(self.spec, name)
        member = FleetMember(name, actor, actor.start.remote(), slot=slot)
        self.members.append(member)
        return member

    def started(self, member: FleetMember) -> bool:
        """Whether `member`'s start has finished, its URL noted; raises what its start raised (a Ray
        error wrapping EngineStartError, or the actor's death)."""
        import ray

        if member.url:
            return True
        if not ray.wait([member.started], timeout=0)[0]:
            return False
        member.url = ray.get(member.started)
        return True

    def begin_load(self, member: FleetMember, uri: str, weight_version: int) -> None:
        """`member` loads the snapshot at `uri` as `weight_version`, in the background (`loaded` tells)."""
        member.loading = member.actor.load_weights.remote(uri, weight_version)

    def loaded(self, member: FleetMember) -> bool:
        """Whether `member`'s load finished; raises what it raised (EngineLoadError wrapped by Ray)."""
        import ray

        if not ray.wait([member.loading], timeout=0)[0]:
            return False
        ref, member.loading = member.loading, None
        ray.get(ref)
        return True

    def lost(self, timeout_seconds: float = 2.0) -> list[FleetMember]:
        """The started members whose actor is gone (its process killed, its node lost)."""
        started = [m for m in self.members if m.url]
        dead = set(lost_actors([m.actor for m in started], timeout_seconds))
        return [m for i, m in enumerate(started) if i in dead]

    def remove(self, member: FleetMember, graceful: bool = True) -> None:
        """Take `member` out of the fleet: shut it down in the background (graceful; `reap` ends its actor
        once done), or end its actor now."""
        import ray

        self.members.remove(member)
        if member.slot is not None:  # the next spawn takes it (it waits there until this actor has ended)
            self._free_slots.append(member.slot)
        if graceful:
            self._retiring.append((member.actor, member.actor.shutdown.remote(), time.monotonic() + 60.0))
        else:
            ray.kill(member.actor)

    def reap(self) -> None:
        """End the actors of removed engines whose shutdown finished (or ran out of time)."""
        import ray

        now, keep = time.monotonic(), []
        for actor, ref, deadline in self._retiring:
            if ray.wait([ref], timeout=0)[0] or now > deadline:
                ray.kill(actor)
            else:
                keep.append((actor, ref, deadline))
        self._retiring = keep

    def shutdown(self) -> None:
        """Every engine stops its server (60 s at most; 5 s for one still starting, which Ray may never have
        placed), then every actor ends."""
        import ray

        started, starting = [m for m in self.members if m.url], [m for m in self.members if not m.url]
        actors = [m.actor for m in self.members] + [a for a, _, _ in self._retiring]
        refs = [m.actor.shutdown.remote() for m in started] + [r for _, r, _ in self._retiring]
        early = [m.actor.shutdown.remote() for m in starting]
        self.members, self._retiring = [], []
        try:
            for waiting, seconds in ((refs, 60), (early, 5)):
                if waiting:
                    ray.wait(waiting, num_returns=len(waiting), timeout=seconds)
        finally:
            end_actors(actors)
            self._release_groups()

    def _release_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        groups, self._groups, self._free_slots = self._groups, [], []
        for group in groups:
            remove_placement_group(group)


def end_actors(actors: list, timeout_seconds: float = 10.0) -> None:
    """End `actors`: each exits on its own first (`__ray_terminate__`, after the calls it is running), then
    `ray.kill` ends any still there. Killed straight away, a worker gets SIGTERM wherever it is, and one in
    the middle of a handle's `__del__` prints a `SystemExit` traceback on the console of a run that went well."""
    import ray

    refs = []
    for actor in actors:
        try:
            refs.append(actor.__ray_terminate__.remote())
        except Exception:  # noqa: BLE001 - already gone: ray.kill below is then a no-op
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_seconds)
    for actor in actors:
        ray.kill(actor)


def lost_actors(actors: list, timeout_seconds: float = 2.0) -> list[int]:
    """The indexes of `actors` that are gone (a call raises Ray's ActorDiedError); one that does not answer
    within the timeout is busy, and one Ray calls unavailable may come back: neither is gone yet."""
    import ray

    if not actors:
        return []
    refs = [a.url.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_seconds)
    done, gone = set(ready), []
    for i, ref in enumerate(refs):
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except ray.exceptions.ActorDiedError:
            gone.append(i)
        except ray.exceptions.RayActorError:
            pass
    return gone
