"""Manifests: the JSON commit records. A checkpoint on a tier exists only once its manifest does.

* a *rank manifest* (``iter_XXXXXXX/tiered_ckpt/rank_RRRRR.json``) lists the files one rank wrote for a step: it
  is that rank's vote that its part is complete;
* the *checkpoint manifest* (``iter_XXXXXXX/tiered_ckpt/manifest.json``) is written by the committing rank once
  every rank's vote is present, and lists every file of the step with size and checksum.

Manifests are data, never code: they are parsed strictly and every path in them is validated. Each carries a
``digest`` of its own content: a flipped byte that still parses (an item's name, a rank, the parallel layout)
is caught too, never loaded as a valid but different manifest.

A digest proves only that nobody changed the manifest by accident; a tool (or a person) that rewrites one
recomputes it. So every field is also checked against what the layout allows, and any failure is a
:class:`CorruptionError` naming the manifest and the field (``load()`` then falls back to the next tier):

* the step and rank agree with the manifest's own key, sizes are non-negative and below :data:`MAX_BYTES`,
  ``raw_size`` is the stored size for an uncompressed file and at most :data:`ZSTD_MAX_RATIO` times it for a
  compressed one (an absurd ``raw_size`` would otherwise become an absurd allocation);
* every file lies in the step's directory, once, and is a file its rank writes in the manifest's layout
  (``Layout.item_key`` for that rank's coordinates; or a file the layout derives from others, such as Megatron's
  merged optimizer file): a rank's manifest names only that rank's files, so no rank restores another's state.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .checksum import ALGORITHM, digest
from .errors import CorruptionError
from .parallel import ParallelLayout
from .tiers.base import check_key

VERSION = 1
#: No tier holds more than this in one file; larger sizes would overflow the int64 of tensors and offsets.
MAX_BYTES = 1 << 62
#: zstd's most compact block (RLE) stores 128 KiB in 4 bytes: no frame decompresses to more than this per byte.
ZSTD_MAX_RATIO = 32768
COMPRESSIONS = ("zstd",)
_MAX_STEP = (1 << 63) - 1
_CHECKSUM = re.compile(r"[A-Za-z0-9_]+:[0-9a-f]+")
RANK_FORMAT = "tiered_ckpt.rank_manifest"
CHECKPOINT_FORMAT = "tiered_ckpt.manifest"
# extra[SAVE_KEY]: the identity of the save a manifest belongs to (docs/architecture.md, "Save identity")
SAVE_KEY = "save"


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


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def content_digest(doc: dict) -> str:
    """The checksum of a JSON record's content (every field but ``digest``), independent of its formatting."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return f"{ALGORITHM}:{digest(_canonical(body))}"


def dump_with_digest(doc: dict) -> bytes:
    """``doc`` as compact JSON with its :func:`content_digest` added as the last field, encoding ``doc`` once
    (a slot record embeds a header of up to megabytes, and is written at every save)."""
    text = _canonical(doc)
    comma = b"," if doc else b""
    return b'%s%s"digest":"%s:%s"}' % (text[:-1], comma, ALGORITHM.encode(), digest(text).encode())


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
            raise self.fail(f"{path}{'size' if size < 0 else 'raw_size'}: negative")
        if size > MAX_BYTES:
            raise self.fail(f"{path}size: {size} bytes is more than any tier holds ({MAX_BYTES})")
        compression = self.get(d, "compression", str, path, optional=True)
        if compression is None:
            if raw is not None and raw != size:
                raise self.fail(f"{path}raw_size: {raw} differs from the size {size} of an uncompressed file")
        elif compression not in COMPRESSIONS:
            raise self.fail(f"{path}compression: unknown {compression!r} (known: {', '.join(COMPRESSIONS)})")
        elif raw is None:
            raise self.fail(f"{path}raw_size is missing for a {compression} file")
        elif raw > min(size * ZSTD_MAX_RATIO, MAX_BYTES):
            raise self.fail(f"{path}raw_size: {raw} bytes cannot come from {size} bytes of {compression} (at most "
                            f"{ZSTD_MAX_RATIO} times as many)")
        checksum = self.get(d, "checksum", str, path)
        if ":" not in checksum:
            raise self.fail(f"{path}checksum: expected '<algorithm>:<hex>', got {checksum!r}")
        if not _CHECKSUM.fullmatch(checksum):
            raise self.fail(f"{path}checksum: expected '<algorithm>:<hex digits>', got {checksum[:80]!r}")
        item, codec = self.get(d, "item", str, path), self.get(d, "codec", str, path)
        for name, value in (("item", item), ("codec", codec)):
            if not value or not value.isprintable():
                raise self.fail(f"{path}{name}: expected a name, got {value[:80]!r}")
        meta = self.get(d, "meta", dict, path, optional=True) or {}
        if not isinstance(meta.get("byte_grouping", False), bool):
            raise self.fail(f"{path}meta.byte_grouping: expected a bool, got {type(meta['byte_grouping']).__name__}")
        return FileEntry(
            key=key, item=item, rank=self.get(d, "rank", int, path), codec=codec, size=size, checksum=checksum,
            compression=compression, raw_size=raw, meta=meta,
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
    if not 0 <= step <= _MAX_STEP:
        raise r.fail(f"step: {'negative' if step < 0 else f'{step} is out of range'}")
    parallel = r.get(d, "parallel", dict, "")
    try:
        saved = ParallelLayout.from_dict(parallel)
        world = saved.world_size
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise r.fail(f"parallel: {exc}") from None
    if parallel.get("world_size", world) != world:
        raise r.fail(f"parallel.world_size: {parallel['world_size']!r} is not the product of the sizes ({world})")
    files = tuple(r.file(f, i) for i, f in enumerate(r.get(d, "files", list, "")))
    outside = [i for i, f in enumerate(files) if not 0 <= f.rank < world]
    if outside:
        raise r.fail(f"files[{outside[0]}].rank: {files[outside[0]].rank} is outside a world of {world}")
    layout = r.get(d, "layout", str, "")
    if not layout.strip():
        raise r.fail(f"layout: {layout!r} names no layout")
    created = r.get(d, "created", (int, float), "", optional=True) or 0.0
    if not isinstance(created, float):
        created = float(created) if abs(created) < 1 << 53 else math.inf
    if not math.isfinite(created):
        raise r.fail(f"created: {created!r} is not a time")
    extra = r.get(d, "extra", dict, "", optional=True) or {}
    _check_extra(r, extra, world)
    _check_key_names(r, step, None if fmt == CHECKPOINT_FORMAT else d.get("rank"))
    return r, {
        "step": step,
        "layout": layout,
        "parallel": parallel,
        "files": files,
        "run_id": r.get(d, "run_id", str, "", optional=True) or "default",
        "created": created,
        "extra": extra,
    }


def _check_extra(r: _Reader, extra: dict, world: int) -> None:
    save = extra.get(SAVE_KEY)
    if save is not None and not (isinstance(save, str) and 0 < len(save) <= 128):
        raise r.fail(f"extra.{SAVE_KEY}: expected a save identity (a short string), got {str(save)[:40]!r}")
    ranks = extra.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ranks):
            raise r.fail("extra.ranks: expected a list of ranks")
        if any(not 0 <= x < world for x in ranks) or len(set(ranks)) != len(ranks):
            raise r.fail(f"extra.ranks: expected distinct ranks of a world of {world}, got {ranks[:8]!r}")
    if extra.get("scope", "job") not in ("job", "node"):
        raise r.fail(f"extra.scope: expected 'job' or 'node', got {extra['scope']!r}")


def _check_key_names(r: _Reader, step: int, rank: Any) -> None:
    """The step (and rank) a manifest states agree with the key it was read from, when that key is a manifest's."""
    from .layouts.base import Layout

    if rank is None:
        named = Layout.parse_manifest_key(r.where)
        if named is not None and named != step:
            raise r.fail(f"step: {step}, but the manifest is the one of step {named}")
        return
    parsed = Layout.parse_rank_manifest_key(r.where)
    if parsed is not None and parsed != (step, rank):
        raise r.fail(f"step/rank: {step}/{rank!r}, but the manifest is the one of step {parsed[0]} rank {parsed[1]}")


def _layout(name: str) -> tuple[Any, dict[str, str]]:
    """An instance of the layout registered under ``name`` (None when this process has no such layout), and the
    file extension of each registered codec."""
    from .plugins import get_plugin_manager

    registries = get_plugin_manager().registries
    extensions = {c: str(getattr(registries.codecs.get(c), "extension", "")) for c in registries.codecs}
    return (registries.layouts.get(name)() if name in registries.layouts else None), extensions


def check_ownership(r: _Reader, step: int, layout_name: str, saved: ParallelLayout, files: tuple[FileEntry, ...],
                    rank: int | None) -> None:
    """Every file is in the step's directory, and one its rank writes in the layout, listed once (``rank``: a rank
    manifest's, whose files must all be that rank's own); files the layout derives from others (Megatron's merged
    optimizer file, DCP's ``.metadata``) only need to be in the step's directory. Unknown layouts (a plugin not
    installed here): a ``rank_RRRRR`` directory must be the file's rank."""
    layout, extensions = _layout(layout_name)
    step_dir = f"iter_{step:07d}/"
    seen: set[str] = set()
    ranks: dict[int, Any] = {}  # a rank's coordinates, computed once per manifest
    for i, f in enumerate(files):
        where = f"files[{i}]"
        if not f.key.startswith(step_dir):
            raise r.fail(f"{where}.key: {f.key!r} is outside the directory of step {step} ({step_dir})")
        if rank is not None and f.rank != rank:
            raise r.fail(f"{where}.rank: {f.rank}, in the manifest of rank {rank}: a rank lists only its own files")
        if layout is None:
            others = [p for p in f.key.split("/") if re.fullmatch(r"rank_\d{5,}", p) and int(p[5:]) != f.rank]
            if others:
                raise r.fail(f"{where}.key: {f.key!r} is in another rank's directory ({others[0]}), not in rank "
                             f"{f.rank}'s")
            continue
        if layout.is_derived(f):  # made from other files (at commit, by convert): its place is the layout's
            continue
        if f.key in seen:
            raise r.fail(f"{where}.key: {f.key!r} is listed twice")
        seen.add(f.key)
        extension = extensions.get(f.codec) or f.key.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
        try:
            coords = ranks.get(f.rank) or ranks.setdefault(f.rank, saved.coords(f.rank))
            expected = layout.item_key(step, f.item, coords, extension)
        except Exception as exc:  # noqa: BLE001 - a third-party layout refusing what it is asked is a refusal
            raise r.fail(f"{where}: layout {layout_name!r} has no file {f.item!r} of rank {f.rank}: {exc}") from None
        if expected != f.key:
            wanted = f"its file is {expected!r}" if expected else "that rank writes none"
            raise r.fail(f"{where}.key: {f.key!r} is not rank {f.rank}'s file of item {f.item!r} in layout "
                         f"{layout_name!r} ({wanted})")


def load_rank(data: bytes, where: str = "", tier: str | None = None) -> RankManifest:
    r, fields = _parse(data, RANK_FORMAT, where, tier)
    rank = r.get(r.data, "rank", int, "")
    saved = ParallelLayout.from_dict(fields["parallel"])
    if not 0 <= rank < saved.world_size:
        raise r.fail(f"rank: {rank} is outside a world of {saved.world_size}")
    coords = r.get(r.data, "coords", dict, "")
    own = saved.coords(rank).to_dict()
    wrong = sorted((k for k in coords if k not in own or coords[k] != own[k]), key=str)
    if wrong:
        raise r.fail(f"coords.{wrong[0]}: {coords[wrong[0]]!r}, but rank {rank} of the layout has "
                     f"{own.get(wrong[0], 'no such coordinate')!r}")
    check_ownership(r, fields["step"], fields["layout"], saved, fields["files"], rank)
    return RankManifest(rank=rank, coords=coords, **fields)


def load_checkpoint(data: bytes, where: str = "", tier: str | None = None) -> CheckpointManifest:
    r, fields = _parse(data, CHECKPOINT_FORMAT, where, tier)
    check_ownership(r, fields["step"], fields["layout"], ParallelLayout.from_dict(fields["parallel"]),
                    fields["files"], None)
    return CheckpointManifest(**fields)
