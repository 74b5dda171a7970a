"""Weight versions as bf16 anchors and sparse deltas (miles_core/storage/weight_versions.py)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from miles_core.storage import COMPLETE_MARKER, Store
from miles_core.storage import weight_versions as wv
from miles_core.weights.snapshot import partition, seal


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 32, generator=g), "layer.0.w": torch.randn(32, 32, generator=g),
            "layer.0.b": torch.randn(32, generator=g), "norm.weight": torch.ones(32)}


def _step(state: dict, share: float, seed: int) -> dict:
    """`state` with about `share` of each tensor's elements moved by more than bf16's rounding."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        moved = torch.rand(t.shape, generator=g) < share
        out[name] = torch.where(moved, t * 1.05 + 0.01, t)
    return out


def _bf16(state: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in state.items()}


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(wv.bits(a[k]), wv.bits(b[k])) for k in a)


def test_a_sparse_delta_rebuilds_the_new_bits_exactly_and_twice_is_harmless():
    old = _bf16(_state())
    new = _bf16(_step(_state(), 0.02, 1))
    enc = wv.encode(old, new, "step_00000001")
    assert enc.blob is not None and 0 < enc.changed < 0.05 * enc.elements
    assert len(enc.blob) < 0.2 * sum(t.numel() * 2 for t in new.values())
    base_name, sums, encoded = wv.read_delta(enc.blob)
    assert base_name == "step_00000001"
    once = wv.apply(old, sums, encoded)
    assert _same(once, new)
    assert _same(wv.apply(once, sums, encoded), new)  # overwrite, not XOR: applying again changes nothing
    assert _same(old, _bf16(_state()))  # the base is left as it was


def test_a_tensor_that_mostly_changed_travels_dense_and_a_delta_of_everything_is_an_anchor():
    old = _bf16(_state())
    new = dict(old)
    new["layer.0.w"] = (old["layer.0.w"].float() * 1.5).to(torch.bfloat16)  # every element of one tensor
    enc = wv.encode(old, new, "b")
    _, sums, encoded = wv.read_delta(enc.blob)
    assert "layer.0.w:d" in encoded and "embed.weight:i" not in encoded  # unchanged tensors are not written
    assert _same(wv.apply(old, sums, encoded), new)
    grown = dict(new, **{"layer.0.b": torch.ones(48, dtype=torch.bfloat16)})  # a tensor of another shape
    _, sums, encoded = wv.read_delta(wv.encode(old, grown, "b", max_share=1.0).blob)
    applied = wv.apply(old, sums, encoded)
    assert _same(applied, grown) and applied["layer.0.w"].shape == (32, 32) and applied["layer.0.b"].shape == (48,)
    everything = _bf16(_step(_state(), 1.0, 2))
    assert wv.encode(old, everything, "b").blob is None  # the toy learning rate's versions: anchors


def test_a_wrong_base_fails_its_checksum_by_name():
    old = _bf16(_state())
    new = _bf16(_step(_state(), 0.02, 1))
    _, sums, encoded = wv.read_delta(wv.encode(old, new, "b").blob)
    wrong = dict(old)
    wrong["norm.weight"] = torch.zeros(32, dtype=torch.bfloat16)
    with pytest.raises(wv.WeightVersionError, match="norm.weight: checksum mismatch"):
        wv.apply(wrong, sums, encoded)


def _publish(store: Store, writers: list[wv.PartWriter], step: int, state: dict) -> list[wv.PartStats]:
    """Every writer rank's part of version `step`, then the marker (the driver's seal)."""
    parts = len(writers)
    names = partition({k: v.numel() * 2 for k, v in state.items()}, parts)
    key = f"weights/step_{step:08d}"
    stats = [w.write(store, key, state, i, parts, names[i]) for i, w in enumerate(writers)]
    store.put_bytes(f"{key}/config.json", b"{}")
    seal(store, key)
    return stats


def _published(store: Store, steps: int) -> tuple[list[wv.PartWriter], dict, dict]:
    """Versions 1..steps published by one writer (an anchor first, deltas after): (writers, the last
    state, {step: its bf16 state})."""
    writers = [wv.PartWriter(anchor_every=20, first_anchors=1)]
    state, truth = _state(), {}
    for step in range(1, steps + 1):
        state = _step(state, 0.01, step)
        _publish(store, writers, step, state)
        truth[step] = _bf16(state)
    return writers, state, truth


def _read(path: str, parts: int) -> dict:
    out = {}
    for i in range(parts):
        out.update(load_file(os.path.join(path, wv.model_file(i, parts))))
    return out


@pytest.fixture
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(wv, "READS", wv.ReadStats())
    monkeypatch.setattr(wv, "_TOKENS", __import__("collections").OrderedDict(), raising=False)  # a new process
    return tmp_path / "cache"


def test_writers_publish_anchors_first_then_deltas_and_an_anchor_every_n(tmp_path, node_cache):
    store = Store(f"file://{tmp_path}/run")
    writers = [wv.PartWriter(anchor_every=4, first_anchors=2) for _ in range(2)]
    state, kinds, truth = _state(), [], {}
    for step in range(1, 10):
        state = _step(state, 0.01, step)
        kinds.append(all(s.anchor for s in _publish(store, writers, step, state)))
        truth[step] = _bf16(state)
    assert kinds == [True, True, False, False, False, True, False, False, False]
    for step in (9, 3, 6):  # a node that has none of them: anchor + deltas; then one it has the base of
        got = _read(wv.localize_weights(store.uri(f"weights/step_{step:08d}")), 2)
        assert _same(got, truth[step]), step
    assert wv.READS.anchors_read >= 2 and wv.READS.checksum_failures == 0
    before = wv.READS.snapshot()
    wv.localize_weights(store.uri("weights/step_00000004"))  # base step 3 is this node's: only the delta is read
    after = wv.READS.snapshot()
    assert after["anchors_read"] == before["anchors_read"] and after["deltas_applied"] == before["deltas_applied"] + 2
    fresh = [wv.PartWriter(anchor_every=4, first_anchors=2) for _ in range(2)]  # a restarted trainer
    assert all(s.anchor for s in _publish(store, fresh, 10, _step(state, 0.01, 10)))


def test_a_writer_casts_each_version_into_the_buffers_of_the_one_before_its_base(tmp_path, node_cache):
    """The bf16 part two versions back is read by nothing (a delta compares with the base alone), so the
    next version is cast into it rather than into new memory; every version still reads back exactly,
    anchors and deltas alike."""
    store = Store(f"file://{tmp_path}/run")
    writer = wv.PartWriter(anchor_every=3, first_anchors=1)
    state, names, ptrs = _state(), None, []
    for step in range(1, 8):
        state = _step(state, 0.01, step)
        names = partition({k: v.numel() * 2 for k, v in state.items()}, 1)[0]
        _publish(store, [writer], step, state)
        ptrs.append({n: t.data_ptr() for n, t in writer._base.items()})
        got = _read(wv.localize_weights(store.uri(f"weights/step_{step:08d}")), 1)
        assert _same(got, _bf16(state)), step
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[6] == ptrs[0]  # two sets, taken in turn
    assert set(ptrs[0].values()).isdisjoint(ptrs[1].values()) and set(names) == set(ptrs[0])


def test_a_corrupt_local_base_falls_back_to_the_anchor_and_a_corrupt_delta_is_never_served(tmp_path, node_cache):
    store = Store(f"file://{tmp_path}/run")
    writers, state, truth = _published(store, 4)
    base = wv.localize_weights(store.uri("weights/step_00000003"))
    damaged = load_file(os.path.join(base, "model.safetensors"))
    damaged["layer.0.w"][0, 0] += 1
    from safetensors.torch import save_file
    save_file(damaged, os.path.join(base, "model.safetensors"))  # the node's copy rots after it was verified
    got = _read(wv.localize_weights(store.uri("weights/step_00000004")), 1)
    assert _same(got, truth[4]) and wv.READS.checksum_failures == 1 and wv.READS.last_used_anchor
    state = _step(state, 0.01, 5)
    _publish(store, writers, 5, state)
    four = wv.localize_weights(store.uri("weights/step_00000004"))
    with open(os.path.join(four, "model.safetensors"), "wb") as f:
        f.write(b"garbage")  # unreadable, not a checksum mismatch: rebuilt from the anchor all the same
    got = _read(wv.localize_weights(store.uri("weights/step_00000005")), 1)
    assert _same(got, _bf16(state)) and wv.READS.checksum_failures == 1 and wv.READS.last_used_anchor
    raw = store.get_bytes("weights/step_00000002/delta-00001-of-00001.safetensors.zst")
    _, sums, encoded = wv.read_delta(raw)
    changed = next(k for k in sorted(encoded) if k.endswith(":v"))
    encoded[changed] = encoded[changed] + 1  # a flipped value the store handed back
    import json
    import zstandard
    from safetensors.torch import save
    store.put_bytes("weights/step_00000002/delta-00001-of-00001.safetensors.zst", zstandard.ZstdCompressor().compress(
        save(encoded, metadata={wv.BASE: "step_00000001", wv.CHECKSUMS: json.dumps(sums)})))
    with pytest.raises(wv.WeightVersionError, match=changed[:-2]):
        wv.localize_weights(store.uri("weights/step_00000002"))


def test_retention_keeps_every_version_back_to_the_anchor_of_what_is_served():
    listing = [f"weights/step_{s:08d}/{f}" for s, f in [
        (1, "model.safetensors"), (2, "model.safetensors"), (3, "delta-00001-of-00001.safetensors.zst"),
        (4, "delta-00001-of-00001.safetensors.zst"), (5, "model.safetensors"),
        (6, "delta-00001-of-00001.safetensors.zst")]] + ["weights/step_00000004/config.json"]
    dirs = wv.version_dirs(listing)
    assert [d for d, delta in sorted(dirs.items()) if delta] == ["step_00000003", "step_00000004", "step_00000006"]
    name = "step_{:08d}".format
    assert wv.needed(dirs, {name(4)}) == {name(2), name(3), name(4)}
    assert wv.needed(dirs, {name(6), name(5)}) == {name(5), name(6)}  # the old chain can go
    assert wv.needed(dirs, {name(9)}) == set()


def test_a_push_reports_what_every_writer_rank_wrote():
    from miles_core.driver.placement import version_written
    from miles_core.metrics import names as N

    part = {"anchor": False, "bytes": 100, "elements": 1000, "changed": 20, "encode_seconds": 0.5}
    out = version_written([{"snapshot": "s3://r/weights/step_00000001", "part": part},
                           {"part": part | {"anchor": True, "bytes": 300, "encode_seconds": 0.75}}, {}])
    assert out == {"snapshot": "s3://r/weights/step_00000001", N.WEIGHTS_VERSION_BYTES: 400,
                   N.WEIGHTS_SHARE_OF_DENSE: 0.1,
                   N.WEIGHTS_CHANGED_SHARE: 0.02, N.WEIGHTS_ENCODE_SECONDS: 0.75, N.WEIGHTS_ANCHOR: 1.0}
    assert version_written([{"delivered": True}, {}]) == {"delivered": True}  # no version in the run root


def test_a_node_copy_of_an_anchor_that_fails_its_checksums_is_copied_again(node_cache):
    store = Store("memory://weight-versions-anchor/run")  # not file://: the node holds a copy
    state = _state()
    _publish(store, [wv.PartWriter()], 1, state)
    uri = store.uri("weights/step_00000001")
    path = wv.localize_weights(uri)
    damaged = load_file(os.path.join(path, "model.safetensors"))
    damaged["norm.weight"][0] = 7
    from safetensors.torch import save_file
    save_file(damaged, os.path.join(path, "model.safetensors"), metadata=_metadata_of(path))
    wv._verified.clear()  # a new process: it verifies the copy it is handed
    again = wv.localize_weights(uri)
    assert _same(_read(again, 1), _bf16(state)) and wv.READS.checksum_failures == 1
    store.put_bytes("weights/step_00000001/model.safetensors", open(os.path.join(again, "model.safetensors"), "rb")
                    .read()[:-8] + b"\0" * 8)  # the stored anchor itself damaged: never served
    from miles_core.storage.node_local import discard
    discard(uri, "weights", wv.seal_token(Store(uri)))
    with pytest.raises(wv.WeightVersionError):
        wv.localize_weights(uri)


def _metadata_of(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return f.metadata()


def test_patching_a_copy_of_the_base_file_makes_the_file_apply_would(tmp_path):
    """Pins: `patch_copy` (the reader's fast path: the base's file copied by the kernel, the delta written
    through a map, the checksums verified on it and replaced in the header) yields a safetensors file with
    exactly the tensors `apply` makes and the new checksums in its metadata, over a chain of versions; a
    base whose header has no room for the new checksums (a file written without them) is refused (False)
    so the caller applies on the loaded base; a wrong delta fails by name. Guards: a patched file that
    keeps the base's checksums, or a broken header."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    state = _state()
    base = _bf16(state)
    path = str(tmp_path / "v1.safetensors")
    save_file(base, path, metadata={"format": "pt", wv.CHECKSUMS: json.dumps(
        {k: wv.checksum(t) for k, t in base.items()}, sort_keys=True)})
    for step in range(2, 6):  # each version's file is the next one's base
        state = _step(state, 0.02 if step != 3 else 0.9, step)  # step 3 sends a tensor dense
        new = _bf16(state)
        _, sums, encoded = wv.read_delta(wv.encode(load_file(path), new, "prev", max_share=2.0).blob)
        out = str(tmp_path / f"v{step}.safetensors")
        assert wv.patch_copy(path, out, sums, encoded)
        assert _same(load_file(out), new) and _same(load_file(out), wv.apply(load_file(path), sums, encoded))
        with safe_open(out, "pt") as f:
            assert json.loads(f.metadata()[wv.CHECKSUMS]) == sums
        path = out
    bare = str(tmp_path / "bare.safetensors")
    save_file(load_file(path), bare)  # no checksums in its header: the new header would not fit
    new = _bf16(_step(state, 0.02, 9))
    _, sums, encoded = wv.read_delta(wv.encode(load_file(bare), new, "prev").blob)
    assert not wv.patch_copy(bare, str(tmp_path / "fallback.safetensors"), sums, encoded)
    with pytest.raises(wv.WeightVersionError, match="checksum mismatch"):
        wv.patch_copy(path, str(tmp_path / "wrong.safetensors"), {**sums, "norm.weight": "0" * 16}, encoded)


def test_a_reader_that_missed_versions_applies_only_the_deltas_it_lacks(tmp_path, node_cache):
    """Pins: a node holding version 2 that is next asked for version 6 reads the deltas of 3-6 and no
    anchor, and rebuilds 6 bit for bit; when its copy of 6 has rotted and it is asked for 8, the chain
    fails a checksum, is counted, and 8 is rebuilt from the anchor instead (never served corrupt). Guards:
    a reader that fell a few versions behind reading the whole model again (what cross-zone bandwidth pays
    for)."""
    store = Store(f"file://{tmp_path}/run")
    _, _, truth = _published(store, 8)
    wv.localize_weights(store.uri("weights/step_00000002"))
    before = wv.READS.snapshot()
    six = wv.localize_weights(store.uri("weights/step_00000006"))
    got = _read(six, 1)
    after = wv.READS.snapshot()
    assert _same(got, truth[6])
    assert after["anchors_read"] == before["anchors_read"] and after["deltas_applied"] - before["deltas_applied"] == 4
    assert not wv.READS.last_used_anchor
    anchor = os.path.getsize(f"{tmp_path}/run/weights/step_00000001/model.safetensors")
    assert after["bytes_read"] - before["bytes_read"] < anchor / 2
    damaged = load_file(os.path.join(six, "model.safetensors"))
    damaged["embed.weight"][3, 3] += 1
    from safetensors.torch import save_file
    save_file(damaged, os.path.join(six, "model.safetensors"))  # rotted after it was verified
    got = _read(wv.localize_weights(store.uri("weights/step_00000008")), 1)
    assert _same(got, truth[8]) and wv.READS.checksum_failures == 1 and wv.READS.last_used_anchor


def test_a_publish_killed_midway_and_made_again_after_a_restart_serves_the_new_weights(tmp_path, node_cache):
    """Pins: a trainer killed inside the publish of version 4 (its rank 0 wrote its delta part, rank 1
    nothing, no seal) and restarted from a checkpoint publishes version 4 again, as anchors (its writers
    hold no part in memory): the stale delta part left in the directory is removed, so every reader rebuilds
    the restarted trainer's version 4, and version 5 (a delta against it) bit for bit. Guards: a reader
    applying the killed run's delta over its own base (checksums consistent with the stale delta, so no
    check would catch the mix of two trainers' weights)."""
    store = Store(f"file://{tmp_path}/run")
    writers = [wv.PartWriter(anchor_every=20, first_anchors=1) for _ in range(2)]
    state = _state()
    for step in range(1, 4):
        state = _step(state, 0.01, step)
        _publish(store, writers, step, state)
    wv.localize_weights(store.uri("weights/step_00000003"))  # this node follows the run
    killed = _step(state, 0.01, 4)
    names = partition({k: v.numel() * 2 for k, v in killed.items()}, 2)
    writers[0].write(store, "weights/step_00000004", killed, 0, 2, names[0])  # then the kill
    assert store.exists("weights/step_00000004/delta-00001-of-00002.safetensors.zst")
    restarted = [wv.PartWriter(anchor_every=20, first_anchors=1) for _ in range(2)]
    again = _step(state, 0.01, 40)  # the step trained again after the restart: other weights
    assert all(s.anchor for s in _publish(store, restarted, 4, again))
    fresh_node = str(tmp_path / "fresh-cache")
    for cache in (None, fresh_node):  # the node that held version 3, and one that held nothing
        if cache:
            os.environ["MILES_CACHE_DIR"] = cache
        assert _same(_read(wv.localize_weights(store.uri("weights/step_00000004")), 2), _bf16(again)), cache
    five = _step(again, 0.01, 5)
    assert not any(s.anchor for s in _publish(store, restarted, 5, five))
    assert _same(_read(wv.localize_weights(store.uri("weights/step_00000005")), 2), _bf16(five))


def test_a_version_published_again_under_its_name_is_never_served_from_the_old_copy(node_cache):
    """Pins: a trainer restarted from a checkpoint publishes its next steps again under the names the dead
    one sealed; a node that copied the dead trainer's version 2 (from object storage) serves the new
    version 2, and rebuilds the delta version 3 on top of it, bit for bit. Guards: the node cache keyed by
    the name alone, handing back the dead trainer's weights as the new version 2."""
    store = Store("memory://weight-versions-again/run")
    state = _step(_state(), 0.01, 1)
    writers = [wv.PartWriter(anchor_every=20, first_anchors=1)]
    _publish(store, writers, 1, state)
    _publish(store, writers, 2, _step(state, 0.01, 2))
    wv.localize_weights(store.uri("weights/step_00000002"))  # the dead trainer's version 2, on this node
    restarted = [wv.PartWriter(anchor_every=20, first_anchors=1)]
    two = _step(state, 0.01, 20)
    _publish(store, restarted, 2, two)
    three = _step(two, 0.01, 3)
    assert not _publish(store, restarted, 3, three)[0].anchor
    assert _same(_read(wv.localize_weights(store.uri("weights/step_00000002")), 1), _bf16(two))
    assert _same(_read(wv.localize_weights(store.uri("weights/step_00000003")), 1), _bf16(three))
    assert wv.READS.checksum_failures == 0


def test_a_base_no_other_process_holds_is_patched_in_place_else_copied(node_cache):
    """Pins: rebuilding a delta version on a node whose copy of the base no other process holds moves the
    base's file into the new version and patches it there (the same inode: no copy of the model is made)
    and removes the base's entry; while another process holds the base (its shared lock on the entry),
    the base is left complete and a copy is patched instead. Both rebuild the new bits exactly. Guards: a
    reader copying the whole model per update (the copy was a fifth of a SmolLM2 update), or patching a
    file another process may still read."""
    import fcntl

    store = Store("memory://weight-versions-claim/run")
    _, _, truth = _published(store, 3)
    one = wv.localize_weights(store.uri("weights/step_00000001"))
    inode = os.stat(os.path.join(one, "model.safetensors")).st_ino
    two = wv.localize_weights(store.uri("weights/step_00000002"))
    assert os.stat(os.path.join(two, "model.safetensors")).st_ino == inode and not os.path.exists(one)
    assert _same(_read(two, 1), truth[2]) and wv.READS.anchors_read == 0
    other = os.open(two + ".use", os.O_RDWR)  # another process's hold (flock: per open file)
    fcntl.flock(other, fcntl.LOCK_SH)
    try:
        three = wv.localize_weights(store.uri("weights/step_00000003"))
        assert os.path.exists(os.path.join(two, COMPLETE_MARKER)) and _same(_read(two, 1), truth[2])
        assert os.stat(os.path.join(three, "model.safetensors")).st_ino != inode
        assert _same(_read(three, 1), truth[3]) and wv.READS.anchors_read == 0
    finally:
        os.close(other)


def test_an_anchor_is_verified_on_its_file_bytes_as_the_tensor_checksums_say(tmp_path):
    """`file_checksums` hashes each tensor's bytes where they lie in the file (no torch in an engine's
    node process): the same values as `checksum` of the loaded tensors, bf16 and fp32 alike; a flipped
    bit, a truncated file and a file that is not safetensors are refused, and counted."""
    from safetensors.torch import save_file

    state = {"a": torch.randn(5, 3).to(torch.bfloat16), "b": torch.randn(7), "empty": torch.zeros(0, dtype=torch.bfloat16)}
    sums = {k: wv.checksum(t) for k, t in state.items()}
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    file = anchor / "model.safetensors"
    save_file(state, str(file), metadata={"format": "pt", wv.CHECKSUMS: __import__("json").dumps(sums)})
    assert wv.file_checksums(str(file)) == (sums, sums)
    wv._verify_anchor(str(anchor))
    good = file.read_bytes()
    before = wv.READS.checksum_failures
    for damaged, message in ((good[:-1] + bytes([good[-1] ^ 1]), "checksum mismatch"),
                             (good[:-9], "unreadable"), (b"garbage", "unreadable")):
        file.write_bytes(damaged)
        wv._verified.clear()
        with pytest.raises(wv.WeightVersionError, match=message):
            wv._verify_anchor(str(anchor))
    assert wv.READS.checksum_failures == before + 3


def test_an_update_reads_the_version_listing_and_marker_together_and_not_its_bases_marker(node_cache, monkeypatch):
    """Round trips are what a delta update waits on (on SeaweedFS over loopback, 25-40 ms each, most of
    a 0.26 s update): the version's listing and its marker's token are read at once, and the base this
    process localized is found by the token it remembers, its marker not read again. A base published
    again since (a new token) is caught by the patched part's checksums and rebuilt from its anchor."""
    store = Store("memory://weight-versions-trips/run")
    _, _, truth = _published(store, 3)
    wv.localize_weights(store.uri("weights/step_00000001"))
    wv.localize_weights(store.uri("weights/step_00000002"))
    reads = []
    get = Store.get_bytes
    monkeypatch.setattr(Store, "get_bytes", lambda self, key: reads.append(self.uri(key)) or get(self, key))
    got = _read(wv.localize_weights(store.uri("weights/step_00000003")), 1)
    assert _same(got, truth[3]) and wv.READS.checksum_failures == 0
    assert store.uri("weights/step_00000002/.complete") not in reads, reads
    assert reads.count(store.uri("weights/step_00000003/.complete")) == 1
    fresh = [wv.PartWriter(anchor_every=20, first_anchors=1)]  # a restarted trainer publishes 3 again, then 4
    state = _step(_state(seed=1), 0.01, 3)
    _publish(store, fresh, 3, state)
    state = _step(state, 0.01, 4)
    _publish(store, fresh, 4, state)
    got = _read(wv.localize_weights(store.uri("weights/step_00000004")), 1)  # its base: the old 3 remembered
    assert _same(got, _bf16(state)) and wv.READS.checksum_failures == 1 and wv.READS.last_used_anchor
