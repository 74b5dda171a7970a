"""Named crash points for the chaos tests (tests/chaos): nothing happens unless MILES_CHAOS_POINT is set.

    MILES_CHAOS_POINT=name:n   the n-th time this process reaches point `name`, it writes
                               $MILES_CHAOS_DIR/reached-{name} and blocks there for good

so the test can SIGKILL the whole run (driver, Ray, actors, engines) while it is inside that
critical section. The points: `buffer.commit` (a group object encoded, not yet committed; puts
waiting), `buffer.record` (groups got for a step, its consumption manifest not yet written),
`checkpoint.write` (tensors written, no COMPLETE marker yet), `weights.push` (engines paused,
the new weights not yet loaded).
"""

from __future__ import annotations

import collections
import os
import threading

POINTS = ("buffer.commit", "buffer.record", "checkpoint.write", "weights.push")
ENV = "MILES_CHAOS_POINT"
DIR_ENV = "MILES_CHAOS_DIR"

_reached: collections.Counter = collections.Counter()
_lock = threading.Lock()


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec or spec.rpartition(":")[0] != name:
        return
    with _lock:
        _reached[name] += 1
        hit = _reached[name] == int(spec.rpartition(":")[2])
    if hit:
        with open(os.path.join(os.environ[DIR_ENV], f"reached-{name}"), "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait()  # until the test kills the run
