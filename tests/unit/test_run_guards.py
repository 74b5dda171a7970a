"""What `run_training` checks before it writes or starts anything (docs/training.md), without Ray.

Pins: a segment on a finished run returns its outcome at once, starts no Ray and no actor (the
cluster functions raise if called), writes nothing (STATUS.json byte-identical, no config, no
lease), even while another writer holds the lease; raising --num-rollout continues it (it goes on
to start the cluster under a new segment). A second writer is refused naming the holder, before
any write. A failed segment releases its lease, so its retry takes over at once; a writer that
lost its lease does not overwrite STATUS. Every step's commits check the lease (driver.fenced):
a fenced writer stops before the step's weight push and consumption record.
"""

from __future__ import annotations

import time

import pytest

import miles_core.driver.placement
import miles_core.driver.segment
from miles_core.config import ConfigError, RunConfig, embedded_default, replace_fields
from miles_core.driver.loop import run_loop
from miles_core.driver.segment import run_training
from miles_core.prepare.resources import ClusterShape, Node
from miles_core.storage import StorageUnavailable, Store, run_root
from miles_core.storage.lease import LEASE_KEY, Lease, LeaseHeld, LeaseLost, LeaseRecord
from tests.unit.test_driver_loop import Recorder, build_roles


class Started(Exception):
    """Raised by the stand-in for the first thing a segment starts (Ray)."""


@pytest.fixture
def no_cluster(monkeypatch):
    calls = []

    def refuse(name):
        def f(*a, **k):
            calls.append(name)
            raise Started(name)
        return f

    for name in ("ensure_ray", "start_cluster", "ensure_model"):
        monkeypatch.setattr(miles_core.driver.segment, name, refuse(name))
    return calls


def _cfg(tmp_path, **kw) -> RunConfig:
    return replace_fields(embedded_default(), storage_root=str(tmp_path), run_id="r", lease_ttl_seconds=2.0,
                          lease_renew_seconds=0.5, **kw)


def _finished_run(tmp_path, num_rollout: int = 5) -> Store:
    store = Store(_cfg(tmp_path).run_uri)
    run_root.write_config(store, {"run": {"num_rollout": num_rollout}}, 0)
    run_root.write_status(store, run_root.FINISHED, last_step=num_rollout - 1, segment=0)
    return store


def test_a_finished_run_returns_at_once_and_starts_nothing(tmp_path, no_cluster):
    import ray

    ray_before = ray.is_initialized()  # False unless an earlier test in this process left Ray up
    store = _finished_run(tmp_path)
    before = store.get_bytes(run_root.STATUS_KEY)
    with Lease.acquire(store, ttl_seconds=2.0, renew_seconds=0.5):  # even with another writer on it
        result = run_training(_cfg(tmp_path, num_rollout=5))
    assert (result.state, result.last_step, result.steps_run) == (run_root.FINISHED, 4, 0)
    assert no_cluster == []
    assert store.get_bytes(run_root.STATUS_KEY) == before
    assert not store.exists("config_segment_0001.json")
    assert ray.is_initialized() == ray_before
    assert run_training(_cfg(tmp_path, num_rollout=3)).state == run_root.FINISHED  # a lower target: finished too


def test_raising_num_rollout_continues_a_finished_run(tmp_path, no_cluster):
    store = _finished_run(tmp_path)
    with pytest.raises(Started):
        run_training(_cfg(tmp_path, num_rollout=8))
    assert no_cluster == ["ensure_ray"]
    assert store.exists("config_segment_0001.json")
    status = run_root.read_status(store)
    assert status.segment == 1 and status.state == run_root.FAILED and "Started" in status.message


def test_a_second_writer_is_refused_before_writing_anything(tmp_path, no_cluster):
    store = Store(_cfg(tmp_path).run_uri)
    with Lease.acquire(store, ttl_seconds=2.0, renew_seconds=0.5) as holder:
        with pytest.raises(LeaseHeld, match=holder.holder.split()[0]):
            run_training(_cfg(tmp_path))
    assert no_cluster == []
    assert store.list("") == [LEASE_KEY, LEASE_KEY + ".lock"]  # no config, no STATUS


def test_a_failed_segment_releases_its_lease_and_the_retry_takes_over_at_once(tmp_path, monkeypatch, no_cluster,
                                                                          capsys):
    def storage_down(*a, **k):
        raise StorageUnavailable("storage at test unreachable")

    monkeypatch.setattr(miles_core.driver.segment, "ensure_ray", storage_down)
    cfg = replace_fields(_cfg(tmp_path), lease_ttl_seconds=600.0, lease_renew_seconds=None)
    with pytest.raises(StorageUnavailable):
        run_training(cfg)
    store = Store(cfg.run_uri)
    assert LeaseRecord.from_bytes(store.get_bytes(LEASE_KEY), LEASE_KEY).released
    assert run_root.read_status(store).state == run_root.FAILED
    kept = store.get_bytes(run_root.error_key(0)).decode()  # the whole traceback, in the run root
    assert kept.startswith("Traceback (most recent call last)") and "storage_down" in kept
    assert "StorageUnavailable: storage at test unreachable" in kept
    assert f"the traceback of this failure: {store.uri(run_root.error_key(0))}" in capsys.readouterr().err
    monkeypatch.setattr(miles_core.driver.segment, "ensure_ray", lambda *a, **k: (_ for _ in ()).throw(Started()))
    t0 = time.monotonic()
    with pytest.raises(Started):
        run_training(cfg)  # the retry: not held up by the failed attempt's 600 s lease
    assert time.monotonic() - t0 < 10
    assert run_root.read_status(store).segment == 1


def test_a_run_that_cannot_be_placed_is_refused_before_any_actor_starts(tmp_path, monkeypatch, no_cluster):
    """Pins: two CPU ranks beside the engine on a two-core machine fail at once with the ConfigError that
    names both sides (not after a 600 s placement wait), and nothing starts. Guards: a check that only
    validation of remote runs makes."""
    monkeypatch.setattr(miles_core.driver.segment, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(miles_core.driver.placement, "cluster_shape",
                        lambda: ClusterShape((Node("this machine", 2, 0),), "this machine's Ray instance"))
    cfg = _cfg(tmp_path, actor_num_gpus_per_node=2)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"does not fit this machine's Ray instance.*--num-cpus-trainer 0.5"):
        run_training(cfg)
    assert time.monotonic() - t0 < 10 and no_cluster == []
    assert run_root.read_status(Store(cfg.run_uri)).state == run_root.FAILED


def test_a_writer_that_lost_its_lease_leaves_status_alone(tmp_path, monkeypatch):
    def lose(cfg, store, segment, lease, *_):
        lease._mark_lost("taken over by another writer")
        lease.check()

    monkeypatch.setattr(miles_core.driver.segment, "_run_segment", lose)
    cfg = _cfg(tmp_path)
    with pytest.raises(LeaseLost, match="taken over"):
        run_training(cfg)
    assert run_root.read_status(Store(cfg.run_uri)).state == run_root.RUNNING


def test_fenced_roles_check_the_lease_before_every_commit():
    rec = Recorder()
    roles, _ = build_roles(rec, end=4)
    allowed = iter([True, True, True, False])  # push and save of step 0, push of step 1, then fenced

    def check():
        rec.log.append(("check",))
        if not next(allowed):
            raise LeaseLost("lost the write lease")

    roles.fence = check
    with pytest.raises(LeaseLost):
        run_loop(roles)
    commits = [e[:2] for e in rec.log if e[0] in ("check", "push", "save")]
    assert commits == [("check",), ("push", 0), ("check",), ("save", 0), ("check",), ("push", 1), ("check",)]
