"""Every flag does what it says or is refused (docs/real-model.md, issue 13 item 5).

Enumerates `flag_table()` and proves, for each flag, one of:
- read: its field is read as an attribute (`x.<name>`, or `getattr(x, "<name>")`) by code outside
  miles_core/config/ and the docs generator, i.e. by the code that runs (miles_core/, tasks/,
  workflows/); a field read only by a `RunConfig` property (tree.py) counts when that property is
  itself read there;
- refused: set to a value other than its default, validation refuses it with "not supported" and
  the flag's name, under the fully async driver and the sync driver alike.
A flag that is neither was accepted and ignored: implement it or refuse it in validate.py.
The scan matches attribute names, not their objects: a field named like an unrelated attribute
(e.g. `save`) could pass as read, so the refused flags are also pinned by name below.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from miles_core.config import ConfigError, RunConfig, embedded_default, replace_fields
from miles_core.config.tree import FlagSpec, flag_table
from miles_core.prepare.checks import validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNTIME_DIRS = ("miles_core", "tasks", "workflows")
NOT_RUNTIME = ("miles_core/config/", "miles_core/docs_gen")
TREE = ROOT / "miles_core" / "config" / "tree.py"


def _attribute_reads(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            names.add(str(node.args[1].value))
    return names


def _runtime_reads() -> set[str]:
    names = set()
    for d in RUNTIME_DIRS:
        for path in (ROOT / d).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(NOT_RUNTIME):
                names |= _attribute_reads(ast.parse(path.read_text(), rel))
    return names


def _property_reads() -> dict[str, set[str]]:
    """RunConfig's derived properties -> the attribute names each reads."""
    cls = next(n for n in ast.parse(TREE.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    return {f.name: _attribute_reads(f) for f in cls.body
            if isinstance(f, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "property"
                                                      for d in f.decorator_list)}


@pytest.fixture(scope="module")
def read_names() -> set[str]:
    names = _runtime_reads()
    for prop, reads in _property_reads().items():
        if prop in names:
            names |= reads
    return names


def _other_value(s: FlagSpec):
    """A valid-typed value other than the default."""
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.kind == "bool":
        return not s.default
    if s.kind == "int":
        return (s.default or 0) + 2
    if s.kind == "float":
        return (s.default or 0.0) + 0.5
    if s.kind == "list":
        return ["x=builtin:copy4"]
    return "builtins:print" if s.name.endswith("_path") else (s.default or "") + "x"


def _refusal(s: FlagSpec, **driver) -> str:
    """The validation lines that refuse `s` set to another value ('' if none says "not supported")."""
    cfg = replace_fields(embedded_default(), **driver, **{s.name: _other_value(s)})
    try:
        validate(cfg)
    except ConfigError as e:
        return "\n".join(line for line in str(e).splitlines() if s.flag in line and "not supported" in line)
    return ""


FLAGS = flag_table()


# Applied by the parser itself (it expands into other flags): proven by what it changes.
APPLIED_AT_PARSE = {"preset"}


# Read by config.rules functions the trainer calls (moe_aux_loss_coeff picks the aux loss from the
# type), or meaning what the trainer always does (the router runs in fp32; fp64 is refused by name).
READ_THROUGH_RULES = {"moe_router_load_balancing_type", "moe_router_dtype"}


def _checked_against_model(s: FlagSpec) -> bool:
    """A --moe-* flag that describes the model is checked against the checkpoint's config.json
    (config.rules.moe_flag_problems, run by validation and the trainer): set on a dense model it is
    refused, naming the flag; set on a MoE model it must equal the checkpoint's value."""
    from miles_core.config.rules import moe_flag_problems
    from miles_core.models.builtin import builtin_config
    from miles_core.models.families import spec_of

    if s.name in READ_THROUGH_RULES:
        return True
    if not s.flag.startswith("--moe-"):
        return False
    train = replace_fields(RunConfig(), **{s.name: _other_value(s)}).train
    for model in ("builtin:tiny-llama", "builtin:tiny-qwen3-moe"):
        if any(s.flag in p for p in moe_flag_problems(spec_of(builtin_config(model, 2, 128, 4)), train)):
            return True
    return False


@pytest.mark.parametrize("spec", FLAGS, ids=[s.flag for s in FLAGS])
def test_every_flag_is_read_or_refused(spec, read_names, tmp_path):
    """Pins: no flag is validated and then ignored. Guards: a flag added to sections.py that
    nothing reads (users would believe it works)."""
    if spec.name in read_names or _checked_against_model(spec):
        return
    if spec.name in APPLIED_AT_PARSE:
        from miles_core.config import parse_flags

        assert parse_flags([spec.flag, _other_value(spec)], check=False) != parse_flags([], check=False)
        return
    if spec.name == "custom_config_path":  # its file's keys are set at parse
        from miles_core.config import parse_flags

        (tmp_path / "settings.yaml").write_text("lr: 0.5\n")
        assert parse_flags([spec.flag, str(tmp_path / "settings.yaml")], check=False).train.lr == 0.5
        return
    for driver in ({}, {"fully_async": False}):
        assert _refusal(spec, **driver), (
            f"{spec.flag} is neither read outside miles_core/config/ nor refused with 'not supported' "
            f"when set (driver overrides {driver}): implement it or refuse it in miles_core/config/rules.py and miles_core/prepare/checks.py")


REFUSED = ["colocate", "partial_rollout", "multi_lora", "prefill_logprob_recompute", "rollout_function_path",
           "rollout_all_samples_process_path", "pipeline_model_parallel_size", "context_parallel_size"]


@pytest.mark.parametrize("name", REFUSED)
def test_known_unsupported_flags_are_refused_under_every_driver(name):
    """Pins: the miles flags the project does not implement are refused by name with "not
    supported" under the fully async, sync and one-step-off drivers (issue 13 item 5)."""
    spec = next(s for s in FLAGS if s.name == name)
    for driver in ({}, {"fully_async": False}, {"fully_async": False, "one_step_off": True}):
        assert _refusal(spec, **driver), f"{spec.flag} not refused under {driver}"


def test_ppo_is_refused_at_validation_not_in_the_trainer():
    """Pins: --advantage-estimator=ppo (a critic) is refused before any cluster starts, under every
    driver; it used to validate and then fail inside the trainer."""
    for driver in ({}, {"fully_async": False}):
        with pytest.raises(ConfigError, match="--advantage-estimator=ppo is not supported"):
            validate(replace_fields(embedded_default(), advantage_estimator="ppo", use_rollout_logprobs=False, **driver))


def test_the_scan_sees_reads(read_names):
    """Guards the scan itself: fields known to be read are found (directly and via a property)."""
    assert {"rollout_batch_size", "lr", "micro_batch_size"} <= read_names
    # via the budget_groups, driver and run_uri properties
    assert {"async_max_concurrent_samples", "one_step_off", "run_id"} <= read_names
    assert not {"colocate", "multi_lora"} & read_names
