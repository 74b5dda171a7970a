"""The driver's part of the run's timeline trace (miles_core.metrics.trace).

    timeline = start_timeline(cfg.metrics, store, stack)   # after Ray is up: records as "driver"
    timeline.on_step(step)                         # the loop, after every step: keeps the window
    # on exit: trace/timeline.json (the window, Perfetto's format), then the tracer stops

With more than one Ray node the driver measures each node's clock against its own (the fastest of
a few round trips to a task pinned on that node) and writes trace/clock.json, so spans recorded on
different nodes line up. Every PRUNE_EVERY steps it deletes the trace chunks written before the
last --trace-window-steps steps.
"""

from __future__ import annotations

import contextlib
import logging
import time

from miles_core.config.sections import MetricsSection
from miles_core.metrics import trace
from miles_core.storage import StorageError, Store

log = logging.getLogger(__name__)

PRUNE_EVERY = 100
TIMELINE_STEPS = 100  # trace/timeline.json holds the last this many steps (`miles trace` any range)
CLOCK_ROUNDS = 5


class NoTimeline:
    def on_step(self, step: int) -> None: ...


class Timeline:
    def __init__(self, store: Store, window_steps: int):
        self.store, self.window_steps = store, window_steps
        self.step_ends: dict[int, float] = {}

    def on_step(self, step: int) -> None:
        self.step_ends[step] = trace.now()
        if not self.window_steps or step % PRUNE_EVERY or step - self.window_steps not in self.step_ends:
            return
        keep_after = self.step_ends[step - self.window_steps]
        self.step_ends = {s: t for s, t in self.step_ends.items() if s >= step - self.window_steps}
        try:
            removed = trace.prune(self.store, keep_after)
        except StorageError as e:
            log.warning("trace window: old chunks not deleted (will retry): %s", e)
            return
        log.debug("trace window: %d chunks before step %d deleted", removed, step - self.window_steps)

    def close(self) -> None:
        """Flush every span of this process, then write the merged trace of the last TIMELINE_STEPS steps."""
        trace.shutdown()
        if not self.step_ends:
            return
        last = max(self.step_ends)
        try:
            steps = (last + 1 - TIMELINE_STEPS, last + 1)
            self.store.put_json(trace.TIMELINE_KEY, trace.build_trace(self.store, steps))
        except StorageError as e:
            log.warning("the timeline trace could not be written to %s: %s", self.store.uri(trace.TIMELINE_KEY), e)


def start_timeline(metrics: MetricsSection, store: Store, stack: contextlib.ExitStack) -> Timeline | NoTimeline:
    if not metrics.trace:
        return NoTimeline()
    trace.configure_from(metrics, store, trace.DRIVER_PROCESS)
    measure_clocks(store)
    timeline = Timeline(store, metrics.trace_window_steps)
    stack.callback(timeline.close)
    return timeline


def measure_clocks(store: Store) -> None:
    """trace/clock.json: every other alive Ray node's clock offset from this one (nothing on one node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    here = ray.get_runtime_context().get_node_id()
    clock = ray.remote(num_cpus=0)(trace.now)
    offsets = {}
    for node in nodes:
        on_node = clock.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        ray.get(on_node.remote())  # the first call starts a worker there: not a round trip to time
        offsets[node] = trace.estimate_offset([_round_trip(ray, on_node) for _ in range(CLOCK_ROUNDS)])
    trace.write_clock_offsets(store, offsets, here)
    log.info("trace clocks: %s", {n[:8]: f"{o['offset_seconds'] * 1000:+.1f} ms" for n, o in offsets.items()})


def _round_trip(ray, on_node) -> tuple[float, float, float]:
    sent = time.time()
    remote = ray.get(on_node.remote())
    return sent, remote, time.time()
