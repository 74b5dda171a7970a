"""Plugin resolution in validate (STYLE c): every `--*-path` flag is imported before anything starts,
and the three ways it can fail read differently, each naming the flag.

Plugin modules are written to a temporary directory on sys.path with a unique name per test, so an
import cached in sys.modules by one test never answers for another.
"""

from __future__ import annotations

import textwrap
import uuid

import pytest

from miles_core.config import ConfigError, RunConfig, embedded_default, replace_fields
from miles_core.config.plugins import PLUGIN_SLOTS, PluginError, load_plugin
from miles_core.prepare.checks import validate

# (field, flag) of every slot validate resolves.
SLOTS = [
    ("custom_rm_path", "--custom-rm-path"),
    ("dynamic_sampling_filter_path", "--dynamic-sampling-filter-path"),
    ("rollout_sample_filter_path", "--rollout-sample-filter-path"),
    ("custom_async_data_buffer_path", "--custom-async-data-buffer-path"),
    ("custom_generate_function_path", "--custom-generate-function-path"),
    ("custom_tis_function_path", "--custom-tis-function-path"),
]
# the object each slot's good plugin names in GOOD_MODULE
GOOD_ATTR = {"custom_async_data_buffer_path": "Buffer", "custom_generate_function_path": "episode"}
# `*_path` flags of miles that this project refuses as "not supported" (tests/unit/test_flags_read.py):
# nothing loads them, so they are no plugin slots.
REFUSED_PATHS = {"--rollout-function-path", "--rollout-all-samples-process-path"}
# `*_path` flags that name no code: --custom-config-path is a YAML file read at parse (test_corrections.py)
FILE_PATHS = {"--custom-config-path"}
# what a slot's plugin needs beside it to be called (a correction runs only with --use-tis)
COMPANIONS = {"custom_tis_function_path": {"use_tis": True, "use_rollout_logprobs": False}}

GOOD_MODULE = """
def fn(*args, **kwargs):
    return None

class Buffer:
    def __init__(self, config, unused_samples_handler): pass
    def put(self, group): pass
    def get(self, **context): pass
    def get_metrics(self): return {}

class HalfBuffer:
    def put(self, group): pass

async def episode(args, sample, sampling_params):
    return sample

NOT_CALLABLE = 3
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """Writes a module with the given source under a unique name; returns the module name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str, name: str | None = None) -> str:
        name = name or f"miles_test_plugin_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def _config_with(field: str, path: str) -> RunConfig:
    return replace_fields(embedded_default(), **{field: path, **COMPANIONS.get(field, {})})


def _error(field: str, path: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(_config_with(field, path))
    return str(info.value)


@pytest.mark.parametrize("field,flag", SLOTS)
def test_slot_resolves_valid_plugin(field, flag, plugin_module):
    """Pins: a well-formed `module:attr` passes validate for every slot.
    Guards: a slot whose resolution rejects a correct plugin."""
    mod = plugin_module(GOOD_MODULE)
    attr = GOOD_ATTR.get(field, "fn")
    validate(_config_with(field, f"{mod}:{attr}"))


@pytest.mark.parametrize("field,flag", SLOTS)
def test_module_not_importable_names_flag(field, flag):
    """Pins: a module that does not exist says 'not importable', names the flag and keeps the cause.
    Guards: a bare ModuleNotFoundError from a worker after the GPUs are allocated (slime)."""
    missing = f"no_such_module_{uuid.uuid4().hex[:8]}"
    message = _error(field, f"{missing}:fn")
    assert flag in message and "not importable" in message and missing in message


@pytest.mark.parametrize("field,flag", SLOTS)
def test_missing_attribute_names_flag_and_contract(field, flag, plugin_module):
    """Pins: an importable module without the attribute says 'no attribute', names the flag and the
    expected signature. Guards: conflating a typo in the attribute with a missing module."""
    mod = plugin_module(GOOD_MODULE)
    message = _error(field, f"{mod}:nope")
    assert flag in message and "has no attribute 'nope'" in message
    assert PLUGIN_SLOTS[flag] in message
    assert "not importable" not in message


@pytest.mark.parametrize("field,flag", SLOTS)
def test_broken_import_inside_module(field, flag, plugin_module):
    """Pins: a module that exists but fails on a missing dependency of its own says the import failed
    inside the module (naming the missing dependency), not that the module is missing.
    Guards: torchtitan's swallowed ImportError that blames the user's module name (STYLE d)."""
    mod = plugin_module("import dependency_that_is_not_installed_xyz\ndef fn(): pass\n")
    message = _error(field, f"{mod}:fn")
    assert flag in message and "inside the module" in message
    assert "dependency_that_is_not_installed_xyz" in message
    assert "not importable" not in message


def test_broken_import_whose_name_prefixes_module(plugin_module):
    """Pins: module `foobar` importing a missing `foo` is a broken import inside `foobar`.
    Guards: the prefix test `module_name.startswith(e.name)` that misreported it as 'not importable'."""
    dep = f"dep{uuid.uuid4().hex[:6]}"
    mod = plugin_module(f"import {dep}\ndef fn(): pass\n", name=f"{dep}_plugin")
    with pytest.raises(PluginError) as info:
        load_plugin(f"{mod}:fn", "--custom-rm-path")
    assert "inside the module" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_submodule_of_existing_package_is_not_importable():
    """Pins: `json.nope:fn` (package exists, submodule does not) is 'not importable'.
    Guards: the dotted-name comparison after the prefix fix."""
    with pytest.raises(PluginError, match="not importable"):
        load_plugin("json.nope_xyz:fn", "--custom-rm-path")


def test_exception_while_importing(plugin_module):
    """Pins: a module raising at import time is reported with the exception, naming the flag, cause chained.
    Guards: a crash with a stack trace as the only answer to a bad plugin (§14)."""
    mod = plugin_module("raise RuntimeError('boom at import')\n")
    with pytest.raises(PluginError) as info:
        load_plugin(f"{mod}:fn", "--custom-rm-path")
    assert "--custom-rm-path" in str(info.value) and "boom at import" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("path", ["mod.fn", "mod:fn:extra", ":fn", "mod:", ""])
def test_one_spelling_module_colon_attr(path):
    """Pins: only `module:attr` is accepted (docs/data-path.md); other spellings name the expected form.
    Guards: AReaL-style multi-form resolution creeping in."""
    with pytest.raises(PluginError, match="expected 'module:attr'"):
        load_plugin(path, "--custom-rm-path")


def test_not_callable_and_missing_methods(plugin_module):
    """Pins: the object is checked against its slot's protocol (callable; buffer methods).
    Guards: a plugin that resolves but fails on first use inside a worker."""
    mod = plugin_module(GOOD_MODULE)
    assert "is not callable" in _error("custom_rm_path", f"{mod}:NOT_CALLABLE")
    message = _error("custom_async_data_buffer_path", f"{mod}:HalfBuffer")
    assert "--custom-async-data-buffer-path" in message and "get_metrics" in message


def test_dotted_attribute_and_all_plugin_errors_reported_together(plugin_module):
    """Pins: `module:Class.attr` resolves, and several bad plugins are all listed in one error.
    Guards: plugin errors stopping validation at the first bad slot."""
    mod = plugin_module(GOOD_MODULE)
    assert load_plugin(f"{mod}:Buffer.put", "--custom-rm-path") is not None
    cfg = replace_fields(embedded_default(), custom_rm_path="nomod_abc:fn", dynamic_sampling_filter_path=f"{mod}:nope")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "--custom-rm-path" in str(info.value) and "--dynamic-sampling-filter-path" in str(info.value)


def test_every_path_flag_is_a_known_slot():
    """Pins: every `*_path` field has a contract in PLUGIN_SLOTS and is resolved by validate.
    Guards: a new `--*-path` flag that is imported lazily in a worker instead (STYLE c)."""
    from miles_core.config import flag_table

    path_flags = {s.flag for s in flag_table() if s.name.endswith("_path")} - REFUSED_PATHS - FILE_PATHS
    assert path_flags == set(PLUGIN_SLOTS)
    assert path_flags == {flag for _, flag in SLOTS}
