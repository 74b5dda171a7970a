"""Weight versions in the run root as bf16 anchors and sparse bf16 deltas (docs/weight-versions.md).

A published weight version is bf16, whatever the trainer's master precision: that is what SGLang
serves on GPU, and past the first optimizer steps at RL learning rates most bf16 elements do not
change between two versions (the step falls below bf16's rounding), so a version is written as the
elements that changed since the one before it.

One version is the directory `weights/step_{k:08d}/`, written in `parts` by the trainer's writer ranks
(miles_core.weights.snapshot.partition: every writer cuts the same tensors the same way). Part i is
either
- an anchor part: `model.safetensors` (one part) or `model-0000{i+1}-of-0000{n}.safetensors`, the part's
  bf16 tensors, an ordinary HF file (SGLang, transformers and the CPU engine read it as it is), with a
  checksum of each tensor in its metadata (`miles.checksums`); or
- a delta part: `delta-0000{i+1}-of-0000{n}.safetensors.zst`, zstd-compressed safetensors holding, for
  each tensor that changed, the positions that changed (as gaps, int32) and their new bf16 bits (int16),
  each stored as byte planes (`:i`, `:v`), or the tensor's whole bits when that is smaller (`:d`), and in its metadata the version directory whose
  part i it applies to (`miles.base`, a sibling) and the checksum of every tensor of the part after
  applying. Positions and values overwrite, so applying a delta twice is harmless.
Beside the parts: the HF index (several parts), config and tokenizer files, `.complete` last.

`PartWriter` is one writer rank's side: it keeps the bf16 part it published last and writes the next as
a delta against it, or as an anchor for the first `first_anchors` versions, at least every
`anchor_every` versions, after a restart (no part in memory) and whenever the delta would not be much
smaller than the part.

`localize_weights(uri)` is every reader's side (an engine's node, a producer job's engines): a local
directory holding the version's full bf16 weights in the HF layout, every checksum verified. A delta
version is rebuilt in the node cache from its base (itself localized the same way, so a node that has
the version before reads only the delta, and a late joiner the chain back to its anchor); a checksum
that fails is counted and the version is rebuilt from the chain's anchor read again from storage,
never served corrupt (`WeightVersionError` when that fails too).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles_core.storage import COMPLETE_MARKER, Store, normalize_uri
from miles_core.storage.node_local import claim, discard, drop_claimed, is_cache_entry, localize

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHECKSUMS = "miles.checksums"
BASE = "miles.base"
ZSTD_LEVEL = 3
_DELTA = re.compile(r"^delta-(\d{5})-of-(\d{5})\.safetensors\.zst$")
# A delta part is written only when its raw encoding is below this share of the part's bf16 bytes:
# a delta that changes most elements (a toy learning rate) is an anchor instead, so no chain grows for nothing.
DELTA_MAX_SHARE = 0.5
_BYTES_PER_CHANGE = 6  # an int32 gap and an int16 value


class WeightVersionError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def model_file(i: int, parts: int) -> str:
    """HF's name of the weights of part i (from 0) of `parts`."""
    return "model.safetensors" if parts == 1 else f"model-{i + 1:05d}-of-{parts:05d}.safetensors"


def delta_file(i: int, parts: int) -> str:
    return f"delta-{i + 1:05d}-of-{parts:05d}.safetensors.zst"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bf16 tensor's bits, flat, as int16 (a view)."""
    import torch

    return t.reshape(-1).view(torch.int16)


def checksum(t: torch.Tensor) -> str:
    """xxh3-64 of the bf16 tensor's bytes."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(bits(t.contiguous()).numpy())


# ----------------------------------------------------------------------------- the codec


@dataclass
class Encoded:
    """One part's delta against its base: the compressed bytes, or None when an anchor is the smaller."""
    blob: bytes | None
    elements: int
    changed: int  # elements whose bits differ from the base
    raw_bytes: int  # the delta's encoding before compression
    checksums: dict[str, str]  # of every tensor of the new part (an anchor written instead carries them too)


def encode(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], base_name: str, *,
           max_share: float = DELTA_MAX_SHARE) -> Encoded:
    """The delta taking `base` to `new` (bf16 tensors of the same part), or `blob=None` when its encoding
    would be at least `max_share` of the part's bf16 bytes (write an anchor instead)."""
    import numpy as np
    import torch
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    sums, elements, changed, raw = {}, 0, 0, 0
    for name in sorted(new):
        t = new[name]
        sums[name] = checksum(t)
        elements += t.numel()
        old = base.get(name)
        now = bits(t).numpy()
        if old is None or old.shape != t.shape or old.dtype != t.dtype:
            tensors[f"{name}:d"], raw, changed = _dense(now, t), raw + 2 * now.size, changed + now.size
            continue
        where = np.flatnonzero(now != bits(old).numpy())
        changed += where.size
        if where.size == 0:
            continue
        if where.size * _BYTES_PER_CHANGE >= 2 * now.size or now.size >= 2 ** 31:
            tensors[f"{name}:d"], raw = _dense(now, t), raw + 2 * now.size
            continue
        gaps = np.diff(where, prepend=0).astype(np.int32)
        tensors[f"{name}:i"], tensors[f"{name}:v"] = _planes(gaps), _planes(now[where])
        raw += where.size * _BYTES_PER_CHANGE
    if raw >= max_share * 2 * elements:
        return Encoded(None, elements, changed, raw, sums)
    import zstandard

    payload = save(tensors, metadata={BASE: base_name, CHECKSUMS: json.dumps(sums, sort_keys=True)})
    return Encoded(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload), elements, changed, raw, sums)


def _dense(flat_bits, t: torch.Tensor) -> torch.Tensor:
    """A tensor's whole bf16 bits (int16) in its shape."""
    import torch

    return torch.from_numpy(flat_bits.copy()).reshape(t.shape)


def _planes(a) -> torch.Tensor:
    """The array's bytes as byte planes (uint8, one row per byte of an element): zstd compresses the high
    bytes of small gaps and the sign and exponent bytes of weights far better apart (measured: 2.8 -> 2.3
    bytes per changed element at 2% changed)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T))


def _unplanes(planes: torch.Tensor, dtype):
    import numpy as np

    return np.ascontiguousarray(planes.numpy().T).view(dtype).reshape(-1)


def _metadata(payload: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (its header: 8 bytes of length, then JSON)."""
    (n,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8:8 + n]).get("__metadata__") or {}


def read_delta(blob: bytes) -> tuple[str, dict[str, str], dict[str, torch.Tensor]]:
    """(base directory name, checksums after applying, the encoded tensors) of a delta part."""
    import zstandard
    from safetensors.torch import load

    payload = zstandard.ZstdDecompressor().decompress(blob)
    meta = _metadata(payload)
    if BASE not in meta or CHECKSUMS not in meta:
        raise WeightVersionError("a delta part without its base or checksums")
    return meta[BASE], json.loads(meta[CHECKSUMS]), load(payload)


def apply(base: dict[str, torch.Tensor], checksums: dict[str, str],
          encoded: dict[str, torch.Tensor], *, in_place: bool = False) -> dict[str, torch.Tensor]:
    """The part after the delta: `base` (bf16) with the delta's positions overwritten, every tensor's checksum
    verified (WeightVersionError naming the first that differs). `base` is left unchanged, unless `in_place`
    (a part just read from a file: no copy of the model is made)."""
    import torch

    out = {}
    for name, want in checksums.items():
        if f"{name}:d" in encoded:
            out[name] = encoded[f"{name}:d"].view(torch.bfloat16)  # the tensor's bits in its own shape
        elif name not in base:
            raise WeightVersionError(f"the delta changes {name}, which its base does not hold")
        else:
            out[name] = base[name] if in_place else base[name].clone()
            if f"{name}:i" in encoded:
                where, values = _changes(encoded, name)
                bits(out[name])[torch.from_numpy(where)] = torch.from_numpy(values)
        if checksum(out[name]) != want:
            raise WeightVersionError(f"{name}: checksum mismatch after applying the delta")
    return out


def _changes(encoded: dict[str, torch.Tensor], name: str):
    """(positions, new bits as int16) of tensor `name`'s sparse change in a delta (its `:i` and `:v` planes)."""
    import numpy as np

    return (np.cumsum(_unplanes(encoded[f"{name}:i"], np.int32), dtype=np.int64),
            _unplanes(encoded[f"{name}:v"], np.int16))


def verify(state: dict[str, torch.Tensor], checksums: dict[str, str], what: str) -> None:
    compare_checksums(checksums, {name: checksum(t) for name, t in state.items()}, what)


def compare_checksums(checksums: dict[str, str], got: dict[str, str], what: str) -> None:
    """WeightVersionError unless `got` (tensor -> `checksum`) names the tensors `checksums` names, each
    with its checksum."""
    if set(got) != set(checksums):
        raise WeightVersionError(f"{what}: holds {len(got)} tensors, its checksums name {len(checksums)}")
    for name, value in got.items():
        if value != checksums[name]:
            raise WeightVersionError(f"{what}: {name}: checksum mismatch")


def _file_header(f) -> tuple[int, dict]:
    """(the header's length, the header) of the safetensors file open as `f`, read from its start;
    ValueError for a file too short to hold them."""
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{len(head)} bytes: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    size = os.fstat(f.fileno()).st_size
    if 8 + n > size:
        raise ValueError(f"a header of {n} bytes in a file of {size}")
    return n, json.loads(f.read(n))


# ----------------------------------------------------------------------------- the writer


@dataclass
class PartStats:
    """What writing one part of a version did (the version's metrics sum them over parts)."""
    anchor: bool
    bytes: int
    elements: int
    changed: int  # elements that differ from the part published before (all of them at a first anchor)
    encode_seconds: float


class PartWriter:
    """One writer rank's published versions (see the module doc): the bf16 part it wrote last."""

    def __init__(self, *, anchor_every: int = 20, first_anchors: int = 3):
        if anchor_every < 1 or first_anchors < 1:
            raise ValueError("anchor_every and first_anchors must be at least 1")
        self.anchor_every, self.first_anchors = anchor_every, first_anchors
        self._base: dict | None = None
        self._base_name: str | None = None
        # the bf16 tensors of the part written before the base: nothing reads them any more, so the next
        # part is cast into them (memory the process has not written before costs the cast ~4x: page faults)
        self._spare: dict = {}
        self._written = 0
        self._since_anchor = 0
        self._last: PartStats | None = None

    def write(self, store: Store, key: str, state: dict, i: int, parts: int, names: list[str]) -> PartStats:
        """Write part i of `parts` (the tensors `names` of `state`, cast to bf16) of the version at `key`."""
        import torch

        name = key.rstrip("/").rsplit("/", 1)[-1]
        if name == self._base_name and self._last is not None:
            return self._last  # written already (a push made again): a delta against itself would break the chain
        t0 = time.perf_counter()
        wants_anchor = (self._base is None or set(self._base) != set(names) or self._written < self.first_anchors
                        or self._since_anchor + 1 >= self.anchor_every)
        part: dict[str, torch.Tensor] = {}
        sums: dict[str, str] = {}

        def cast(n: str) -> torch.Tensor:  # never a view of a live parameter
            src, dst = state[n], self._spare.pop(n, None)
            if dst is not None and dst.shape == src.shape and src.device.type == "cpu":
                part[n] = dst.copy_(src)
            else:
                part[n] = src.to(torch.bfloat16, copy=True).contiguous()
            return part[n]

        def cast_and_sum(n: str) -> torch.Tensor:
            sums[n] = checksum(cast(n))
            return part[n]

        # a version made again after a restart: unsealed until every part is new, and this part's file of
        # the other kind (a publish killed midway) removed once this one is written
        store.delete(in_version(key, COMPLETE_MARKER))
        encoded = None
        if not wants_anchor:
            for n in names:
                cast(n)
            encoded = encode(self._base, part, self._base_name)  # takes the checksums itself
        if encoded is not None and encoded.blob is not None:
            store.put_bytes(in_version(key, delta_file(i, parts)), encoded.blob)
            store.delete(in_version(key, model_file(i, parts)))
            stats = PartStats(False, len(encoded.blob), encoded.elements, encoded.changed, time.perf_counter() - t0)
            self._since_anchor += 1
        else:
            if encoded is not None:  # a delta would not have been much smaller: cast and summed already
                sums.update(encoded.checksums)
            size = _put_anchor(store, in_version(key, model_file(i, parts)), state, names,
                               part.__getitem__ if encoded is not None else cast_and_sum, sums)
            store.delete(in_version(key, delta_file(i, parts)))
            elements = sum(state[n].numel() for n in names)
            stats = PartStats(True, size, elements, encoded.changed if encoded is not None else elements,
                              time.perf_counter() - t0)
            self._since_anchor = 0
        self._spare = self._base or {}
        self._base, self._base_name, self._last = part, name, stats
        self._written += 1
        return stats


def _put_anchor(store: Store, key: str, state: dict, names: list[str], produce, sums: dict[str, str]) -> int:
    """Write the anchor part `names` of `state` at `key`: each bf16 tensor `produce(name)` makes (the cast, and
    its checksum into `sums`) while the one before is written; the checksums go into the header last."""
    from miles_core.storage.tensor_files import put_streamed

    order = sorted(names)
    layout = [(n, list(state[n].shape), "BF16", 2 * state[n].numel()) for n in order]
    return put_streamed(store, key, layout, produce, lambda: {CHECKSUMS: json.dumps(sums, sort_keys=True)},
                        {CHECKSUMS: json.dumps({n: "0" * 16 for n in order}, sort_keys=True)})


def in_version(key: str, name: str) -> str:
    """The key of file `name` of the version (or snapshot) directory at `key` ("" : the store's root)."""
    return f"{key}/{name}" if key else name


# ----------------------------------------------------------------------------- the readers


@dataclass
class ReadStats:
    """What this process's `localize_weights` calls read and did (the reader's side of the version metrics)."""
    versions: int = 0
    bytes_read: int = 0  # deltas and anchor parts read from storage to rebuild versions
    deltas_applied: int = 0
    anchors_read: int = 0  # anchor parts read to rebuild a version (a late joiner, a failed checksum)
    apply_seconds: float = 0.0
    checksum_failures: int = 0
    last_used_anchor: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


READS = ReadStats()
_verified: dict[str, float] = {}  # anchor directory -> mtime of its marker when its checksums were verified
# The seal tokens of the versions this process localized last (normalized URI -> token): the base of the
# next delta is found in the node cache without reading its marker again (a round trip per update). A
# token gone stale (the base published again since) finds the old copy, whose patched result then fails
# its checksums, and the part is rebuilt from its anchor.
_TOKENS: "collections.OrderedDict[str, str]" = collections.OrderedDict()
_TOKENS_KEPT = 8
_TOKENS_LOCK = threading.Lock()


def is_delta_version(keys: list[str]) -> bool:
    return any(_DELTA.match(k) for k in keys)


def localize_weights(uri: str) -> str:
    """A directory on this node with the full bf16 weights of the version at `uri` (see the module doc)."""
    from concurrent.futures import ThreadPoolExecutor

    store = Store(uri)
    with ThreadPoolExecutor(max_workers=1) as pool:  # the listing and the marker's token: one round trip
        listing = pool.submit(store.list, "")
        seal = seal_token(store)  # a version written again at this name (after a restart) is another copy
        keys = listing.result()
    if COMPLETE_MARKER not in keys:
        raise FileNotFoundError(f"{uri} has no {COMPLETE_MARKER}; it is incomplete")
    t0 = time.perf_counter()
    path = _localize_version(uri, store, keys, seal)
    with _TOKENS_LOCK:
        _TOKENS[normalize_uri(uri)] = seal
        _TOKENS.move_to_end(normalize_uri(uri))
        while len(_TOKENS) > _TOKENS_KEPT:
            _TOKENS.popitem(last=False)
    if is_delta_version(keys):
        READS.add(apply_seconds=time.perf_counter() - t0)
    return path


def _localize_version(uri: str, store: Store, keys: list[str], seal: str) -> str:
    if not is_delta_version(keys):
        path = localize(uri, "weights", required=COMPLETE_MARKER, identity=seal)
        try:
            _verify_anchor(path)
        except WeightVersionError as e:
            if uri.startswith("file://"):
                raise  # the run root's own files: nothing to copy again
            log.warning("weights %s: this node's copy failed its checksums (%s); copying it again", uri, e)
            discard(uri, "weights", seal)
            path = localize(uri, "weights", required=COMPLETE_MARKER, identity=seal)
            _verify_anchor(path)
        READS.add(versions=1)
        return path
    used_anchor = []
    path = localize(uri, "weights", required=COMPLETE_MARKER, identity=seal,
                    build=lambda tmp: used_anchor.append(_build(store, keys, tmp)))
    READS.add(versions=1)
    READS.last_used_anchor = any(used_anchor)
    return path


def seal_token(store: Store) -> str:
    """The token in the version's `.complete` (miles_core.weights.snapshot.seal; "" for markers written
    without one, or when it is gone since the listing)."""
    try:
        return store.get_bytes(COMPLETE_MARKER).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return ""


def _verify_anchor(path: str) -> None:
    """Check every tensor of an anchor directory against the checksums its files carry (once per copy;
    files written before checksums existed carry none and are taken as they are)."""
    marker = os.path.join(path, COMPLETE_MARKER)
    stamp = os.path.getmtime(marker) if os.path.exists(marker) else 0.0
    if _verified.get(path) == stamp:
        return
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        try:
            found = file_checksums(file)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{file}: deleted while it was read") from e
        except (OSError, ValueError, KeyError, TypeError) as e:  # not a safetensors file (truncated, garbage)
            if not os.path.exists(file):
                raise FileNotFoundError(f"{file}: deleted while it was read") from e
            READS.add(checksum_failures=1)
            raise WeightVersionError(f"{file}: unreadable ({e})") from e
        if found is None:
            continue
        try:
            compare_checksums(*found, f"{path}/{name}")
        except WeightVersionError:
            READS.add(checksum_failures=1)
            raise
    _verified[path] = stamp


def file_checksums(file: str) -> tuple[dict[str, str], dict[str, str]] | None:
    """(the checksums a safetensors file's header carries, each tensor's `checksum` of its bytes as
    stored), or None for a file that carries none. The bytes are hashed where they lie in the file (a
    read-only map): no tensor is made, and torch is not needed (an engine's node verifies an anchor
    without importing it). `checksum` hashes a tensor's bytes, so this is the same value. ValueError
    (or KeyError) for a file that is not safetensors."""
    import mmap

    import xxhash

    with open(file, "rb") as f:
        n, header = _file_header(f)
        sums = (header.pop("__metadata__", None) or {}).get(CHECKSUMS)
        if sums is None:
            return None
        got = {}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for name, info in header.items():
                    lo, hi = info["data_offsets"]
                    if not 0 <= lo <= hi <= len(mm) - 8 - n:
                        raise ValueError(f"{name}: bytes {lo}..{hi} lie outside the file's data")
                    got[name] = xxhash.xxh3_64_hexdigest(view[8 + n + lo:8 + n + hi])
            finally:
                view.release()
    return json.loads(sums), got


def _sibling(uri: str, name: str) -> str:
    if "/" in name or name in ("", ".", ".."):
        raise WeightVersionError(f"a delta names the base {name!r}, which is not a version beside it")
    return f"{uri.rstrip('/').rsplit('/', 1)[0]}/{name}"


def _build(store: Store, keys: list[str], tmp: str) -> bool:
    """Write the full version at `store` into `tmp` (the node cache's new entry); whether an anchor was read.
    A base version no other process on this node holds is taken over (`claim`): its file moved into `tmp`
    and patched in place, no copy of the model made, and its entry removed."""
    claimed: dict[str, int] = {}  # base entries this build took over (their files moved, then patched)
    try:
        return _build_parts(store, keys, tmp, claimed)
    finally:
        for entry, fd in claimed.items():
            drop_claimed(entry, fd)


def _build_parts(store: Store, keys: list[str], tmp: str, claimed: dict[str, int]) -> bool:
    from safetensors.torch import save_file

    from concurrent.futures import ThreadPoolExecutor

    used_anchor = False
    bases: dict[str, str | None] = {}  # base version -> this node's copy of it
    wanted = [k for k in keys if k != COMPLETE_MARKER and "/" not in k]
    small = [k for k in wanted if not k.endswith(".safetensors")]  # deltas, the index, config, tokenizer
    with ThreadPoolExecutor(max_workers=8) as pool:  # one round trip for all of them
        fetched = dict(zip(small, pool.map(store.get_bytes, small)))
    for key in wanted:
        if _DELTA.match(key):
            continue
        if key in fetched:
            data = fetched[key]
        else:  # an anchor part: one at a time (a large model's parts are each a few GB)
            data = store.get_bytes(key)
            READS.add(bytes_read=len(data))
        with open(os.path.join(tmp, key), "wb") as f:
            f.write(data)
        del data
    for key, blob in fetched.items():
        m = _DELTA.match(key)
        if m is None:
            continue
        i, parts = int(m.group(1)) - 1, int(m.group(2))
        READS.add(bytes_read=len(blob))
        base_name, sums, encoded = read_delta(blob)
        part = None
        if base_name not in bases:  # once per build: a claimed base is no longer complete for `_local_copy`
            bases[base_name] = _local_copy(_sibling(store.uri(), base_name))
        base_dir = bases[base_name]
        out = os.path.join(tmp, model_file(i, parts))
        if base_dir is not None and base_dir not in claimed and is_cache_entry(base_dir):
            fd = claim(base_dir)  # no other process holds the base: its files are moved here, not copied
            if fd is not None:
                claimed[base_dir] = fd
        if base_dir is not None:
            try:
                base_file = os.path.join(base_dir, model_file(i, parts))
                if base_dir in claimed:
                    os.replace(base_file, out)
                    base_file = out
                if patch_copy(base_file, out, sums, encoded):
                    READS.add(deltas_applied=1)
                    continue
                part = apply(_load(base_file), sums, encoded, in_place=True)
                READS.add(deltas_applied=1)
            except WeightVersionError as e:
                READS.add(checksum_failures=1)
                log.warning("weights %s part %d: %s; rebuilding it from its anchor", store.uri(), i, e)
            except Exception as e:  # noqa: BLE001 - pruned or damaged underneath (safetensors raises RuntimeError)
                log.info("weights %s part %d: this node's copy of its base is unreadable (%s); rebuilding it "
                         "from its anchor", store.uri(), i, e)
        if part is None:
            # a node that missed versions applies the deltas it lacks; one whose base failed reads the anchor
            part, anchored = _from_anchor(store.uri(), i, parts, local_bases=base_dir is None)
            used_anchor = used_anchor or anchored
        save_file(part, out, metadata={"format": "pt", CHECKSUMS: json.dumps(sums, sort_keys=True)})
    open(os.path.join(tmp, COMPLETE_MARKER), "wb").close()
    return used_anchor


def patch_copy(base_file: str, out: str, checksums: dict[str, str], encoded: dict[str, torch.Tensor]) -> bool:
    """Write the part after the delta to `out` as a copy of its base's file patched where the delta says
    (`base_file` is `out`: the base's file moved there, patched in place): the kernel copies the file (no
    tensor is loaded), the delta's positions are written through a map of
    the copy, every tensor's checksum is verified on it, and the header's checksums are replaced in place.
    WeightVersionError for a checksum that differs; False (nothing to trust in `out`) where the copy cannot
    be patched so (the base's tensors are not the delta's, not all bf16, or the new header would not fit
    in the old one's space): `apply` on the loaded base does it then."""
    import mmap
    import shutil

    import numpy as np
    import torch

    if base_file != out:
        shutil.copyfile(base_file, out)  # copy_file_range / sendfile: in the kernel
    with open(out, "r+b") as f:
        n, header = _file_header(f)
        names = {k for k in header if k != "__metadata__"}
        if names != set(checksums) or any(header[k].get("dtype") != "BF16" for k in names):
            return False
        meta = {**(header.get("__metadata__") or {}), CHECKSUMS: json.dumps(checksums, sort_keys=True)}
        new_header = json.dumps({**header, "__metadata__": meta}, separators=(",", ":")).encode()
        if len(new_header) > n:
            return False
        mm, view = mmap.mmap(f.fileno(), 0), None
        try:
            for name in sorted(names):
                lo, hi = header[name]["data_offsets"]
                view = np.frombuffer(mm, dtype=np.int16, count=(hi - lo) // 2, offset=8 + n + lo)
                if f"{name}:d" in encoded:
                    dense = encoded[f"{name}:d"].reshape(-1).numpy()
                    if dense.size != view.size:
                        raise WeightVersionError(f"{name}: the delta's dense tensor has {dense.size} elements, "
                                                 f"its base {view.size}")
                    view[:] = dense
                elif f"{name}:i" in encoded:
                    where, values = _changes(encoded, name)
                    view[where] = values
                if checksum(torch.from_numpy(view)) != checksums[name]:
                    raise WeightVersionError(f"{name}: checksum mismatch after applying the delta")
        finally:
            view = None  # the map closes only once no array points into it
            mm.close()
        f.seek(8)
        f.write(new_header.ljust(n, b" "))
    return True


def _load(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _local_copy(uri: str) -> str | None:
    """This node's complete copy of the version at `uri`, without reading storage: a file:// anchor in
    place, or its node-cache entry; None when there is none."""
    from miles_core.storage.node_local import cached

    if uri.startswith("file://"):
        path = uri[len("file://"):]
        names = os.listdir(path) if os.path.isdir(path) else []
        if COMPLETE_MARKER in names and not is_delta_version(names):
            return path
    with _TOKENS_LOCK:
        token = _TOKENS.get(normalize_uri(uri))
    return cached(uri, "weights", seal_token(Store(uri)) if token is None else token)


def _from_anchor(uri: str, i: int, parts: int, max_chain: int = 1000, *,
                 local_bases: bool = True) -> tuple[dict, bool]:
    """Part i of the version at `uri` rebuilt from the deltas this node lacks: back along the bases to the
    newest one this node holds (a reader that missed some versions) or else to the anchor, then every delta
    applied in order, each checksum verified. A chain started from this node's copy that fails a checksum
    (or cannot be read) is counted and built again from the anchor, all from storage
    (WeightVersionError when that fails too). Returns the part and whether an anchor was read."""
    try:
        return _rebuild(uri, i, parts, max_chain, local_bases=local_bases)
    except _LocalBaseFailed as e:
        log.warning("weights %s part %d: %s; rebuilding it from its anchor", uri, i, e)
        return _rebuild(uri, i, parts, max_chain, local_bases=False)


class _LocalBaseFailed(Exception):
    pass


def _rebuild(uri: str, i: int, parts: int, max_chain: int, local_bases: bool) -> tuple[dict, bool]:
    from safetensors.torch import load

    chain = []
    from_local = False
    for _ in range(max_chain):
        # this node's cache entry of a base (the version asked for is never local); the run root's own anchor,
        # handed out in place, is read below as storage: its checksums verified, counted as an anchor read
        base_dir = _local_copy(uri) if local_bases and chain else None
        if base_dir is not None and is_cache_entry(base_dir):
            try:
                part = _load(os.path.join(base_dir, model_file(i, parts)))
                from_local = True
                break
            except Exception as e:  # noqa: BLE001 - pruned or damaged underneath: go on to storage
                log.info("weights %s part %d: this node's copy is unreadable (%s); reading on", uri, i, e)
        store = Store(uri)
        names = store.list("")
        if delta_file(i, parts) in names:
            blob = store.get_bytes(delta_file(i, parts))
            READS.add(bytes_read=len(blob))
            base_name, sums, encoded = read_delta(blob)
            chain.append((uri, sums, encoded))
            uri = _sibling(uri, base_name)
            continue
        if model_file(i, parts) not in names:
            raise WeightVersionError(f"{uri} holds neither part {i} of {parts} nor its delta: the chain is broken")
        data = store.get_bytes(model_file(i, parts))
        READS.add(bytes_read=len(data), anchors_read=1)
        part = load(data)
        sums = _metadata(data).get(CHECKSUMS)
        if sums is not None:
            verify(part, json.loads(sums), f"{uri}/{model_file(i, parts)}")
        break
    else:
        raise WeightVersionError(f"no anchor within {max_chain} versions before {uri}")
    return _apply_chain(part, chain, from_local), not from_local


def _apply_chain(part: dict, chain: list, from_local: bool) -> dict:
    for at, sums, encoded in reversed(chain):
        try:
            part = apply(part, sums, encoded, in_place=True)
        except WeightVersionError as e:
            READS.add(checksum_failures=1)
            if from_local:
                raise _LocalBaseFailed(f"{at}: {e} on this node's copy of its base") from e
            raise WeightVersionError(f"{at}: rebuilt from its anchor, {e}: not served") from e
        READS.add(deltas_applied=1)
    return part


def staged_read(before: dict, after: dict) -> dict:
    """What rebuilding one version read, from two `READS.snapshot()`s around its `localize_weights`."""
    return {"read_bytes": after["bytes_read"] - before["bytes_read"],
            "apply_seconds": after["apply_seconds"] - before["apply_seconds"],
            "anchor_reads": int(after["anchors_read"] > before["anchors_read"]),
            "checksum_failures": after["checksum_failures"] - before["checksum_failures"]}


def sum_reads(reads: list[dict]) -> dict:
    """Several nodes' `staged_read`s as one: bytes, anchor reads and failures added, the slowest node's seconds."""
    return {"read_bytes": sum(r["read_bytes"] for r in reads), "apply_seconds": max(r["apply_seconds"] for r in reads),
            "anchor_reads": sum(r["anchor_reads"] for r in reads),
            "checksum_failures": sum(r["checksum_failures"] for r in reads)} if reads else {}


def version_dirs(keys: list[str]) -> dict[str, bool]:
    """{version directory: whether it holds a delta part} of a listing of `weights/` (keys `weights/<dir>/<file>`)."""
    dirs: dict[str, bool] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) >= 3:
            dirs[parts[1]] = dirs.get(parts[1], False) or bool(_DELTA.match(parts[2]))
    return dirs


def needed(dirs: dict[str, bool], names: set[str]) -> set[str]:
    """The version directories that rebuilding each of `names` reads: itself and, back from it, every one
    before it up to a whole anchor (a directory without a delta part). A writer's delta is always against
    the version it wrote just before, so these cover every part's chain."""
    order = sorted(dirs)
    out: set[str] = set()
    for name in names:
        if name not in dirs:
            continue
        i = order.index(name)
        out.add(name)
        while dirs[order[i]] and i > 0:
            i -= 1
            out.add(order[i])
    return out
