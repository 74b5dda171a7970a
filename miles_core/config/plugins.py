"""Extension points loaded by dotted path (`module:attr`), one loader for every `--*-path` flag.

Every slot is resolved in `validate`, before any cluster starts, so a typo fails at start-up
with the flag's name, never as a bare ModuleNotFoundError inside a worker.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


class PluginError(ValueError):
    """A `--*-path` flag that does not resolve to a usable object."""

    def __init__(self, message: str):
        super().__init__(message)


# flag -> what the object must be (the contract named in the error message)
PLUGIN_SLOTS: dict[str, str] = {
    "--custom-rm-path": "a function (sample) -> float, or async; or (samples: list) -> list[float] with attribute batched=True",
    "--dynamic-sampling-filter-path": "a function (group) -> (keep: bool, reason: str)",
    "--rollout-sample-filter-path": "a function (groups) -> None that sets sample.loss_mask entries to 0 (mark only)",
    "--custom-generate-function-path": "async def fn(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]",
    "--custom-async-data-buffer-path": "a class built as Class(config, unused_samples_handler) with put/get/get_metrics",
    "--custom-tis-function-path": "a function (args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
                                  "**kwargs) -> (pg_loss, loss_masks, metrics)",
}
# (--rollout-function-path and --rollout-all-samples-process-path are miles flags this project does
# not implement: validation refuses them as "not supported" and nothing loads them.)


# miles' paths of the corrections miles_core.train.corrections builds in -> theirs there (a miles command
# line is accepted as it is; resolved here so that validation never imports torch)
MILES_CORRECTION_PATHS = {
    "miles.backends.training_utils.loss_hub.corrections.vanilla_tis_function": "vanilla_tis_function",
    "miles.backends.training_utils.loss_hub.corrections.icepop_function": "icepop_function",
    "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp": "compute_mis_weights_with_cp",
    "examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_fsdp": "compute_mis_weights_fsdp",
}
CORRECTIONS_MODULE = "miles_core.train.corrections"


def correction_path(path: str) -> str:
    """--custom-tis-function-path in the loader's `module:attr` form: miles' paths of the built-in
    corrections mapped to CORRECTIONS_MODULE, a dotted `module.attr` (miles' spelling) split at its
    last dot."""
    if path in MILES_CORRECTION_PATHS:
        return f"{CORRECTIONS_MODULE}:{MILES_CORRECTION_PATHS[path]}"
    if ":" not in path and "." in path:
        module, _, attr = path.rpartition(".")
        return f"{module}:{attr}"
    return path


def load_plugin(path: str, flag: str, required_methods: tuple[str, ...] = ()) -> Any:
    """Import `module:attr` for `flag`. Raises PluginError naming the flag and the expected shape."""
    contract = PLUGIN_SLOTS.get(flag, "a callable")
    if path.count(":") != 1 or not all(path.split(":")):
        raise PluginError(f"{flag}={path!r}: expected 'module:attr' (one colon), pointing at {contract}.")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # The module itself (or a parent package) is missing, vs. a missing import inside it:
        # compare whole dotted names, so module 'foobar' importing a missing 'foo' is not "not importable".
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise PluginError(f"{flag}={path!r}: module {module_name!r} is not importable ({e}). "
                              "Is it installed or on PYTHONPATH?") from e
        raise PluginError(f"{flag}={path!r}: importing {module_name!r} failed inside the module: {e!r}") from e
    except Exception as e:
        raise PluginError(f"{flag}={path!r}: importing {module_name!r} raised {e!r}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{flag}={path!r}: module {module_name!r} has no attribute {attr!r}; "
                              f"expected {contract}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{flag}={path!r}: {attr!r} is not callable; expected {contract}.")
    missing = [m for m in required_methods if not callable(getattr(obj, m, None))]
    if missing:
        raise PluginError(f"{flag}={path!r}: {attr!r} lacks method(s) {missing}; expected {contract}.")
    return obj


def load_optional(path: str, flag: str, required_methods: tuple[str, ...] = ()) -> Callable | None:
    return load_plugin(path, flag, required_methods) if path else None
