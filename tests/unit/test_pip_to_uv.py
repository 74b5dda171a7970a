"""`./dev setup` installs with uv given pip's configuration (images/pip_to_uv.py), else with pip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from images.pip_to_uv import UnsupportedSetting, uv_args

ROOT = Path(__file__).resolve().parents[2]

THIS_MACHINE = """global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
"""


def test_pip_s_indexes_links_and_constraints_become_uv_s_arguments():
    assert uv_args(THIS_MACHINE) == [
        "--index-strategy", "unsafe-best-match",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels", "--find-links", "/opt/wheels"]


def test_no_configuration_keeps_pip_s_choice_of_the_best_version_over_indexes():
    assert uv_args("") == ["--index-strategy", "unsafe-best-match"]
    assert uv_args("install.index-url='https://mirror.example/simple'\n") == [
        "--index-strategy", "unsafe-best-match", "--index-url", "https://mirror.example/simple"]


def test_a_setting_uv_is_not_given_makes_dev_install_with_pip():
    with pytest.raises(UnsupportedSetting, match="global.proxy"):
        uv_args("global.proxy='http://proxy:3128'\n")


def test_dev_pins_the_uv_of_the_test_set():
    dev = re.search(r'^UV_PIN="(uv==[^"]+)"', (ROOT / "dev").read_text(), re.M).group(1)
    assert f'"{dev}"' in (ROOT / "pyproject.toml").read_text()
    assert dev in (ROOT / "requirements.lock").read_text().splitlines()
