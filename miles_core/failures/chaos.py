"""Named crash points for the chaos tests (tests/chaos): nothing happens unless MILES_CHAOS_POINT is set.

    MILES_CHAOS_POINT=name:n   the n-th time this process reaches point `name`, it writes
                               $MILES_CHAOS_DIR/reached-{name} and blocks there for good; while
                               that file exists the point does not fire again (in any process: a
                               restarted engine inherits the setting)

so the test can SIGKILL the whole run (driver, Ray, actors, engines) while it is inside that
critical section. The points: `buffer.commit` (a group object encoded, not yet committed; puts
waiting), `buffer.record` (groups got for a step, its consumption manifest not yet written),
`checkpoint.write` (tensors written, no COMPLETE marker yet), `weights.delta` (a weight version's
delta part written, the version not sealed: docs/weight-versions.md), `weights.push` (engines paused,
the new weights not yet loaded), `engine.generate` (a CPU engine streaming a response, its event
loop held: every request on it is in flight).
"""

from __future__ import annotations

import collections
import os
import threading

POINTS = ("buffer.commit", "buffer.record", "checkpoint.write", "weights.delta", "weights.push", "engine.generate")
ENV = "MILES_CHAOS_POINT"
DIR_ENV = "MILES_CHAOS_DIR"

_reached: collections.Counter = collections.Counter()
_lock = threading.Lock()


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec or spec.rpartition(":")[0] != name:
        return
    marker = os.path.join(os.environ[DIR_ENV], f"reached-{name}")
    with _lock:
        _reached[name] += 1
        hit = _reached[name] == int(spec.rpartition(":")[2]) and not os.path.exists(marker)
    if hit:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait()  # until the test kills the run
