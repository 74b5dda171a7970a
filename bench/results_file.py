"""The results file every benchmark writes beside what it prints (docs/benchmarks.md, "Results files").

One schema for all of them:

    {"bench": "engine", "version": 1, "started_at": "2026-12-01T10:00:00+00:00", "seconds": 81.2,
     "machine": {"cpus": 2, "platform": "Linux-...", "python": "3.12.3"},
     "config": {flag: value, ...},                 # every flag the run was given (argparse dest names)
     "figures": {name: number | str | null, ...},  # the headline numbers the docs quote, ratios included
     "rows": [{...}, ...],                         # every measurement behind them, one dict each
     "notes": ["..."]}                             # optional: what a reader must know (a converted file)

Non-finite floats are written as null, so the file is strict JSON. The default path is
bench/results/<bench>.json; `--results PATH` writes elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import datetime, timezone

VERSION = 1
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
KEYS = ("bench", "version", "started_at", "seconds", "machine", "config", "figures", "rows")  # "notes" optional


def default_path(bench: str) -> str:
    return os.path.join(RESULTS_DIR, f"{bench}.json")


def add_results_flag(parser: argparse.ArgumentParser, bench: str, default: str | None = "") -> None:
    """`--results PATH`; the default is bench/results/<bench>.json unless `default` says otherwise."""
    parser.add_argument("--results", default=default_path(bench) if default == "" else default,
                        help=f"write the figures as JSON here (default: bench/results/{bench}.json)")


class ResultsFile:
    """Started when the bench starts (the timestamp and wall time are the run's), written once at its end."""

    def __init__(self, bench: str, config: dict):
        self.bench, self.config = bench, dict(config)
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.t0 = time.monotonic()

    def record(self, figures: dict, rows: list[dict]) -> dict:
        return {"bench": self.bench, "version": VERSION, "started_at": self.started_at,
                "seconds": time.monotonic() - self.t0, "machine": machine(), "config": self.config,
                "figures": figures, "rows": rows}

    def write(self, path: str | None, figures: dict, rows: list[dict]) -> dict:
        """Write the record to `path` (nothing when it is empty or None) and return it."""
        record = self.record(figures, rows)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(finite(record), f, indent=1, allow_nan=False)
                f.write("\n")
            print(f"figures written to {path}", flush=True)
            if os.path.dirname(os.path.abspath(path)) == RESULTS_DIR:
                print("docs/benchmarks.md quotes them: render it with `.venv/bin/python bench/figures.py`", flush=True)
        return record


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def finite(x):
    """`x` with every NaN or infinity replaced by None, recursively (JSON has no such numbers)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def read(path: str) -> dict | None:
    """A results file, or None when there is none at `path`."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
