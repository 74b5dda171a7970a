"""The driver's roles are typed clients, and a type checker reads them in CI.

`mypy` runs as configured in pyproject.toml ([tool.mypy]: the driver package and what it calls in
miles_core, third-party packages not read: a cold check takes 3 s, where following them took 9 s
on a 2-core machine). The two checks share one cache, as a developer's repeated runs do. Pins: the
driver type-checks clean, and the same check fails on a role called by a method that does not exist
or with an argument of the wrong type, so a renamed role method cannot hide behind a string or an
`Any`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]

BAD_CALLER = '''
from miles_core.driver.clients import RolloutClient
from miles_core.driver.placement import TrainerGroup


def misuse(rollout: RolloutClient, trainer: TrainerGroup) -> None:
    rollout.next_train_batchh(3)          # no such method
    trainer.train_parts("step", [])      # a step is an int
'''


def _mypy(*args: str, cache: Path) -> tuple[str, int]:
    out, err, code = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache), *args])
    return out + err, code


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def test_the_driver_type_checks(cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    report, code = _mypy(cache=cache)
    assert code == 0, report


def test_the_type_checker_catches_a_misnamed_role_call(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = tmp_path / "bad_caller.py"
    bad.write_text(BAD_CALLER)
    report, code = _mypy(str(bad), cache=cache)
    assert code == 1, report
    assert '"RolloutClient" has no attribute "next_train_batchh"' in report, report
    assert 'Argument 1 to "train_parts" of "TrainerGroup" has incompatible type "str"' in report, report
