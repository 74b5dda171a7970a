"""TensorBoard and W&B mirrors fed from the run root's metric parts (miles_core.metrics.mirrors).

Each test writes events with MetricsSink (two components, out of step order, as the trainer and
the rollout actor do), runs a MirrorFeed, and reads back what the mirror wrote with the sink's own
reader: TensorBoard's EventAccumulator, and the records of W&B's offline `.wandb` file.
"""

from __future__ import annotations


import pytest

from miles_core.config import parse_flags
from miles_core.metrics import MetricsSink
from miles_core.metrics.mirrors import MirrorError, MirrorFeed, TensorBoardMirror, WandbMirror, mirror_feed
from miles_core.storage import Store
from tests.support.sinks import scalars

pytest.importorskip("tensorboard")


def _log_two_components(store: Store) -> None:
    with MetricsSink(store, "trainer", background=False) as t, MetricsSink(store, "rollout", background=False) as r:
        t.log(2, {"train/loss": 0.25, "train/nan": float("nan")})
        t.log(3, {"train/loss": 0.125})
        r.log(1, {"rollout/reward/mean": 0.5})  # reaches storage after later trainer steps


def test_tensorboard_gets_every_component_and_not_the_earlier_segments(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    with MetricsSink(store, "trainer", background=False) as old:
        old.log(0, {"train/loss": 9.0})  # an earlier segment's part: mirrored back then
    feed = MirrorFeed(store, [TensorBoardMirror(str(tmp_path / "tb"))], interval_seconds=60)
    _log_two_components(store)
    feed.close()
    assert scalars(str(tmp_path / "tb")) == {"train/loss": [(2, 0.25), (3, 0.125)],
                                              "rollout/reward/mean": [(1, 0.5)]}


def test_tensorboard_files_are_copied_into_a_remote_run_root(tmp_path):
    store = Store("memory://mirrors-copy/run")
    with mirror_feed(parse_flags(["--preset", "tiny-reverse4", "--use-tensorboard", "--metrics-mirror-interval-seconds", "0.2"]), store) as feed:
        _log_two_components(store)
        sent = feed.sweep()
    assert sent == 3
    copied = store.list("tensorboard")
    assert len(copied) == 1 and copied[0].startswith("tensorboard/events.out.tfevents.")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / copied[0].split("/")[1]).write_bytes(store.get_bytes(copied[0]))
    assert scalars(str(tmp_path / "tb"))["train/loss"] == [(2, 0.25), (3, 0.125)]


def test_a_file_run_root_gets_its_event_files_in_place(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    with mirror_feed(parse_flags(["--preset", "tiny-reverse4", "--use-tensorboard"]), store):
        _log_two_components(store)
    assert scalars(str(tmp_path / "run" / "tensorboard"))["rollout/reward/mean"] == [(1, 0.5)]


def test_no_mirror_flag_no_feed(tmp_path):
    with mirror_feed(parse_flags(["--preset", "tiny-reverse4"]), Store(f"file://{tmp_path}/run")) as feed:
        assert feed is None


def _run_id(cfg, store) -> str:
    from miles_core.metrics.mirrors import wandb_run_id

    return wandb_run_id(cfg.run.run_id, store.root_uri)


def test_wandb_online_without_a_key_fails_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))  # no stored login
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    cfg = parse_flags(["--preset", "tiny-reverse4", "--use-wandb", "--wandb-dir", str(tmp_path / "wb")])
    with pytest.raises(MirrorError, match="--use-wandb: wandb.init failed.*WANDB_API_KEY"):
        WandbMirror(cfg, f"file://{tmp_path}/run")


def test_the_key_is_refused_as_a_flag_and_a_missing_package_is_named(monkeypatch):
    import importlib.util

    from miles_core.config import ConfigError

    with pytest.raises(ConfigError, match="--wandb-key .*not supported.*WANDB_API_KEY") as e:
        parse_flags(["--preset", "tiny-reverse4", "--wandb-key", "secret-value-77"])
    assert "secret-value-77" not in str(e.value)
    with pytest.raises(ConfigError, match="--metrics-mirror-interval-seconds"):
        parse_flags(["--preset", "tiny-reverse4", "--metrics-mirror-interval-seconds", "0"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--use-wandb needs the `wandb` package: pip install 'miles-flyte\[wandb\]'"):
        parse_flags(["--preset", "tiny-reverse4", "--use-wandb"])


def test_a_failing_mirror_is_logged_and_never_fails_the_run(tmp_path, caplog):
    class Broken:
        def log(self, step, metrics, wall_time):
            raise ConnectionError("W&B unreachable")

        flush = close = lambda self: None

    store = Store(f"file://{tmp_path}/run")
    feed = MirrorFeed(store, [Broken()], interval_seconds=60)
    _log_two_components(store)
    feed.close()  # does not raise
    assert "metrics mirrors: ConnectionError: W&B unreachable" in caplog.text
