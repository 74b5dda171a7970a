"""The Flyte layer (tasks/, workflows/, images/; docs/deployment.md).

Pins: `pyflyte package` and `pyflyte register --copy none --dry-run` succeed offline and the
packaged train and producer tasks are Ray tasks; locally a Ray task starts its Ray instance without
the dashboard; prepare_data is cached; every workflow input has an immutable
default (`pyflyte run ... fully_async_rl --flags "--preset tiny-reverse4"` needs no other input); the typed inputs and
`flags` combine without silent overrides; the Arrow StructuredDataset decoder reads from S3
(regression guard for flyte#5859); and, slow, the workflows run locally end to end with stand-in
driver/eval bodies (the real ones are exercised by the e2e tests).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from tests.support.timeouts import RUN_SECONDS, SLOW_COMMAND_SECONDS

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
PREBUILT = {"MILES_CPU_IMAGE": "ghcr.io/miles-flyte/test-cpu:ci", "MILES_GPU_IMAGE": "ghcr.io/miles-flyte/test-gpu:ci"}


def _pyflyte(args: list[str], env_extra: dict | None = None, timeout: int = SLOW_COMMAND_SECONDS) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    env.pop("FLYTECTL_CONFIG", None)
    proc = subprocess.run([PYFLYTE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"pyflyte {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _unpack(tgz: Path, into: Path) -> dict[str, Path]:
    with tarfile.open(tgz) as tar:
        tar.extractall(into, filter="data")
    return {Path(p).name: Path(p) for p in glob.glob(str(into / "*.pb"))}


def _task_spec(path: Path):
    from flyteidl.admin import task_pb2

    spec = task_pb2.TaskSpec()
    spec.ParseFromString(path.read_bytes())
    return spec.template


def _find(files: dict[str, Path], suffix: str) -> Path:
    hits = [p for name, p in files.items() if name.split("_", 1)[1].startswith(suffix)]
    assert len(hits) == 1, (suffix, sorted(files))
    return hits[0]


# ----------------------------------------------------------------------------- packaging


def test_package_offline_train_is_ray(tmp_path):
    out = tmp_path / "flyte-package.tgz"
    _pyflyte(["--pkgs", "workflows", "package", "--image", "ghcr.io/miles-flyte/default:ci", "-o", str(out), "--force"],
             PREBUILT)
    files = _unpack(out, tmp_path / "x")
    train = _task_spec(_find(files, "tasks.train.train_"))
    assert train.type == "ray"
    assert train.container.image == PREBUILT["MILES_GPU_IMAGE"]
    from google.protobuf.json_format import MessageToDict

    cluster = MessageToDict(train.custom)["rayCluster"]
    assert cluster["workerGroupSpec"][0]["groupName"] == "gpu"
    assert MessageToDict(train.custom)["shutdownAfterJobFinishes"] is True
    producer = _task_spec(_find(files, "tasks.producer.rollout_producer_"))
    assert producer.type == "ray" and MessageToDict(producer.custom)["rayCluster"]["workerGroupSpec"][0]["groupName"] \
        == "rollout"

    prep = _task_spec(_find(files, "tasks.data.prepare_data_"))
    assert prep.type == "python-task" and prep.metadata.discoverable and prep.metadata.discovery_version == "1"
    assert prep.container.image == PREBUILT["MILES_CPU_IMAGE"]
    report = _task_spec(_find(files, "tasks.report.report_"))
    assert report.container.image == PREBUILT["MILES_CPU_IMAGE"]

    from flyteidl.admin import launch_plan_pb2

    lp = launch_plan_pb2.LaunchPlan()
    lp.ParseFromString(_find(files, "fully_async_rl_nightly_").read_bytes())
    assert lp.spec.entity_metadata.schedule.cron_schedule.schedule == "0 2 * * *"
    assert set(lp.spec.fixed_inputs.literals) == {"run_id", "storage_root", "segment_steps"}
    assert any(name.split("_", 1)[1].startswith("eval_backfill_default") for name in files)


def test_a_local_ray_task_starts_ray_without_the_dashboard(tmp_path):
    """`pyflyte run` of a task on tasks.cluster's Ray config (RAY_ADDRESS unset): Ray is up inside the task,
    started by the config's task without the dashboard (Flyte's plugin alone would start one)."""
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import ray
        from flytekit import task
        from tasks.cluster import RAY_CLUSTER

        @task(task_config=RAY_CLUSTER)
        def probe() -> str:
            node = ray._private.worker.global_worker.node
            return f"up={ray.is_initialized()} dashboard={node.address_info.get('webui_url') or 'none'}"
    """))
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "RAY_ADDRESS": ""}
    proc = _pyflyte(["run", str(tmp_path / "probe.py"), "probe"], env)
    assert "up=True dashboard=none" in proc.stdout, proc.stdout[-2000:]


def test_package_offline_with_imagespecs(tmp_path):
    """Without prebuilt image references the ImageSpecs are used; offline, flytekit assumes they exist."""
    out = tmp_path / "p.tgz"
    env = {k: "" for k in PREBUILT}
    _pyflyte(["--pkgs", "workflows", "package", "--image", "ghcr.io/miles-flyte/default:ci", "-o", str(out), "--force"],
             env)
    files = _unpack(out, tmp_path / "x")
    assert "miles-flyte-gpu:" in _task_spec(_find(files, "tasks.train.train_")).container.image
    assert "miles-flyte-cpu:" in _task_spec(_find(files, "tasks.data.prepare_data_")).container.image


def test_register_dry_run_offline():
    proc = _pyflyte(["register", "--copy", "none", "--dry-run", "--image", "ghcr.io/miles-flyte/default:ci",
                     "--version", "ci", "workflows"], PREBUILT)
    text = proc.stdout + proc.stderr
    assert "Successfully registered" in text
    for name in ("fully_async_rl", "fully_async_rl_nightly", "eval_backfill_default", "tasks.train.train"):
        assert name in text


def test_flyte_config_is_ini_flytekit_reads():
    from flytekit.configuration import Config

    cfg = Config.auto(str(ROOT / "flyte.config"))
    assert cfg.platform.endpoint and cfg.data_config.s3.endpoint
    settings = [line.split("=")[0].strip().lower() for line in (ROOT / "flyte.config").read_text().splitlines()
                if "=" in line and not line.lstrip().startswith("#")]
    assert not [k for k in settings if "secret" in k or "key" in k], "no credentials in flyte.config"


# ----------------------------------------------------------------------------- workflow interface


def test_every_workflow_input_has_an_immutable_default():
    from workflows.eval_backfill import eval_backfill
    from workflows.fully_async import fully_async_rl

    for wf in (fully_async_rl, eval_backfill):
        for name, (_tp, default) in wf.python_interface.inputs_with_defaults.items():
            assert default is None or isinstance(default, (str, int, float, bool)), (wf.name, name, default)
    assert set(fully_async_rl.python_interface.inputs) == {"flags", "run_id", "storage_root", "segment_steps"}


def test_workflow_compiles_with_no_inputs():
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from flytekit.tools.translator import get_serializable

    from workflows.fully_async import fully_async_rl

    settings = SerializationSettings(image_config=ImageConfig(default_image=Image("default", "ghcr.io/x/y", "ci")))
    spec = get_serializable({}, settings, fully_async_rl)
    nodes = {n.id: n for n in spec.template.nodes}
    assert len(nodes) == 8
    by_task = {n.task_node.reference_id.name.rsplit(".", 1)[-1]: n for n in nodes.values() if n.task_node}
    assert not by_task["plan"].upstream_node_ids  # it only prints what will happen: nothing waits for it
    # the model is imported (or found in the cache) before the data: text prompts need its tokenizer
    assert by_task["model_fingerprint"].id in by_task["import_model"].upstream_node_ids
    assert by_task["import_model"].id in by_task["data_fingerprint"].upstream_node_ids
    # train and the (sized) eval follower share no data; both wait only for prepare_data
    assert by_task["train"].upstream_node_ids == by_task["eval_follower_sized"].upstream_node_ids
    assert by_task["prepare_data"].id in by_task["train"].upstream_node_ids
    assert by_task["eval_follower_sized"].id in by_task["report"].upstream_node_ids


# ----------------------------------------------------------------------------- inputs -> config


def test_run_config_from_inputs(tmp_path):
    from miles_core.config import ConfigError
    from tasks.inputs import run_config

    cfg = run_config("--preset tiny-reverse4 --rollout-batch-size 16 --run-id a1", storage_root=str(tmp_path))
    assert cfg.rollout.rollout_batch_size == 16 and cfg.run.run_id == "a1"
    assert cfg.run.storage_root == f"file://{tmp_path}"  # absolute: Ray workers need not share the cwd
    cfg = run_config("--preset tiny-reverse4", run_id="b2", segment_steps=5)
    assert (cfg.run.run_id, cfg.run.segment_steps) == ("b2", 5)
    assert cfg.run.storage_root.startswith("file:///")
    with pytest.raises(ConfigError, match="--run-id is given both in flags and as the workflow input run_id"):
        run_config("--run-id x", run_id="y")
    with pytest.raises(ConfigError, match="--rollout-batch-sise"):
        run_config("--rollout-batch-sise 3")
    with pytest.raises(ConfigError, match="cannot split"):
        run_config("--run-id 'unterminated")


def test_cluster_tasks_refuse_a_local_storage_root(tmp_path):
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState

    from miles_core.config import ConfigError
    from tasks.inputs import run_config

    ctx = FlyteContextManager.current_context()
    state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
    with FlyteContextManager.with_context(ctx.with_execution_state(state)):
        with pytest.raises(ConfigError, match="object storage"):
            run_config("--preset tiny-reverse4", storage_root=str(tmp_path))
        assert run_config("--preset tiny-reverse4", storage_root="s3://bucket/prefix").run.storage_root == "s3://bucket/prefix"


# ----------------------------------------------------------------------------- StructuredDataset decoder


def _round_trip(table: pa.Table, raw_prefix: str, data_config=None) -> pa.Table:
    from flytekit import FlyteContextManager, StructuredDataset
    from flytekit.core.data_persistence import FileAccessProvider
    from flytekit.core.type_engine import TypeEngine

    import tasks  # noqa: F401 - registers the decoder

    ctx = FlyteContextManager.current_context()
    fap = FileAccessProvider(local_sandbox_dir="/tmp/miles-flyte-sandbox", raw_output_prefix=raw_prefix,
                             data_config=data_config)
    with FlyteContextManager.with_context(ctx.with_file_access(fap)) as ctx2:
        lt = TypeEngine.to_literal_type(StructuredDataset)
        lit = TypeEngine.to_literal(ctx2, StructuredDataset(dataframe=table), StructuredDataset, lt)
        assert lit.scalar.structured_dataset.uri.startswith(raw_prefix.split("://")[0])
        sd = TypeEngine.to_python_value(ctx2, lit, StructuredDataset)
        return sd.open(pa.Table).all()


def test_arrow_decoder_is_ours():
    from flytekit.types.structured.structured_dataset import PARQUET, StructuredDatasetTransformerEngine

    from tasks.structured import FsspecParquetToArrowDecoder

    for protocol in ("s3", "gs", "file"):
        decoder = StructuredDatasetTransformerEngine.get_decoder(pa.Table, protocol, PARQUET)
        assert isinstance(decoder, FsspecParquetToArrowDecoder), protocol


def test_arrow_round_trip_local(tmp_path):
    table = pa.table({"step": [1, 2], "value": [0.5, 0.75]})
    assert _round_trip(table, str(tmp_path / "raw")).equals(table)


@pytest.mark.s3
def test_arrow_round_trip_s3(s3_bucket, seaweed):
    """flyte#5859: flytekit's decoder dropped the s3:// scheme and read a local path."""
    import uuid

    from flytekit.configuration import DataConfig, S3Config

    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY

    cfg = DataConfig(s3=S3Config(endpoint=seaweed.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    table = pa.table({"step": [1, 2, 3], "dataset": ["a", "b", "c"]})
    got = _round_trip(table, f"s3://{s3_bucket}/flyte-raw/{uuid.uuid4().hex[:8]}", cfg)
    assert got.equals(table)


# ----------------------------------------------------------------------------- local runs (slow)

STUBS = textwrap.dedent('''
    import sys, types
    from miles_core.metrics import MetricsSink
    from miles_core.storage.run_root import FINISHED, RUNNING, next_segment, write_config, write_status
    from miles_core.rollout.prompts import load_prompts
    from miles_core.storage import Store

    def run_training(cfg, **kwargs):
        st = Store(cfg.run_uri)
        assert len(load_prompts(st)) == 9500  # prepare_data ran first
        seg = next_segment(st)
        write_config(st, cfg, seg)
        write_status(st, RUNNING, last_step=-1, segment=seg)
        with MetricsSink(st, "trainer") as s:
            for k in range(6):
                s.log(k, {"rollout/reward/mean": 0.1 * k, "rollout/fully_async/queue_size": 0})
        write_status(st, FINISHED, last_step=5, segment=seg)

    segment = types.ModuleType("miles_core.driver.segment"); segment.run_training = run_training
    sys.modules["miles_core.driver.segment"] = segment
''')


@pytest.mark.slow
def test_workflows_run_locally(tmp_path):
    """fully_async_rl wiring with a stand-in driver, twice (prepare_data is a cache hit the second
    time). The real driver runs in tests/e2e; the real backfill in test_eval_backfill_workflow."""
    script = tmp_path / "run.py"
    store = tmp_path / "store"
    script.write_text(STUBS + textwrap.dedent(f'''
        from workflows.fully_async import fully_async_rl
        page = fully_async_rl(flags="--preset tiny-reverse4", storage_root={str(store)!r})
        html = open(page.path).read()
        assert "rollout-bound" in html, html[:500]
        page2 = fully_async_rl(flags="--preset tiny-reverse4", storage_root={str(store)!r})
        print("OK")
    '''))
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_SECONDS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "OK" in proc.stdout
    assert (store / "runs" / "default" / "report.html").exists()
    assert (store / "runs" / "default" / "data" / "prompts.arrow").exists()
