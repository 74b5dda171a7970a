"""Weight sync (docs/fully-async.md) and snapshots, on file:// and a real S3 server.

Pins: the engine-visible order pause -> update_weights_from_disk(flush_cache=False) with the new
version -> continue (no flush in any mode: SGLang refuses one while requests run, docs/engines.md), and
publish strictly after the resume; versions count 1, 2, ...; abort mode is refused; a failed load still
resumes the engines and publishes nothing; the snapshot is complete (`.complete` last) and, on S3,
fetched to a local dir before engines load it; the real CPU engine server serves the trainer's weights
after a push (its log-probs equal the trainer's), also when the push comes in retract or in_place mode
with requests running and waiting (none aborted; afterwards a request on the same prompt has the new
weights' log-probs, and in retract mode so has every token made after the update).
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from miles_core.config.sections import TrainSection
from miles_core.models.builtin import SEP_ID, materialize_checkpoint
from miles_core.samples import Sample
from miles_core.storage import Store
from miles_core.storage.node_local import localize
from miles_core.train.trainer import Trainer
from miles_core.weights.snapshot import MARKER, complete_snapshots
from miles_core.weights.sync import EngineControl, StoreWeightTransport, WeightSync, WeightSyncError
from tests.support.timeouts import ENGINE_START_SECONDS
from tests.unit.test_train import make_groups

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    path = materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path_factory.mktemp("tiny-gpt")))
    with Trainer(TrainSection(), path) as tr:
        tr.train_step(0, make_groups())
        with torch.no_grad():  # bf16-representable: the published (bf16) version is exactly these weights
            for p in tr.model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        yield tr


class FakeEngine:
    """Records control calls into a shared log; loads the snapshot it is pointed at."""

    def __init__(self, name, log, fail_load=False):
        self.name, self.log, self.fail_load = name, log, fail_load
        self.version, self.weights = 0, None

    async def pause_generation(self, mode):
        self.log.append((self.name, "pause", mode))

    async def continue_generation(self):
        self.log.append((self.name, "continue"))

    async def update_weights_from_disk(self, model_path, weight_version, *, flush_cache=False,
                                       abort_all_requests=False):
        self.log.append((self.name, "update", weight_version, flush_cache, abort_all_requests))
        if self.fail_load:
            raise RuntimeError("engine crashed while loading")
        assert os.path.exists(os.path.join(model_path, MARKER))
        self.weights = load_file(os.path.join(model_path, "model.safetensors"))
        self.version = weight_version


def _sync(trainer, store, engines, log, mode="retract", tmp=None):
    return WeightSync(engines, StoreWeightTransport(trainer, store), mode)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_push_order_versions_and_contents(trainer, storage_root, tmp_path, mode):
    """Engines see pause, update(v, flush_cache=False), continue, under the version given; weights are the trainer's."""
    log = []
    engines = [FakeEngine("e0", log), FakeEngine("e1", log)]
    assert all(isinstance(e, EngineControl) for e in engines)
    store = Store(storage_root)
    sync = _sync(trainer, store, engines, log, mode, str(tmp_path))
    r1 = asyncio.run(sync.push(10, 1))
    r2 = asyncio.run(sync.push(11, 2))
    assert (r1.version, r2.version) == (1, 2)
    for e in ("e0", "e1"):
        ops = [entry[1:] for entry in log if entry[0] == e]
        one = [("pause", mode), ("update", 1, False, False), ("continue",)]
        assert ops[:len(one)] == one
        assert ops[len(one):] == [o if o[0] != "update" else ("update", 2, False, False) for o in one]
    expect = {k: v.to(torch.bfloat16) for k, v in trainer.hf_state_dict().items()}  # a published version is bf16
    for e in engines:
        assert e.version == 2 and set(e.weights) == set(expect)
        assert all(torch.equal(e.weights[k], v) for k, v in expect.items())
    assert complete_snapshots(store) == [10, 11]


def test_snapshot_fetch_requires_marker_and_downloads_for_object_stores(trainer, storage_root, tmp_path, monkeypatch):
    """Without `.complete` a snapshot is not fetched; on S3 it lands in the local cache dir."""
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path))
    store = Store(storage_root)
    store.put_bytes("snapshots/step_00000003/model.safetensors", b"partial")
    with pytest.raises(FileNotFoundError, match=r"\.complete"):
        localize(store.uri("snapshots/step_00000003"), "weights", required=MARKER)
    from miles_core.weights.snapshot import export_snapshot

    written = []
    put = store.put_bytes
    store.put_bytes = lambda k, data: (written.append(k), put(k, data))[1]
    key = export_snapshot(trainer, store, 4)
    assert written[-1] == f"{key}/{MARKER}" and len(written) > 3  # the marker is written last
    local = localize(store.uri(key), "weights", required=MARKER)
    if store.protocol == "file":
        assert local == store.local_path(key)
    else:
        assert local.startswith(str(tmp_path))  # this node's cache ($MILES_CACHE_DIR)
    assert {"model.safetensors", "config.json", "tokenizer.json", MARKER} <= set(os.listdir(local))
    assert complete_snapshots(store) == [4]


def test_abort_mode_is_refused(trainer, tmp_path):
    """--pause-generation-mode abort would drop in-flight work: refused, naming the allowed modes."""
    with pytest.raises(WeightSyncError, match="retract, in_place"):
        _sync(trainer, Store(str(tmp_path)), [], [], mode="abort")


def test_failed_load_resumes_engines_and_records_no_push(trainer, tmp_path):
    """An engine failing to load propagates the error, but every engine is resumed first."""
    log = []
    engines = [FakeEngine("e0", log), FakeEngine("e1", log, fail_load=True)]
    sync = _sync(trainer, Store(str(tmp_path)), engines, log)
    with pytest.raises(RuntimeError, match="crashed"):
        asyncio.run(sync.push(1, 1))
    assert ("e0", "continue") in log and ("e1", "continue") in log
    assert sync.history == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_engine_serves_the_pushed_weights(trainer, tmp_path):
    """Through the real CPU engine server and client: version 1 after a push, log-probs = trainer's (whose
    weights the fixture made bf16-representable: a published version is bf16, docs/weight-versions.md)."""
    from miles_core.engines.client import EngineClient
    from miles_core.engines.cpu_server import CpuEngineServer, serve

    async def main():
        server = CpuEngineServer(trainer.hf_dir)  # the initial checkpoint: differs from the trained weights
        port = _free_port()
        runner = await serve(server, "127.0.0.1", port)
        try:
            async with EngineClient([f"http://127.0.0.1:{port}"]) as client:
                sync = WeightSync([client], StoreWeightTransport(trainer, Store(str(tmp_path))))
                await sync.push(1, 1)
                versions = await client.get_weight_version()
                res = await client.generate([1, 2, 3, 4, SEP_ID], {"max_new_tokens": 5, "temperature": 1.0})
                return versions, res
        finally:
            await runner.cleanup()

    versions, res = asyncio.run(main())
    assert list(versions.values()) == [1]
    assert set(res.token_versions) == {1}
    ours = trainer.logprobs([Sample("p", 0, 0, [1, 2, 3, 4, SEP_ID], res.output_ids)])[0]
    assert torch.allclose(torch.tensor(ours), torch.tensor(res.output_logprobs), atol=1e-4)


def test_a_failed_export_leaves_the_engines_untouched(trainer, tmp_path):
    """An export that fails before any engine is paused leaves engines untouched (the driver's version is
    set only once a push succeeded: miles_core.driver.pushes)."""
    log = []

    class Broken(StoreWeightTransport):
        def prepare(self, step):
            raise OSError("disk full")

    sync = WeightSync([FakeEngine("e0", log)], Broken(trainer, Store(str(tmp_path))))
    with pytest.raises(OSError):
        asyncio.run(sync.push(1, 1))
    assert log == [] and sync.history == []


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_push_with_requests_running_and_waiting(trainer, tmp_path, mode):
    """A push into the real CPU engine (2 slots) while 2 requests run (with output) and 2 wait: it
    succeeds under SGLang's flush rule in both modes, no request is aborted, each one's versions go 0..1,
    and afterwards a request on the same prompt has the new weights' log-probs (no KV of the old weights
    reaches it). In retract mode every token made after the update has them too (its KV was recomputed)."""
    from miles_core.engines.client import EngineClient
    from miles_core.engines.cpu_server import CpuEngineServer, serve

    prompt = [1, 2, 3, 4, SEP_ID]
    params = {"max_new_tokens": 20, "ignore_eos": True}

    async def main():
        server = CpuEngineServer(trainer.hf_dir, max_running_requests=2)
        port = _free_port()
        runner = await serve(server, "127.0.0.1", port)
        try:
            async with EngineClient([f"http://127.0.0.1:{port}"]) as client:
                tasks = [asyncio.create_task(client.generate(prompt, params)) for _ in range(4)]
                eng = server.engine
                while not (len(eng.running) == 2 and len(eng.waiting) == 2 and all(r.output_ids for r in eng.running)):
                    await asyncio.sleep(0.001)
                await client.pause_generation("in_place")  # hold that state until the push pauses in `mode`
                sync = WeightSync([client], StoreWeightTransport(trainer, Store(str(tmp_path))), mode)
                await sync.push(1, 1)
                results = await asyncio.gather(*tasks)
                fresh = await client.generate(prompt, params)
                return results, fresh
        finally:
            await runner.cleanup()

    results, fresh = asyncio.run(main())
    assert all(r.finish_reason == "length" and len(r.output_ids) == 20 for r in results)
    assert sum(r.token_versions[0] == 0 and r.token_versions[-1] == 1 for r in results) == 2  # the running ones
    assert all(r.token_versions == sorted(r.token_versions) for r in results)

    def new_weights(res):
        return trainer.logprobs([Sample("p", 0, 0, prompt, res.output_ids)])[0]

    assert fresh.token_versions == [1] * 20
    assert torch.allclose(torch.tensor(new_weights(fresh)), torch.tensor(fresh.output_logprobs), atol=1e-4)
    if mode == "retract":
        for r in results:
            after = [i for i, v in enumerate(r.token_versions) if v == 1]
            ours = new_weights(r)
            assert max(abs(ours[i] - r.output_logprobs[i]) for i in after) < 1e-4


def test_versions_written_as_deltas_reach_the_cpu_engine_bit_for_bit(tmp_path, monkeypatch):
    """The trainer at an RL learning rate (1e-5: sparse bf16 changes) trains between pushes; the store transport
    writes versions 1-3 as anchors and 4-6 as deltas (anchor interval 4), the engine's side rebuilds each in its
    node cache before the pause, and the real CPU engine then holds exactly the trainer's weights cast to bf16
    (docs/weight-versions.md)."""
    from miles_core.engines.client import EngineClient
    from miles_core.engines.cpu_server import CpuEngineServer, serve

    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "node-cache"))
    path = materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path / "tiny-gpt"))
    written, held = [], []

    async def main(tr):
        server = CpuEngineServer(path)
        port = _free_port()
        runner = await serve(server, "127.0.0.1", port)
        try:
            async with EngineClient([f"http://127.0.0.1:{port}"]) as client:
                transport = StoreWeightTransport(tr, Store(f"file://{tmp_path}/run"), prefix="weights", anchor_interval=4)
                sync = WeightSync([client], transport)
                for k in range(1, 7):
                    tr.train_step(k, make_groups(seed=k))
                    await sync.push(k, k)
                    written.append(transport.written)
                    want = {n: t.to(torch.bfloat16) for n, t in tr.hf_state_dict().items()}
                    held.append(set(want) == set(server.hf_tensors) and all(
                        torch.equal(server.hf_tensors[n].to(torch.bfloat16), t) for n, t in want.items()))
        finally:
            await runner.cleanup()

    with Trainer(TrainSection(lr=1e-5), path) as tr:
        asyncio.run(main(tr))
    assert [w.anchor for w in written] == [True, True, True, False, False, False]
    assert all(0 < w.changed < 0.2 * w.elements for w in written[3:]), [(w.changed, w.elements) for w in written]
    assert max(w.bytes for w in written[3:]) < 0.2 * written[0].bytes
    assert held == [True] * 6


def test_a_producer_joining_after_version_30_serves_it_from_one_anchor_and_deltas(s3_bucket, tmp_path, monkeypatch):
    """The trainer at an RL learning rate publishes 30 versions to S3 (anchors 1-3, a delta every version after
    but an anchor at 23: the default interval of 20). A producer that joins now starts its engine on version 30
    from an empty node cache with the producer job's own engine spec (`engine_spec` of a feed naming version 30): the
    node reads one anchor and 7 deltas, never a whole model per version, rebuilds the trainer's bf16 weights bit
    for bit, and the engine serves version 30 (docs/weight-versions.md)."""
    from miles_core.engines.client import EngineClient
    from dataclasses import replace

    from miles_core.engines.launcher import EngineServer
    from miles_core.storage import weight_versions as wv

    monkeypatch.setattr(wv, "READS", wv.ReadStats())
    path = materialize_checkpoint("builtin:tiny-gpt", 5, str(tmp_path / "tiny-gpt"))
    store = Store(f"s3://{s3_bucket}/late-{os.getpid()}")
    kinds = []
    with Trainer(TrainSection(lr=1e-5), path) as tr:
        transport = StoreWeightTransport(tr, store, prefix="weights")
        for k in range(1, 31):
            tr.train_step(k, make_groups(seed=k))
            uri = transport.prepare(k)
            kinds.append(transport.written.anchor)
        want = {n: t.to(torch.bfloat16) for n, t in tr.hf_state_dict().items()}
    assert [k for k, anchor in enumerate(kinds, 1) if anchor] == [1, 2, 3, 23]
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "late-node"))
    from miles_core.config import embedded_default
    from miles_core.elastic.job import engine_spec
    from miles_core.rollout.feed_record import Feed

    feed = Feed(version=30, weights=uri, step=29, segment=0, queue_size=0, capacity=8, consumed_groups=0,
                groups_per_version=1, max_weight_staleness=None, first_version=1, written_at=0.0)
    server = EngineServer(replace(engine_spec(embedded_default(), feed), startup_timeout_seconds=ENGINE_START_SECONDS))
    server.start()
    try:
        async def served():
            async with EngineClient([server.url]) as client:
                return await client.get_weight_version()

        assert asyncio.run(served()) == {server.url: 30}
    finally:
        server.stop()
    assert wv.READS.anchors_read == 1 and wv.READS.deltas_applied == 7 and wv.READS.checksum_failures == 0
    anchor_bytes = 2 * sum(t.numel() for t in want.values())
    # one anchor and 7 deltas (each < 0.2 of it on this toy model): not a whole model per version
    assert anchor_bytes < wv.READS.bytes_read < 2.5 * anchor_bytes
    rebuilt = load_file(os.path.join(wv.localize_weights(uri), "model.safetensors"))
    assert set(rebuilt) == set(want) and all(torch.equal(wv.bits(rebuilt[n]), wv.bits(want[n])) for n in want)
