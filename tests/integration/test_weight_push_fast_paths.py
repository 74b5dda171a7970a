"""Weight pushes at the speed of their bytes: what the fast paths change, and what they must not.

Pins, on the real CPU engine server (in this process, so its state can be inspected):
- staging (`/stage_weights_from_disk`, the CPU engine's own endpoint): it changes nothing served (same
  version, same greedy tokens and log-probs) until the `/update_weights_from_disk` of the same path,
  which swaps the staged model in without reading the disk again and serves what a plain load of
  the same files serves; a staged model of files replaced since is not used; a checkpoint that
  cannot be read answers 400 (the client raises), and an engine without the endpoint (SGLang: 404)
  is skipped by the client;
- `WeightSync.push` stages before the pause (engine-visible order: stage, pause, update, continue),
  and a failed stage neither fails the push nor skips the load;
- distributed pushes (flattened buckets, and per-tensor ones) receive into at most two reused sets of
  buffers, never into the set the served model uses, and the model is built from them without a
  copy (its fused q/k/v weight is a view of the received bytes); a refused bucket changes nothing;
- a flattened bucket whose tensor would sit at an offset its dtype cannot view is copied out;
- a snapshot's weights are written without hashing them (`put_tensors(digest=False)`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import textwrap

import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file

from miles_core.engines import cpu_server
from miles_core.engines.client import EngineClient, EngineControlError
from miles_core.engines.cpu_server import CpuEngineServer, serve
from miles_core.models.builtin import materialize_checkpoint
from miles_core.storage import Store
from miles_core.weights.sync import StoreWeightTransport, WeightSync
from miles_core.storage.tensor_files import put_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [1, 2, 3, 4, 10]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-paths")
    return {"a": materialize_checkpoint("builtin:tiny-llama", 1, str(root / "a")),
            "b": materialize_checkpoint("builtin:tiny-llama", 2, str(root / "b"))}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _served(path: str, **kw):
    server = CpuEngineServer(path, weight_version=1, **kw)
    port = _port()
    runner = await serve(server, "127.0.0.1", port)
    return server, runner, f"http://127.0.0.1:{port}"


def _same(x, y, tol=1e-6) -> bool:
    return x.output_ids == y.output_ids and max(abs(a - b) for a, b in zip(x.output_logprobs, y.output_logprobs)) < tol


@pytest.fixture
def loads(monkeypatch):
    """Counts the engine's reads of a checkpoint from disk."""
    calls = []
    real = cpu_server._load_model

    def counted(path, *args):
        calls.append(path)
        return real(path, *args)

    monkeypatch.setattr(cpu_server, "_load_model", counted)
    return calls


def test_staged_model_changes_nothing_until_the_update_swaps_it_in(ckpts, loads):
    async def main():
        server, runner, url = await _served(ckpts["a"])
        loads.clear()  # the server's start read its initial model
        try:
            async with EngineClient([url]) as c:
                before = await c.generate(PROMPT, GREEDY)
                assert await c.stage_weights_from_disk(ckpts["b"]) == [url]
                assert await c.stage_weights_from_disk(ckpts["b"]) == [url]  # the same files: staged once
                assert len(loads) == 1
                still = await c.generate(PROMPT, GREEDY)
                assert (await c.get_weight_version()) == {url: 1}
                await c.update_weights_from_disk(ckpts["b"], 2)
                assert len(loads) == 1 and server._staged is None  # swapped in, not read again
                staged = await c.generate(PROMPT, GREEDY)
                await c.update_weights_from_disk(ckpts["a"], 3)
                await c.update_weights_from_disk(ckpts["b"], 4)  # not staged: read while paused, as before
                assert len(loads) == 3
                plain = await c.generate(PROMPT, GREEDY)
                return before, still, staged, plain
        finally:
            await runner.cleanup()

    before, still, staged, plain = asyncio.run(main())
    assert _same(before, still) and set(still.token_versions) == {1}
    assert _same(staged, plain) and set(staged.token_versions) == {2}
    assert not _same(before, staged, 1e-3)


def test_disk_loads_convert_every_tensor_into_the_two_buffer_sets(ckpts):
    """Pins: a load from disk (staged or not) converts each tensor of the file straight into a reusable
    buffer set that the served model does not use (two sets, alternating), so after the first loads no
    tensor of the served model is a new allocation, and a load never writes into what is served. Guards:
    a load allocating the whole model anew each time (six times slower on SmolLM2-135M: page faults of
    new memory), or converting into the served set."""
    async def main():
        server, runner, url = await _served(ckpts["a"])
        try:
            async with EngineClient([url]) as c:
                held = []
                for version, name in enumerate(["b", "a", "b", "a"], start=2):
                    if version % 2:
                        await c.stage_weights_from_disk(ckpts[name])
                    before = {t.untyped_storage().data_ptr() for t in server.hf_tensors.values()}
                    await c.update_weights_from_disk(ckpts[name], version)
                    now = {t.untyped_storage().data_ptr() for t in server.hf_tensors.values()}
                    sets = [a.storages() for a in server._arenas]
                    held.append((before.isdisjoint(now), any(now <= s for s in sets), len(server._arenas)))
                return held, await c.generate(PROMPT, GREEDY)
        finally:
            await runner.cleanup()

    held, out = asyncio.run(main())
    assert held[1:] == [(True, True, 2)] * 3, held
    assert out.output_ids


def test_a_staged_model_of_files_replaced_since_is_not_used(ckpts, tmp_path, loads):
    path = str(tmp_path / "ckpt")
    shutil.copytree(ckpts["a"], path)

    async def main():
        server, runner, url = await _served(ckpts["a"])
        try:
            async with EngineClient([url]) as c:
                await c.stage_weights_from_disk(path)  # a's weights
                tmp = os.path.join(path, "model.safetensors.new")
                shutil.copyfile(os.path.join(ckpts["b"], "model.safetensors"), tmp)
                os.replace(tmp, os.path.join(path, "model.safetensors"))  # now b's, at the same path
                await c.update_weights_from_disk(path, 2)
                replaced = await c.generate(PROMPT, GREEDY)
                await c.update_weights_from_disk(ckpts["b"], 3)
                return replaced, await c.generate(PROMPT, GREEDY)
        finally:
            await runner.cleanup()

    replaced, b = asyncio.run(main())
    assert _same(replaced, b)
    assert loads.count(path) == 2  # staged, then read again


def test_staging_errors_and_engines_without_staging(ckpts, tmp_path):
    async def main():
        server, runner, url = await _served(ckpts["a"])
        bare = web.AppRunner(web.Application())  # answers 404 to everything, as SGLang does to this path
        await bare.setup()
        port = _port()
        await web.TCPSite(bare, "127.0.0.1", port).start()
        try:
            async with EngineClient([url]) as c:
                with pytest.raises(EngineControlError, match="Failed to stage"):
                    await c.stage_weights_from_disk(str(tmp_path / "missing"))
                assert (await c.get_weight_version()) == {url: 1}
            async with EngineClient([f"http://127.0.0.1:{port}"]) as c:
                assert await c.stage_weights_from_disk(ckpts["b"]) == []
        finally:
            await runner.cleanup()
            await bare.cleanup()

    asyncio.run(main())


class Recorder:
    """An engine that records its control calls; its stage fails when told to."""

    def __init__(self, fail_stage: bool = False):
        self.log, self.fail_stage = [], fail_stage

    async def stage_weights_from_disk(self, path):
        self.log.append("stage")
        if self.fail_stage:
            raise EngineControlError("stage refused")
        return ["e"]

    async def pause_generation(self, mode):
        self.log.append("pause")

    async def continue_generation(self):
        self.log.append("continue")

    async def update_weights_from_disk(self, path, version, *, flush_cache=False, abort_all_requests=False):
        self.log.append(("update", version))


@pytest.mark.parametrize("fail_stage", [False, True])
def test_push_stages_before_the_pause(tmp_path, fail_stage, caplog):
    class Trainer:  # what export_snapshot reads
        aux_files = {"config.json": b"{}"}

        def hf_state_dict(self, dtype=None):
            return {"w": torch.ones(4)}

    engine = Recorder(fail_stage)
    sync = WeightSync([engine], StoreWeightTransport(Trainer(), Store(str(tmp_path))))
    with caplog.at_level(logging.WARNING, logger="miles_core.weights.sync"):
        res = asyncio.run(sync.push(3, 1))
    assert engine.log == ["stage", "pause", ("update", 1), "continue"]
    assert res.version == 1 and res.stage_seconds >= 0
    assert ("staging" in caplog.text) == fail_stage


_PUSHER = textwrap.dedent("""
    import asyncio, os, sys
    from safetensors.torch import load_file
    from miles_core.engines.client import EngineClient
    from miles_core.weights.distributed import DistributedWeightTransport
    from miles_core.weights.sync import WeightSync

    url, flatten, bucket_bytes, *plan = sys.argv[1:]
    PARTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def hf_order(name):  # the trainer's order (a file's is alphabetical): q, k, v and gate, up adjacent
        layer = name.split(".self_attn.")[0].split(".mlp.")[0]
        return layer, next((i for i, p in enumerate(PARTS) if f".{p}." in name), -1), name

    async def main():
        box = {}
        transport = DistributedWeightTransport(lambda: box["state"], [url], master_address="127.0.0.1",
                                               backend="gloo", bucket_bytes=int(bucket_bytes), timeout_seconds=60,
                                               flatten=flatten == "1")
        async with EngineClient([url]) as client:
            sync = WeightSync([client], transport)
            for k, path in enumerate(plan):
                state = load_file(path if path.endswith(".safetensors") else os.path.join(path, "model.safetensors"))
                box["state"] = {n: state[n] for n in sorted(state, key=hf_order)}
                await sync.push(0, k + 2)
        await transport.close()

    asyncio.run(main())
""")


async def _push(url: str, plan: list[str], flatten: bool, bucket_bytes: int = 1 << 30) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _PUSHER, url, "1" if flatten else "0",
                                                str(bucket_bytes), *plan, env={**os.environ, "PYTHONPATH": ROOT})
    assert await asyncio.wait_for(proc.wait(), 120) == 0


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "per-tensor"])
def test_distributed_pushes_reuse_two_buffer_sets_never_the_served_one(ckpts, flatten):
    handed = []  # per receive: (the set handed out, whether it shares a storage with the served model)

    async def main():
        server, runner, url = await _served(ckpts["a"])
        real = server._arena

        def arena(receive=False):
            got = real(receive)
            handed.append((got, not server._served.isdisjoint(got.storages()) if got.reusable else False))
            return got

        server._arena = arena
        try:
            async with EngineClient([url]) as c:
                refs = {}
                for name in ("b", "a"):
                    await c.update_weights_from_disk(ckpts[name], 1)
                    refs[name] = await c.generate(PROMPT, GREEDY)
                # a, b, a, b: two buckets each (a small bucket size splits the model)
                await _push(url, [ckpts["a"], ckpts["b"], ckpts["a"], ckpts["b"]], flatten, bucket_bytes=200_000)
                pushed_b = await c.generate(PROMPT, GREEDY)
                qkv = server.engine.model.layers[0]["qkv_w"]
                return refs, pushed_b, qkv, (await c.get_weight_version())[url]
        finally:
            await runner.cleanup()

    refs, pushed_b, qkv, version = asyncio.run(main())
    assert version == 5 and _same(pushed_b, refs["b"]) and set(pushed_b.token_versions) == {5}
    sets = []
    for got, _ in handed:
        if not any(got is s for s in sets):
            sets.append(got)
    assert len(sets) == 2 and all(s.reusable for s in sets)
    assert not any(overlaps for _, overlaps in handed)  # never the buffers the served model uses
    served_set = handed[-1][0]
    assert qkv.untyped_storage().data_ptr() in served_set.storages()  # q/k/v viewed where received, not copied


def test_a_refused_flattened_bucket_changes_nothing(ckpts, tmp_path):
    """A bucket whose shape differs from the served tensor is refused after its broadcast: served as before."""
    bad = str(tmp_path / "bad.safetensors")
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(3)}, bad)

    async def main():
        server, runner, url = await _served(ckpts["a"])
        try:
            async with EngineClient([url]) as c:
                before = await c.generate(PROMPT, GREEDY)
                with pytest.raises(AssertionError):
                    await _push(url, [bad], flatten=True)
                return before, await c.generate(PROMPT, GREEDY), (await c.get_weight_version())[url]
        finally:
            await runner.cleanup()

    before, after, version = asyncio.run(main())
    assert _same(before, after) and version == 1


def test_flattened_receive_copies_out_a_misaligned_tensor(monkeypatch):
    """A bf16 tensor of 3 elements (6 bytes) puts the next float32 at byte 6: it is copied, not viewed."""
    half = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    full = torch.tensor([[0.5, 1.0], [2.0, -4.0]], dtype=torch.float32)
    wire = torch.cat([half.view(torch.uint8), full.view(-1).view(torch.uint8)])
    monkeypatch.setattr(cpu_server, "broadcast_bucket", lambda tensors, group: tensors[0].copy_(wire))
    metas = [("h", torch.bfloat16, [3]), ("f", torch.float32, [2, 2])]
    got = cpu_server._receive(None, metas, cpu_server._Buffers({}), flattened=True)
    assert torch.equal(got["h"], half) and torch.equal(got["f"], full)


def test_snapshot_weights_are_written_without_a_digest(tmp_path):
    store = Store(str(tmp_path))
    tensors = {"w": torch.arange(6.0).view(2, 3)}
    assert put_tensors(store, "a/model.safetensors", tensors, digest=False) == {
        "size": os.path.getsize(tmp_path / "a" / "model.safetensors")}
    assert set(put_tensors(store, "b/model.safetensors", tensors)) == {"size", "sha256"}
    assert torch.equal(load_file(str(tmp_path / "a" / "model.safetensors"))["w"], tensors["w"])


class Dying(Recorder):
    """An engine whose load fails and whose resume fails too (it died during the push)."""

    def __init__(self, fail_load: bool):
        super().__init__()
        self.fail_load = fail_load

    async def update_weights_from_disk(self, path, version, *, flush_cache=False, abort_all_requests=False):
        if self.fail_load:
            raise RuntimeError("the load failed")

    async def continue_generation(self):
        self.log.append("continue")
        raise EngineControlError("engine gone")


@pytest.mark.parametrize("fail_load", [True, False])
def test_a_failed_resume_does_not_hide_the_failed_load(tmp_path, fail_load, caplog):
    """Every engine is resumed either way; the push raises the load's error when the load failed (the
    resume failure is logged), else the resume's."""
    class Trainer:
        aux_files = {"config.json": b"{}"}

        def hf_state_dict(self, dtype=None):
            return {"w": torch.ones(4)}

    dying, alive = Dying(fail_load), Recorder()
    sync = WeightSync([dying, alive], StoreWeightTransport(Trainer(), Store(str(tmp_path))))
    with pytest.raises(RuntimeError if fail_load else EngineControlError, match="load failed" if fail_load else "gone"):
        asyncio.run(sync.push(1, 1))
    assert "continue" in dying.log and "continue" in alive.log
    assert ("resuming an engine after the failed push" in caplog.text) == fail_load
