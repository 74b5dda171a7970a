"""What a checkpoint's COMPLETE marker says about its files, and the check that a checkpoint still has them.

COMPLETE is JSON `{"format": 1, "files": {name: {"size": bytes, "sha256": hex}}}`, names relative to
the step directory, covering every file of every rank. Each writing rank records the digests of the
bytes it commits (`digest`, or `put_tensors`' return) in a per-rank part `files{suffix}.json`; the rank
that marks the checkpoint complete merges the parts (`merge`) into COMPLETE. `problems` checks a
checkpoint against its marker: sizes from one listing always, checksums when asked. A marker written
by an older version is empty: nothing to check, so it is trusted as before (`is_legacy`).
"""

from __future__ import annotations

import hashlib
import json
import re

from miles_core.storage import ObjectNotFound, Store

FORMAT = 1
PART = re.compile(r"^files(\.tp\d{2})?\.json$")


def digest(data: bytes) -> dict:
    """{"size", "sha256"} of bytes about to be committed."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def part_name(suffix: str) -> str:
    return f"files{suffix}.json"


def encode(files: dict[str, dict]) -> bytes:
    return json.dumps({"format": FORMAT, "files": dict(sorted(files.items()))}, indent=1).encode()


def merge(store: Store, d: str, extra: dict[str, dict]) -> dict[str, dict]:
    """Every rank's part under step directory `d` (plus the parts themselves and `extra`): COMPLETE's files."""
    files = dict(extra)
    for key in store.list(d + "/"):
        name = key[len(d) + 1:]
        if PART.match(name):
            raw = store.get_bytes(key)
            files[name] = digest(raw)
            files.update(json.loads(raw))
    return files


def decode(raw: bytes, where: str) -> dict[str, dict] | None:
    """The files a marker lists; None for an older version's empty marker."""
    if not raw.strip():
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{where} is not a checkpoint manifest: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict) \
            or not all(_is_entry(f) for f in doc["files"].values()):
        raise ValueError(f"{where} is not a format-{FORMAT} checkpoint manifest "
                         "(expected 'format' and 'files' of {'size', 'sha256'})")
    return doc["files"]


def _is_entry(f) -> bool:
    return isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)


def is_legacy(files: dict | None) -> bool:
    return files is None


def total_size(files: dict[str, dict]) -> int:
    return sum(int(f["size"]) for f in files.values())


def problems(store: Store, d: str, files: dict[str, dict], checksums: bool) -> list[str]:
    """What is wrong with step directory `d` against the files its marker lists (empty: it verifies)."""
    found = store.list_sizes(d + "/")
    wrong = [_size_problem(name, meta, found.get(f"{d}/{name}")) for name, meta in sorted(files.items())]
    wrong = [w for w in wrong if w]
    if checksums and not wrong:
        wrong = [w for name, meta in sorted(files.items()) if (w := _checksum_problem(store, f"{d}/{name}", meta))]
    return wrong


def _size_problem(name: str, meta: dict, size: int | None) -> str | None:
    if size is None:
        return f"missing file {name}"
    if size != int(meta["size"]):
        return f"{name}: size {size} != {meta['size']} listed in COMPLETE"
    return None


def _checksum_problem(store: Store, key: str, meta: dict) -> str | None:
    try:
        got = hashlib.sha256(store.get_bytes(key)).hexdigest()
    except ObjectNotFound:
        return f"missing file {key.split('/', 1)[1]}"
    if got != meta["sha256"]:
        return f"{key.split('/', 1)[1]}: checksum mismatch (sha256 {got[:12]}… != {meta['sha256'][:12]}… in COMPLETE)"
    return None
