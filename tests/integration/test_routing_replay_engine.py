"""Rollout routing replay's rollout side for real: a CPU engine process launched with
--enable-return-routed-experts (what the launcher passes under --use-rollout-routing-replay) and the
RolloutManager's producer fill each sample's routed experts.

Pins: every finished sample of builtin:tiny-glm4-moe (the first layer dense) carries the MoE layers'
top-2 of every position the engine ran (prompt + response - 1), expert ids in range and distinct per
(position, layer); the same run without the flag carries none. Durable like the rest of the sample:
the run's buffer reopened from its run root, as a trainer restarted after a kill reopens it (no step
recorded: every group is available again), reads each group back from its Arrow object with the
routes the engine returned.
"""

from __future__ import annotations

import asyncio

import pytest

from miles_core.buffer import DropUnused
from miles_core.buffer.build import build_buffer
from miles_core.config import embedded_default, replace_fields
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer
from miles_core.models.builtin import builtin_config, materialize_checkpoint
from miles_core.models.families import spec_of
from miles_core.rollout.builtin_tasks import builtin_rows
from miles_core.rollout.manager import RolloutManager
from miles_core.samples import SampleStatus

from tests.support.timeouts import ENGINE_START_SECONDS

MODEL = "builtin:tiny-glm4-moe"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = materialize_checkpoint(MODEL, 1, str(tmp_path_factory.mktemp("r3") / "m"))
    server = EngineServer(EngineLaunchSpec("cpu", path, weight_version=1, startup_timeout_seconds=ENGINE_START_SECONDS,
                                           return_routed_experts=True))
    server.start()
    yield server
    server.stop()


def _config(tmp_path, replay: bool):
    return replace_fields(embedded_default(), run_id="r3", storage_root=str(tmp_path / "store"), hf_checkpoint=MODEL,
                          rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=4,
                          use_rollout_routing_replay=replay)


def _batch(tmp_path, engine, replay: bool):
    cfg = _config(tmp_path, replay)

    async def run():
        mgr = RolloutManager(cfg, engine_urls=[engine.url], rows=builtin_rows("builtin:reverse4")[:8],
                             consumed_through_step=-1)
        await mgr.set_version(1)
        await mgr.start()
        try:
            return await mgr.next_batch(1)
        finally:
            await mgr.stop()

    return asyncio.run(run())


def test_the_engine_fills_each_samples_moe_layer_routes(tmp_path, engine):
    spec = spec_of(builtin_config(MODEL, 2, 128, 4))
    per = len(spec.moe_layers) * spec.moe_topk
    assert spec.moe_layers and len(spec.moe_layers) < spec.num_layers  # the dense layer is dropped
    batch = _batch(tmp_path / "on", engine, replay=True)
    samples = [s for g in batch.groups for s in g.samples]
    assert samples and all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in samples)
    for s in samples:
        positions = len(s.prompt_ids) + len(s.response_ids) - 1
        assert len(s.routed_experts) == positions * per
        for p in range(positions * len(spec.moe_layers)):
            top = s.routed_experts[p * spec.moe_topk:(p + 1) * spec.moe_topk]
            assert len(set(top)) == spec.moe_topk and all(0 <= e < spec.num_experts for e in top)
    with build_buffer(_config(tmp_path / "on", True), DropUnused(), consumed_through_step=-1) as reopened:
        stored, wanted = {}, {g.group_id for g in batch.groups}
        while not wanted <= set(stored):  # the producer may have committed more groups than the batch took
            g = reopened.get()
            stored[g.group_id] = {s.sample_index: s.routed_experts for s in g.samples}
    for g in batch.groups:
        assert stored[g.group_id] == {s.sample_index: s.routed_experts for s in g.samples}, g.group_id
    off = _batch(tmp_path / "off", engine, replay=False)
    assert all(not s.routed_experts for g in off.groups for s in g.samples)
