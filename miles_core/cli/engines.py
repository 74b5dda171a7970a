"""`miles engines add|remove|show`: the size of a run's rollout engine fleet, changed while it runs.

    miles engines add RUN_URI N       the target grows by N (engines/target.json); prints the new target
    miles engines remove RUN_URI N    it shrinks by N: the newest engines drain, then shut down
    miles engines show RUN_URI        the target and the fleet the driver last recorded (--json: both records)

The run's driver reads the target within a few seconds and moves the fleet to it
(miles_core.driver.fleet_reconciler); the target also holds for the run's later segments. The first
change counts from the run's --rollout-num-engines. A target below 0, or below 1 on a run without
--allow-rollout-producers (nothing else would generate), is refused (exit 1), and so is a RUN_URI
that holds no run.
"""

from __future__ import annotations

import json
import time

from miles_core.cli.parsing import Command, CommandParser, add_storage_timeout, subcommands
from miles_core.cli.reading import READ_TIMEOUT_SECONDS, RUN_URI_HELP, storage_budget
from miles_core.engines.registry import TARGET_KEY, EngineTargetError, change_target, read_fleet, read_target
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, get_json_or_none, read_config, read_status, require_run


def _engines(p: CommandParser) -> None:
    actions = subcommands(p, "actions")
    for name, verb in (("add", "grows"), ("remove", "shrinks")):
        a = actions.add_parser(name, help=f"the run's engine target {verb} by N",
                               description=f"The engine target of RUN_URI {verb} by N; the run's driver moves its "
                                           "fleet there within seconds. Prints the new target.")
        a.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
        a.add_argument("count", metavar="N", type=_positive_int, help="how many engines (an integer >= 1)")
        add_storage_timeout(a, READ_TIMEOUT_SECONDS)
        a.set_defaults(handler=_change, sign=1 if name == "add" else -1)
    show = actions.add_parser("show", help="the target and the fleet the driver last recorded",
                              description="The engine target of RUN_URI and the fleet its driver last recorded: "
                                          "each engine's state, URL and weight version, and the recent changes. "
                                          "VERSION is the newest weight version the engine answered a request "
                                          "with when the record was made (each step's push makes one: the "
                                          "`weights v` of the serving line); before it answered any, the version "
                                          "it began serving with, marked `(joined)`.")
    show.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    show.add_argument("--json", action="store_true", help="print both records as JSON")
    add_storage_timeout(show, READ_TIMEOUT_SECONDS)
    show.set_defaults(handler=_show)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "integer >= 1"  # argparse names the type in its error


def _change(ns) -> int:
    with storage_budget(ns.storage_timeout):
        store = require_run(Store(ns.run_uri))
        status = read_status(store)
        if status is not None and status.state == FINISHED:
            raise EngineTargetError(f"{ns.run_uri} is finished (its last step {status.last_step} is done): no "
                                    "driver will move its fleet. Engines change while a run runs; continue it "
                                    "with a larger --num-rollout, or `miles fork` it.")
        starting, producers = _run_settings(store)
        current = (read_fleet(store) or {}).get("target", starting)
        count = change_target(store, ns.sign * ns.count, current, by=f"miles engines {ns.action}",
                              minimum=0 if producers else 1,
                              why="" if producers else "a run without --allow-rollout-producers keeps at least 1")
    print(f"engine target of {ns.run_uri}: {count}")
    return 0


def _run_settings(store: Store) -> tuple[int, bool]:
    """(--rollout-num-engines, --allow-rollout-producers) of the run's latest segment."""
    config = read_config(store) or {}
    engine, buffer = config.get("engine", {}), config.get("buffer", {})
    return int(engine.get("rollout_num_engines", 1)), bool(buffer.get("allow_rollout_producers", False))


def _show(ns) -> int:
    with storage_budget(ns.storage_timeout):
        store = require_run(Store(ns.run_uri))
        read_target(store)  # a target.json that holds no count is an error, named
        data = {"target": get_json_or_none(store, TARGET_KEY), "fleet": read_fleet(store)}
    print(json.dumps(data, indent=2, sort_keys=True) if ns.json else _render(data))
    return 0


def _render(data: dict) -> str:
    target, fleet = data["target"], data["fleet"] or {}
    lines = [f"target {target['count']} (asked by {target.get('by') or '?'}, {_ago(target.get('requested_at'))})"
             if target else "target: none asked (the run keeps --rollout-num-engines)"]
    if not fleet:
        return "\n".join(lines + ["fleet: not recorded yet (the run has not started since engines could change)"])
    lines.append(f"serving {fleet.get('serving', 0)} of target {fleet.get('target')} at step {fleet.get('step')} "
                 f"(weights v{fleet.get('version')}), recorded {_ago(fleet.get('updated_at'))}")
    lines += _engine_rows(fleet.get("engines", []))
    recent = fleet.get("events", [])[-8:]
    lines += ["recent:"] + [f"  step {e.get('step')}  {e.get('event'):<9}  {e.get('name', '')}" for e in recent]
    return "\n".join(lines)


def _engine_rows(engines: list[dict]) -> list[str]:
    rows = [("NAME", "STATE", "VERSION", "URL")]
    rows += [(e["name"], e.get("phase", e["state"]), _version(e), e.get("url") or "-") for e in engines]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]:<{width[2]}}  {r[3]}" for r in rows]


def _version(engine: dict) -> str:
    """The newest version the engine answered with; else the one it began serving with."""
    served = (engine.get("served") or {}).get("max_version")
    if served is not None:
        return str(served)
    return "-" if engine.get("version") is None else f"{engine['version']} (joined)"


def _ago(at) -> str:
    return "at an unknown time" if not at else f"{max(0.0, time.time() - float(at)):.0f} s ago"


COMMANDS = [
    Command("engines", "a run's engine fleet: `engines add|remove RUN_URI N` changes its size while it runs, "
                       "`engines show RUN_URI` shows it", _engines),
]
