"""The first lines of a run (`miles_core.driver.plan`, printed by the workflow's first task `plan`).

Pins: a new run says its steps, run root, report location and an estimate on this machine; a
resumed one says where it resumes and estimates from the step times it recorded (or, new, from
another run of the same shape under the storage root); a finished one says it finished and gives
the command that trains it further (the same flags and inputs, a larger --num-rollout), which
parses back to the run's config with only --num-rollout raised. Guards: a rerun of a finished run
that only prints the report path, and a first screen that says nothing of what will happen.
"""

from __future__ import annotations

import shlex

import pytest

from miles_core.config import parse_flags
from miles_core.driver.plan import describe_plan, rerun_command
from miles_core.metrics.names import STEP_SECONDS
from miles_core.metrics.sink import MetricsSink
from miles_core.storage import StorageError, Store
from miles_core.storage.run_root import FINISHED, SEGMENT_DONE, require_first_config, write_config, write_status


def _cfg(tmp_path, *flags: str, run_id: str = "x"):
    return parse_flags(["--preset", "tiny-reverse4", "--storage-root", str(tmp_path), "--run-id", run_id, *flags], check=False)


def _recorded(cfg, steps: int, step_seconds: float, startup: float) -> None:
    """A first segment that wrote its config, then trained `steps` steps of `step_seconds` each."""
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    t0 = store.get_json("config.json")["written_at"] + startup
    with MetricsSink(store, "trainer", background=False) as sink:
        for step in range(steps):
            sink.log(step, {STEP_SECONDS: step_seconds}, wall_time=t0 + (step + 1) * step_seconds)
    write_status(store, SEGMENT_DONE, last_step=steps - 1, segment=0)


def test_a_new_run_says_steps_run_root_report_and_time(tmp_path):
    lines = describe_plan(_cfg(tmp_path)).splitlines()
    assert lines[0].startswith("[miles] a new run: steps 0..159 of --num-rollout 160 (fully-async driver")
    assert lines[1] == f"[miles] run root: {tmp_path}/runs/x"
    assert lines[2].startswith(f"[miles] report: {tmp_path}/runs/x/report.html when the run ends")
    assert lines[3].startswith("[miles] about 2 min on this machine") and "0.55 s per step + 35 s start-up" in lines[3]
    assert "steps 0..19 of --num-rollout 160" in describe_plan(_cfg(tmp_path, "--segment-steps", "20"))
    half = describe_plan(_cfg(tmp_path, "--rollout-batch-size", "16"))
    assert "0.28 s per step" in half  # scaled to the batch


def test_a_model_without_a_reference_gives_no_made_up_time(tmp_path):
    plan = describe_plan(_cfg(tmp_path, "--hf-checkpoint", "s3://b/m", "--engine-backend", "sglang"))
    assert "time: unknown until the first steps" in plan


def test_a_resumed_run_estimates_from_its_own_step_times(tmp_path):
    cfg = _cfg(tmp_path)
    _recorded(cfg, 10, 2.0, startup=30.0)
    plan = describe_plan(cfg)
    assert "resuming after step 9 (segment 1): steps 10..159" in plan
    assert "2.00 s per step + 30 s start-up, from the step times recorded in" in plan and "about 6 min" in plan


def test_a_new_run_estimates_from_another_run_of_the_same_shape(tmp_path):
    _recorded(_cfg(tmp_path, run_id="earlier"), 4, 1.5, startup=20.0)
    _recorded(_cfg(tmp_path, "--rollout-batch-size", "8", run_id="other-shape"), 4, 9.0, startup=20.0)
    plan = describe_plan(_cfg(tmp_path))
    assert f"1.50 s per step + 20 s start-up, from the step times recorded in {tmp_path}/runs/earlier" in plan


def test_a_resumed_run_whose_config_json_does_not_parse_is_refused_by_name(tmp_path):
    """The plan and the segment refuse to continue over a damaged config.json, naming it and the fix; another
    run under the same storage root still plans (its estimate skips that run)."""
    cfg = _cfg(tmp_path, run_id="damaged")
    _recorded(cfg, 4, 1.5, startup=20.0)
    Store(cfg.run_uri).put_bytes("config.json", b"\x00 garbage {")
    with pytest.raises(StorageError, match=r"runs/damaged/config\.json is not valid JSON.*Restore it from a backup"):
        describe_plan(cfg)
    with pytest.raises(StorageError, match=r"config\.json.*miles doctor"):
        require_first_config(Store(cfg.run_uri))
    assert "a new run: steps 0..159" in describe_plan(_cfg(tmp_path, run_id="new"))


def test_a_finished_run_says_so_and_how_to_continue(tmp_path):
    flags = "--num-rollout=6 --eval-interval 2 --lr 1e-3"
    cfg = _cfg(tmp_path, *shlex.split(flags))
    write_status(Store(cfg.run_uri), FINISHED, last_step=5, segment=0)
    plan = describe_plan(cfg, flags, {"run_id": "x", "storage_root": str(tmp_path), "segment_steps": ""})
    assert f"run {tmp_path}/runs/x already finished: 6 of --num-rollout 6 steps trained; nothing to train." in plan
    command = next(line.strip() for line in plan.splitlines() if line.strip().startswith("pyflyte run"))
    words = shlex.split(command)
    assert words[:4] == ["pyflyte", "run", "workflows/fully_async.py", "fully_async_rl"]
    inputs = dict(zip(words[4::2], words[5::2]))
    again = parse_flags(["--preset", "tiny-reverse4", *shlex.split(inputs["--flags"]) + ["--storage-root", inputs["--storage_root"],
                                                           "--run-id", inputs["--run_id"]]], check=False)
    assert again.run.num_rollout == 12 and again.eval.eval_interval == 2 and again.train.lr == 1e-3
    assert "miles runs show" in plan and "report.html" in plan


def test_rerun_command_replaces_either_spelling_of_num_rollout():
    assert "--flags '--seed 3 --num-rollout 9'" in rerun_command("--num-rollout 4 --seed 3", {}, 9)
    assert "--flags '--seed 3 --num-rollout 9'" in rerun_command("--seed 3 --num-rollout=4", {}, 9)


def test_the_plan_task_prints_first_and_returns_the_text(tmp_path, capsys):
    from tasks.plan import plan

    text = plan(flags="--preset tiny-reverse4 --num-rollout 3", run_id="t", storage_root=str(tmp_path), segment_steps=0)
    assert "steps 0..2 of --num-rollout 3" in text and text in capsys.readouterr().err


def test_a_pretrained_model_with_toy_settings_is_warned_about_in_the_first_lines(tmp_path):
    plan = describe_plan(_cfg(tmp_path, "--hf-checkpoint", str(tmp_path), "--lr", "0.002"))
    warnings = [line for line in plan.splitlines() if "warning" in line]  # the preset's lr, length, micro-batch
    assert len(warnings) == 3 and all(w.startswith("[miles] warning: --") for w in warnings)
    assert warnings[0].startswith("[miles] warning: --lr 0.002 on a pretrained model")
    assert "warning" not in describe_plan(_cfg(tmp_path))  # the tiny builtin model is the toy
