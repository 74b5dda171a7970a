"""Checks that need a fresh Python process: the console scripts as a user runs them, what a cold
import pulls in, and what a process prints on its own (tests/unit is one process).
"""

from __future__ import annotations

from images import gpu_image
from miles_core.config import config_from_json, embedded_default, parse_flags
from tests.support.timeouts import SLOW_COMMAND_SECONDS
from tests.unit.test_cli import _run_script


def test_script_validate_conflict_exits_2_naming_both_flags():
    """Pins: `miles validate --fully-async --colocate` exits 2 and names both flags on stderr, no traceback.
    Guards: a stack trace or exit 1 as the answer to a bad config (§14)."""
    proc = _run_script("validate", "--preset", "tiny-reverse4", "--fully-async", "--colocate")
    assert proc.returncode == 2
    assert "--fully-async" in proc.stderr and "--colocate" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_script_validate_of_the_preset_prints_the_embedded_default_and_no_args_names_what_is_required():
    """Pins: `miles validate --preset tiny-reverse4` exits 0 and prints JSON that round-trips into the
    embedded default; with no args it exits 2 naming the flags miles requires and the preset.
    Guards: the embedded default drifting from what the CLI reports; a run of nothing accepted."""
    proc = _run_script("validate", "--preset", "tiny-reverse4")
    assert proc.returncode == 0, proc.stderr
    assert config_from_json(proc.stdout) == embedded_default() == parse_flags(["--preset", "tiny-reverse4"])
    proc = _run_script("validate")
    assert proc.returncode == 2 and "--hf-checkpoint" in proc.stderr and "--preset tiny-reverse4" in proc.stderr


def test_images_carry_the_whole_source_not_only_what_registration_imported():
    """flytekit's default (`--copy auto`, ImageSpec's LOADED_MODULES) carries only the modules that
    registration imported; the tasks import most of miles_core when they run (the driver, the
    trainer, the engine server processes). Guards: an image or a `pyflyte run --remote` bundle that
    fails on the cluster with ModuleNotFoundError."""
    import json
    import pkgutil
    import subprocess
    import sys

    from flytekit.constants import CopyFileDetection

    import miles_core
    from images import cpu_image

    code = ("import json, sys, workflows.fully_async, workflows.eval_backfill, workflows.schedules; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('miles_core.'))))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout.strip().splitlines()[-1]))
    every = {m.name for m in pkgutil.walk_packages(miles_core.__path__, "miles_core.")}
    assert "miles_core.driver.segment" in every - loaded  # registration alone would leave the driver out
    assert cpu_image.source_copy_mode == gpu_image.source_copy_mode == CopyFileDetection.ALL


def test_the_logit_chunk_is_the_trainers():
    """prepare.memory repeats token_logprobs' chunk size so that validation never imports torch."""
    import subprocess
    import sys

    from miles_core.prepare import memory
    from miles_core.train import token_logprobs

    assert memory.CHUNK_BYTES == token_logprobs.CHUNK_BYTES
    code = "import sys, miles_core.cli, miles_core.prepare.checks; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_checking_the_embedded_default_and_driving_it_import_no_model_library():
    """`miles validate` and the plan task answer in a fraction of a second, and the driver stays light:
    torch, transformers and Megatron cost seconds of CPU to import (each trainer rank imports them
    itself; the driver importing torch with the ranks' actor class cost 3 CPU-seconds a run, and the
    rollout side importing it for the advantages of each batch as much)."""
    import subprocess
    import sys

    code = ("import sys; from miles_core.config import parse_flags; "
            "from miles_core.prepare.checks import validation_problems; "
            "assert validation_problems(parse_flags(['--preset', 'tiny-reverse4'])) == []; "
            "import miles_core.driver.segment, miles_core.train.worker; "  # the driver defines the trainer's actor class
            "import miles_core.rollout.manager; from miles_core.rank_batches import trainable_samples; "
            "from miles_core.samples import Group, Sample, SampleStatus; "  # the rollout side's advantages
            "trainable_samples([Group('g', 0, [Sample('g', 0, j, [1], [2], reward=float(j), "
            "status=SampleStatus.COMPLETED) for j in range(2)])]); "
            "print(sorted(m for m in ('torch', 'transformers', 'megatron.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_megatron_fallback_warnings_are_quiet_on_cpu_and_nothing_else_is():
    """Importing the trainer under `-W always` (every warning shown) prints none of Megatron's
    Transformer Engine / Apex fallback warnings on a CPU machine; a warning of any other text, and
    Megatron's other import-time warnings, still show."""
    import subprocess
    import sys

    code = ("import warnings\n"
            "import miles_core.train.megatron_model, miles_core.train.trainer\n"
            "import megatron.core.optimizer, megatron.core.models.backends\n"
            "warnings.warn('Apex is almost installed (another warning)', UserWarning)\n")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                          timeout=SLOW_COMMAND_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not installed" not in proc.stderr, proc.stderr[-3000:]
    assert "Apex is almost installed (another warning)" in proc.stderr
    baseline = subprocess.run([sys.executable, "-W", "always", "-c", "import megatron.core.optimizer"],
                              capture_output=True, text=True, timeout=SLOW_COMMAND_SECONDS)
    assert "Transformer Engine and Apex are not installed" in baseline.stderr  # what the filter hides
