"""Manifests: the JSON commit records. A checkpoint on a tier exists only once its manifest does.

* a *rank manifest* (``iter_XXXXXXX/tiered_ckpt/rank_RRRRR.json``) lists the files one rank wrote for a step: it
  is that rank's vote that its part is complete;
* the *checkpoint manifest* (``iter_XXXXXXX/tiered_ckpt/manifest.json``) is written by the committing rank once
  every rank's vote is present, and lists every file of the step with size and checksum.

Manifests are data, never code: they are parsed strictly and every path in them is validated. Each carries a
``digest`` of its own content: a flipped byte that still parses (an item's name, a rank, the parallel layout)
is caught too, never loaded as a valid but different manifest.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .checksum import ALGORITHM, digest
from .errors import CorruptionError
from .parallel import ParallelLayout
from .tiers.base import check_key

VERSION = 1
RANK_FORMAT = "tiered_ckpt.rank_manifest"
CHECKPOINT_FORMAT = "tiered_ckpt.manifest"


@dataclass(frozen=True)
class FileEntry:
    key: str  # relative to the tier's root
    item: str  # the logical item this file holds (e.g. "model_optim_rng")
    rank: int
    codec: str  # "flat" or "torch" (a registered codec)
    size: int  # stored bytes
    checksum: str  # "<algorithm>:<hex>" of the stored bytes
    compression: str | None = None
    raw_size: int | None = None  # bytes before compression
    meta: dict[str, Any] = field(default_factory=dict)  # codec-specific small facts


@dataclass(frozen=True)
class RankManifest:
    step: int
    rank: int
    layout: str
    coords: dict[str, int]
    parallel: dict[str, Any]
    files: tuple[FileEntry, ...]
    run_id: str = "default"
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointManifest:
    step: int
    layout: str
    parallel: dict[str, Any]
    files: tuple[FileEntry, ...]
    run_id: str = "default"
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.parallel.get("world_size", 1))

    def files_of(self, rank: int) -> list[FileEntry]:
        return [f for f in self.files if f.rank == rank]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _dump(fmt: str, obj: Any) -> bytes:
    body = asdict(obj)
    body["files"] = [asdict(f) for f in obj.files]
    doc = json.loads(json.dumps({"format": fmt, "version": VERSION, **body}))  # as a reader will see it
    doc["digest"] = content_digest(doc)
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def content_digest(doc: dict) -> str:
    """The checksum of a JSON record's content (every field but ``digest``), independent of its formatting."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return f"{ALGORITHM}:{digest(json.dumps(body, sort_keys=True, separators=(',', ':')).encode())}"


def dump_rank(m: RankManifest) -> bytes:
    return _dump(RANK_FORMAT, m)


def dump_checkpoint(m: CheckpointManifest) -> bytes:
    return _dump(CHECKPOINT_FORMAT, m)


class _Reader:
    """Strict field access that turns every problem into a CorruptionError naming the manifest."""

    def __init__(self, data: dict, where: str, tier: str | None):
        self.data, self.where, self.tier = data, where, tier

    def fail(self, msg: str) -> CorruptionError:
        return CorruptionError(f"malformed manifest: {msg}", tier=self.tier, key=self.where)

    def get(self, d: dict, key: str, types: type | tuple, path: str, optional: bool = False) -> Any:
        if key not in d:
            if optional:
                return None
            raise self.fail(f"{path}{key} is missing")
        v = d[key]
        if v is None and optional:
            return None
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types)):
            raise self.fail(f"{path}{key}: expected {_names(types)}, got {type(v).__name__}")
        return v

    def file(self, d: Any, i: int) -> FileEntry:
        path = f"files[{i}]."
        if not isinstance(d, dict):
            raise self.fail(f"files[{i}]: expected an object")
        unknown = sorted(set(d) - _FILE_FIELDS, key=str)
        if unknown:
            raise self.fail(f"{path}{unknown[0]}: unknown field")
        key = self.get(d, "key", str, path)
        try:
            check_key(key)
        except ValueError as exc:
            raise self.fail(f"{path}key: {exc}") from None
        size = self.get(d, "size", int, path)
        raw = self.get(d, "raw_size", int, path, optional=True)
        if size < 0 or (raw is not None and raw < 0):
            raise self.fail(f"{path}size: negative")
        checksum = self.get(d, "checksum", str, path)
        if ":" not in checksum:
            raise self.fail(f"{path}checksum: expected '<algorithm>:<hex>', got {checksum!r}")
        return FileEntry(
            key=key, item=self.get(d, "item", str, path), rank=self.get(d, "rank", int, path),
            codec=self.get(d, "codec", str, path), size=size, checksum=checksum,
            compression=self.get(d, "compression", str, path, optional=True), raw_size=raw,
            meta=self.get(d, "meta", dict, path, optional=True) or {},
        )


_COMMON_FIELDS = {"format", "version", "digest", "step", "layout", "parallel", "files", "run_id", "created", "extra"}
_FIELDS = {RANK_FORMAT: _COMMON_FIELDS | {"rank", "coords"}, CHECKPOINT_FORMAT: _COMMON_FIELDS}
_FILE_FIELDS = {"key", "item", "rank", "codec", "size", "checksum", "compression", "raw_size", "meta"}


def _as_tuple(t: type | tuple) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _names(t: type | tuple) -> str:
    return " or ".join(x.__name__ for x in _as_tuple(t))


def _parse(data: bytes, fmt: str, where: str, tier: str | None) -> tuple[_Reader, dict]:
    try:
        d = json.loads(bytes(data).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, a 5000-digit number, nested too deeply
        raise CorruptionError(f"manifest is not valid JSON: {exc}", tier=tier, key=where) from None
    r = _Reader(d, where, tier)
    if not isinstance(d, dict):
        raise r.fail("expected a JSON object")
    if "digest" in d and d["digest"] != content_digest(d):  # manifests of older versions have none
        raise CorruptionError("manifest does not match its digest: it changed after it was written",
                              tier=tier, key=where)
    if d.get("format") != fmt:
        raise r.fail(f"format: expected {fmt!r}, got {d.get('format')!r}")
    if d.get("version") != VERSION:
        raise r.fail(f"version: expected {VERSION}, got {d.get('version')!r} (written by a newer tiered_ckpt?)")
    unknown = sorted(set(d) - _FIELDS[fmt], key=str)
    if unknown:  # a damaged name (the digest's own included) is not an extension
        raise r.fail(f"unknown field {unknown[0]!r}")
    step = r.get(d, "step", int, "")
    if step < 0:
        raise r.fail("step: negative")
    parallel = r.get(d, "parallel", dict, "")
    try:
        world = ParallelLayout.from_dict(parallel).world_size
    except (TypeError, ValueError, AttributeError) as exc:
        raise r.fail(f"parallel: {exc}") from None
    if parallel.get("world_size", world) != world:
        raise r.fail(f"parallel.world_size: {parallel['world_size']!r} is not the product of the sizes ({world})")
    files = tuple(r.file(f, i) for i, f in enumerate(r.get(d, "files", list, "")))
    outside = [i for i, f in enumerate(files) if not 0 <= f.rank < world]
    if outside:
        raise r.fail(f"files[{outside[0]}].rank: {files[outside[0]].rank} is outside a world of {world}")
    return r, {
        "step": step,
        "layout": r.get(d, "layout", str, ""),
        "parallel": parallel,
        "files": files,
        "run_id": r.get(d, "run_id", str, "", optional=True) or "default",
        "created": float(r.get(d, "created", (int, float), "", optional=True) or 0.0),
        "extra": r.get(d, "extra", dict, "", optional=True) or {},
    }


def load_rank(data: bytes, where: str = "", tier: str | None = None) -> RankManifest:
    r, fields = _parse(data, RANK_FORMAT, where, tier)
    return RankManifest(rank=r.get(r.data, "rank", int, ""), coords=r.get(r.data, "coords", dict, ""), **fields)


def load_checkpoint(data: bytes, where: str = "", tier: str | None = None) -> CheckpointManifest:
    _, fields = _parse(data, CHECKPOINT_FORMAT, where, tier)
    return CheckpointManifest(**fields)
