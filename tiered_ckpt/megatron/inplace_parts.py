"""The ``megatron`` layout's gather-free commit on an object store: Megatron's ``distrib_optim.pt`` as one
multipart upload whose parts the DP ranks send themselves.

:mod:`.inplace` writes the file at known offsets on a POSIX tier. An object store has no such write, but S3 builds
an object from numbered parts that different clients may send (:meth:`~tiered_ckpt.tiers.base.Tier.shared_parts`).
Every rank of the directory computes the same plan (:func:`plan_parts`): the file cut into parts at its ranks'
spans, each part at least S3's minimum (spans too short alone are grouped with their neighbours), long spans cut
at the tier's ``part_size``, and the file's tail (the last descriptor, ``version``, the serialization id and the
central directory) the last part, which the committing rank sends. A part's *uploader* is the rank holding most of
its bytes; the bytes around the spans (local headers, small records, data descriptors) go with the part they fall
in. So, per step and directory:

1. the directory's first rank starts the upload and publishes its id (a small object); every rank writes the
   CRC-32 of each of its spans (another), and the spans it holds in parts another rank uploads (``loose``: only
   short spans, grouped into a part, are ever loose; always whole) as objects of their own, each named after the
   upload, so that no save reads what a save with another upload left;
2. each rank uploads its parts: those that need nothing first, then those that hold a record's data descriptor
   (they wait for every rank's CRC-32s, combined with :mod:`.crc_combine`) or another rank's loose span (checked
   against that rank's CRC-32 before it is sent); its rank manifest lists its spans (``pieces``, as the POSIX path
   does), its part entries, and the CRC-32s of the descriptors and loose spans it sent;
3. the committing rank (:func:`finish_uploads`), once every rank's manifest is there, checks that the ranks'
   parts are exactly the plan's and that the descriptors and loose spans they sent agree with the ranks' pieces
   (a step saved again over a crashed save of it that used the same upload fails here, never silently), sends
   the last part, completes the upload (the object appears whole, under its final key) and removes the side
   objects.

Nothing goes through the committing rank but the file's tail. The side objects are named as the tier's temporary
files (``.distrib_optim.pt.<what>.tmp-<16 hex>``): listings skip them, and removing those a dead job left (``gc``,
or retention deleting the step) aborts the upload its token names (:mod:`tiered_ckpt.tiers._s3_parts`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from ..checksum import Crc32Hasher
from ..crashpoints import crash_point
from ..errors import BlobNotFoundError, CorruptionError, LayoutMismatchError, PermanentTierError, TransientTierError
from ..manifest import FileEntry
from ..tiers._s3_parts import UPLOAD_TOKEN
from .inplace import (
    FilePlan,
    Span,
    _parts_dicts,
    checked_group,
    directory_parts,
    merged_entry,
    plan_file,
    rank_spans,
    record_crcs,
    span_bytes,
    temp_key,
    zip_rest,
)
from .merge import owner_rank
from .naming import DISTRIB_OPTIM_FILENAME

log = logging.getLogger(__name__)

T = TypeVar("T")
PEER_WAIT_S = 300.0  # how long a rank waits for another rank's upload id, CRC-32s or loose span
COMMITTER = -1  # the uploader of the file's tail


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[lo, hi)`` of span ``span`` (an index into the plan's spans)."""

    span: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Part:
    number: int
    start: int  # file offsets
    end: int
    uploader: int  # a rank, or COMMITTER
    chunks: tuple[Chunk, ...]
    descriptors: tuple[int, ...]  # tensor records whose data descriptor lies in the part


@dataclass(frozen=True)
class PartPlan:
    file: FilePlan
    spans: tuple[Span, ...]
    parts: tuple[Part, ...]  # the last one: the committing rank's tail
    part_size: int

    def loose(self) -> list[tuple[Part, Chunk]]:
        """Spans a rank holds in a part another rank uploads."""
        return [(p, c) for p in self.parts for c in p.chunks if self.spans[c.span].rank != p.uploader]


def plan_parts(plan: FilePlan, spans: Sequence[Span], *, part_size: int, min_part: int, max_part: int,
               max_parts: int) -> PartPlan | None:
    """Cut the file into parts (module doc); None where S3's limits cannot be met (the gather then writes it)."""
    if not spans:
        return None
    # a part is at most one cut, a short piece merged into it, short chunks before it and a few KiB of records
    cut = max(min_part, min(part_size, max_part - 3 * min_part))
    chunks: list[Chunk] = []
    for k, s in enumerate(spans):
        n = max(1, -(-s.length // cut))
        bounds = [min(j * cut, s.length) for j in range(n)] + [s.length]
        if n > 1 and bounds[-1] - bounds[-2] < min_part:
            del bounds[-2]  # a short last piece joins the one before it
        chunks += [Chunk(k, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    groups: list[list[Chunk]] = []
    size = 0
    for c in chunks:
        if not groups or size >= min_part:
            groups.append([])
            size = 0
        groups[-1].append(c)
        size += c.size
    if size < min_part:  # the last group is short: it joins the one before (the tail part takes no data)
        if len(groups) == 1:
            return None
        last = groups.pop()
        groups[-1] += last
    if len(groups) + 1 > max_parts:
        return None

    def offset(c: Chunk) -> int:
        s = spans[c.span]
        return plan.records[s.record].data_offset + s.pos + c.lo

    ends = {plan.records[t].data_offset + plan.records[t].size: t for t in plan.tensors}
    starts = [0] + [offset(g[0]) for g in groups[1:]]
    tail_start = offset(groups[-1][-1]) + groups[-1][-1].size
    parts = []
    for i, g in enumerate(groups):
        start, end = starts[i], starts[i + 1] if i + 1 < len(groups) else tail_start
        if end - start > max_part:
            return None
        held: dict[int, int] = {}
        for c in g:
            rank = spans[c.span].rank
            held[rank] = held.get(rank, 0) + c.size
        uploader = min(held, key=lambda r: (-held[r], r))
        if any(spans[c.span].rank != uploader and (c.lo, c.hi) != (0, spans[c.span].length) for c in g):
            return None  # a loose chunk is always a whole span (its CRC-32 is the span's); never otherwise
        descriptors = tuple(t for e, t in ends.items() if start <= e < end)
        parts.append(Part(i + 1, start, end, uploader, tuple(g), descriptors))
    parts.append(Part(len(groups) + 1, tail_start, plan.total, COMMITTER, (), (max(plan.tensors),)))
    return PartPlan(plan, tuple(spans), tuple(parts), part_size)


# ------------------------------------------------------------------------------------------------------------
# names of the side objects


def _side_key(merged: str, tag: str, what: str) -> str:
    d, base = merged.rsplit("/", 1)
    return f"{d}/.{base}.{what}.tmp-{tag}"


@dataclass(frozen=True)
class SideObjects:
    """The objects the ranks of one file meet through: the upload's token (per run, step and plan), and per upload
    (so no save reads what a save that used another upload left) every rank's CRC-32s and the loose spans."""

    merged: str
    tag: str
    upload_id: str = ""

    @property
    def upload(self) -> str:
        return _side_key(self.merged, self.tag, UPLOAD_TOKEN)

    def of(self, upload_id: str) -> SideObjects:
        return SideObjects(self.merged, self.tag, upload_id)

    @property
    def _u(self) -> str:
        assert self.upload_id, "the side objects of an upload need its id"
        return hashlib.sha256(self.upload_id.encode()).hexdigest()[:12]

    def crcs(self, rank: int) -> str:
        return _side_key(self.merged, self.tag, f"crc-{rank:05d}-{self._u}")

    def loose(self, span: Span) -> str:
        return _side_key(self.merged, self.tag, f"span-{span.record}-{span.pos}-{self._u}")

    def all(self, pp: PartPlan, ranks: Sequence[int]) -> list[str]:
        return [self.upload, *(self.crcs(r) for r in ranks), *(self.loose(pp.spans[c.span]) for _, c in pp.loose())]


def _sides(merged: str, plan: FilePlan, run_id: str, step: int) -> SideObjects:
    return SideObjects(merged, temp_key(merged, plan, run_id, step).rsplit(".tmp-", 1)[1])


def _await(tier: Any, key: str, wait_s: float, what: str, read: Callable[[], T]) -> T:
    """``read()`` once it finds what another rank writes at ``key`` (it raises BlobNotFoundError until then), up to
    ``wait_s``."""
    retrying = tenacity.Retrying(stop=tenacity.stop_after_delay(wait_s),
                                 wait=tenacity.wait_exponential(multiplier=0.02, max=1.0),
                                 retry=tenacity.retry_if_exception_type(BlobNotFoundError), reraise=True)
    try:
        return retrying(read)
    except BlobNotFoundError:
        raise TransientTierError(f"waited {wait_s:.0f} s for {what} ({key}), which its rank has not written: is "
                                 f"that rank alive and draining to this tier?", tier=tier.name, key=key) from None


def _await_blob(tier: Any, key: str, wait_s: float, what: str) -> bytes:
    """The bytes of a small object another rank writes, once it is there (up to ``wait_s``)."""
    return _await(tier, key, wait_s, what, lambda: tier.read_blob(key).numpy().tobytes())


def _await_upload(uploads: Any, tier: Any, merged: str, sides: SideObjects, wait_s: float, owner: int,
                  part_size: int) -> str:
    """The upload the directory's first rank published, once its token names an upload of ``merged`` the store
    still knows (a token left by an earlier save of this step may name one completed or aborted since: its rank
    then publishes a new one). A rank configured with another ``part_size`` plans other parts: named at once."""
    def read() -> str:
        named = uploads.published(sides.upload)
        if named is None or named["key"] != merged or not uploads.alive(merged, named["upload"]):
            raise BlobNotFoundError("no open upload published yet", tier=tier.name, key=sides.upload)
        if named.get("part_size") != part_size:
            raise LayoutMismatchError(f"{merged}: rank {owner} cuts the file into parts of {named.get('part_size')} "
                                      f"bytes, this rank into {part_size}: give every rank the tier's same part_size")
        return str(named["upload"])

    return _await(tier, sides.upload, wait_s, f"an open upload of {merged} from rank {owner}", read)


# ------------------------------------------------------------------------------------------------------------
# a rank's parts


def write_rank_parts(uploads: Any, tier: Any, step_dir: str, shard: Any, *, run_id: str, step: int,
                     wait_s: float = PEER_WAIT_S) -> dict[str, Any] | None:
    """Upload this rank's parts of its directory's ``distrib_optim.pt`` (module doc); return the ``in_place``
    facts for its manifest entry, or None where the file is left to the gather (this rank cannot plan it alone,
    or S3's part limits cannot be met: every rank of the directory decides the same)."""
    found = directory_parts(shard)
    if found is None:
        return None
    directory, parts = found
    plan = plan_file(parts)
    pp = plan_parts(plan, rank_spans(plan, parts), part_size=uploads.part_size, min_part=uploads.min_part,
                    max_part=uploads.max_part, max_parts=uploads.max_parts)
    merged = f"{step_dir}/{directory}/{DISTRIB_OPTIM_FILENAME}"
    if pp is None:
        log.info("%s: no cut into S3 parts of %d to %d bytes (%d at most) fits this file: it is gathered at "
                 "commit", merged, uploads.min_part, uploads.max_part, uploads.max_parts)
        return None
    me = shard.rank
    sides = _sides(merged, plan, run_id, step)
    if me == owner_rank(parts):
        upload_id = _open_upload(uploads, merged, sides, pp.part_size)
    else:  # the upload first: what this rank leaves for the others is named after it
        upload_id = _await_upload(uploads, tier, merged, sides, wait_s, owner_rank(parts), pp.part_size)
    sides = sides.of(upload_id)

    data = {k: span_bytes(shard, s) for k, s in enumerate(pp.spans) if s.rank == me}
    own_crcs: dict[int, int] = {}
    for k, mv in data.items():
        h = Crc32Hasher()
        h.update(mv)
        own_crcs[k] = h.crc
    pieces = [[pp.spans[k].record, pp.spans[k].pos, pp.spans[k].length, own_crcs[k]] for k in sorted(data)]
    tier.write_blob(sides.crcs(me), [json.dumps(pieces).encode()])
    for _, c in pp.loose():
        if pp.spans[c.span].rank == me:
            tier.write_blob(sides.loose(pp.spans[c.span]), [data[c.span]])
    context = _PeerBytes(tier, pp, sides, parts, wait_s)
    mine = [p for p in pp.parts if p.uploader == me]
    # parts that wait for nothing first: the others' CRC-32s and loose spans are then most likely there
    mine.sort(key=lambda p: (bool(p.descriptors) or any(pp.spans[c.span].rank != me for c in p.chunks), p.number))
    used: dict[int, int] = {}

    def body(part: Part) -> Callable[[], memoryview]:
        return lambda: _part_bytes(pp, part, data, context, used)

    sent = uploads.upload(merged, upload_id, [(p.number, body(p)) for p in mine])  # parts made as they go out
    crash_point("megatron.parts_sent")
    return {"key": merged, "upload": upload_id, "part_size": pp.part_size, "sides": sides.tag, "plan": plan.digest,
            "optimizers": _parts_dicts(parts), "pieces": pieces, "parts": sorted(sent, key=lambda e: e["PartNumber"]),
            "descriptors": {str(t): crc for t, crc in sorted(used.items())},
            "loose": [[s.record, s.pos, crc] for s, crc in sorted(context.sent_loose.items(),
                                                                  key=lambda x: (x[0].record, x[0].pos))]}


def _open_upload(uploads: Any, merged: str, sides: SideObjects, part_size: int) -> str:
    """The directory's upload: the one its token names while the store still knows it (an earlier attempt of this
    rank, whose parts other ranks may have sent already), else a new one."""
    named = uploads.published(sides.upload)
    if (named is not None and named["key"] == merged and named.get("part_size") == part_size
            and uploads.alive(merged, named["upload"])):
        return str(named["upload"])
    upload_id = uploads.create(merged)
    uploads.publish(sides.upload, merged, upload_id, part_size=part_size)
    return str(upload_id)


class _PeerBytes:
    """What a part needs from the other ranks, read once: every rank's CRC-32s, loose spans (verified)."""

    def __init__(self, tier: Any, pp: PartPlan, sides: SideObjects, parts: Sequence[Any], wait_s: float):
        self.tier, self.pp, self.sides, self.wait_s = tier, pp, sides, wait_s
        self.members = sorted({r for p in parts if p is not None for r in p.group})
        self._crcs: dict[int, int] | None = None
        self.sent_loose: dict[Span, int] = {}  # loose spans used, and their CRC-32s (for the commit's check)
        self._lock = threading.Lock()

    def record_crcs(self) -> dict[int, int]:
        with self._lock:  # parts are made on several threads: the CRC-32s are read once
            return self._read_crcs()

    def _read_crcs(self) -> dict[int, int]:
        if self._crcs is None:
            pieces = []
            for r in self.members:
                raw = _await_blob(self.tier, self.sides.crcs(r), self.wait_s, f"the CRC-32s of rank {r}")
                pieces += json.loads(raw)
            self._crcs = record_crcs(self.sides.merged, self.pp.file, pieces)
        return self._crcs

    def loose(self, span: Span) -> memoryview:
        """A span another rank left for this one, once it agrees with that rank's CRC-32s (read again each time:
        a rank writes its CRC-32s, then its spans, so a mismatch is one of them still being written)."""
        key = self.sides.loose(span)
        name = self.pp.file.records[span.record].name

        def read() -> bytes:
            raw = self.tier.read_blob(key).numpy().tobytes()
            listed = {(p[0], p[1]): p[3] for p in json.loads(self.tier.read_blob(self.sides.crcs(span.rank))
                                                             .numpy().tobytes())}
            h = Crc32Hasher()
            h.update(raw)
            if len(raw) != span.length or h.crc != listed.get((span.record, span.pos)):
                raise BlobNotFoundError(f"rank {span.rank}'s span and its CRC-32s disagree ({len(raw)} bytes, "
                                        f"{span.length} planned)", tier=self.tier.name, key=key)
            self.sent_loose[span] = h.crc
            return raw

        return memoryview(_await(self.tier, key, self.wait_s, f"rank {span.rank}'s span of {name}", read))


def _part_bytes(pp: PartPlan, part: Part, own: Mapping[int, memoryview], peers: _PeerBytes | None,
                used: dict[int, int], crcs: Mapping[int, int] | None = None) -> memoryview:
    """The bytes of one part: its chunks (this rank's own, or loose spans from ``peers``) and the zip records'
    bytes around them."""
    pieces: list[tuple[int, memoryview]] = []
    for c in part.chunks:
        s = pp.spans[c.span]
        src = own[c.span] if c.span in own else peers.loose(s)  # type: ignore[union-attr]
        pieces.append((pp.file.records[s.record].data_offset + s.pos + c.lo, src[c.lo:c.hi]))
    if len(pieces) == 1 and pieces[0][0] == part.start and len(pieces[0][1]) == part.end - part.start:
        return pieces[0][1]  # a part of one span's bytes alone: sent from the shard's memory
    if crcs is None:
        crcs = peers.record_crcs() if part.descriptors and peers is not None else {}
    used.update({t: crcs[t] for t in part.descriptors if t in crcs})
    segments, _, _ = zip_rest(pp.file, crcs)
    pieces += [(o, memoryview(b)) for o, b in segments]
    out = bytearray(part.end - part.start)
    covered = 0
    for offset, b in pieces:
        lo, hi = max(offset, part.start), min(offset + len(b), part.end)
        if lo < hi:
            out[lo - part.start:hi - part.start] = b[lo - offset:hi - offset]
            covered += hi - lo
    if covered != len(out):
        raise LayoutMismatchError(f"distrib_optim.pt: part {part.number} [{part.start}, {part.end}) has {covered} "
                                  f"of {len(out)} bytes from its plan")
    return memoryview(out)


# ------------------------------------------------------------------------------------------------------------
# the committing rank


def finish_uploads(uploads: Any, tier: Any, step: int, entries: Sequence[FileEntry]) -> list[FileEntry]:
    """Send the last part of every upload the ranks' ``in_place`` entries name, complete it, remove the side
    objects; the merged files' entries."""
    by_key: dict[str, list[FileEntry]] = {}
    for e in entries:
        by_key.setdefault(e.meta["in_place"]["key"], []).append(e)
    return [_finish_one(uploads, tier, step, key, group) for key, group in sorted(by_key.items())]


def _md5_etag(data: memoryview) -> str:
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


def _finish_one(uploads: Any, tier: Any, step: int, key: str, entries: list[FileEntry]) -> FileEntry:
    first = entries[0].meta["in_place"]
    parts, plan, crcs = checked_group(key, entries, same=("upload", "part_size", "sides"))
    pp = plan_parts(plan, rank_spans(plan, parts), part_size=first["part_size"], min_part=uploads.min_part,
                    max_part=uploads.max_part, max_parts=uploads.max_parts)
    if pp is None:
        raise LayoutMismatchError(f"{key}: the ranks sent parts of a file this tier cannot cut into parts")
    upload_id = first["upload"]
    owned = {(p[0], p[1]): p[3] for e in entries for p in e.meta["in_place"]["pieces"]}
    sent: dict[int, dict[str, Any]] = {}
    for e in entries:
        facts = e.meta["in_place"]
        want = {p.number for p in pp.parts if p.uploader == e.rank}
        got = [int(p["PartNumber"]) for p in facts["parts"]]
        if sorted(got) != sorted(want):
            raise LayoutMismatchError(f"{key}: rank {e.rank} sent parts {sorted(got)[:8]}, the plan gives it "
                                      f"{sorted(want)[:8]}")
        for record, pos, crc in facts.get("loose", []):
            if owned.get((record, pos)) != crc:
                raise CorruptionError(f"{key}: rank {e.rank} sent a span of {plan.records[record].name} at {pos} "
                                      f"with CRC-32 {crc:08x}, its rank lists {owned.get((record, pos), 0):08x} "
                                      f"(a span left by another save of this step?)", key=key)
        for t, crc in facts.get("descriptors", {}).items():
            if crcs.get(int(t)) != crc:
                raise CorruptionError(f"{key}: rank {e.rank} sent the data descriptor of "
                                      f"{plan.records[int(t)].name} with CRC-32 {crc:08x}, the ranks' pieces give "
                                      f"{crcs.get(int(t), 0):08x} (CRC-32s left by another save of this step?)",
                                      key=key)
        sent.update({int(p["PartNumber"]): p for p in facts["parts"]})
    tail = pp.parts[-1]
    body = _part_bytes(pp, tail, {}, None, {}, crcs)
    _, zip_entries, directory = zip_rest(plan, crcs)
    assert zip_entries is not None and directory is not None
    if uploads.alive(key, upload_id):
        sent.update({p["PartNumber"]: p for p in uploads.upload(key, upload_id, [(tail.number, body)])})
        crash_point("megatron.tail_sent")
        uploads.complete(key, upload_id, list(sent.values()), nbytes=plan.total)
        crash_point("megatron.upload_completed")
    elif not uploads.completed_as(key, [*sent.values(), {"PartNumber": tail.number, "ETag": _md5_etag(body)}]):
        # not a completion of ours whose answer was lost (a retry of this commit): the upload is gone
        raise PermanentTierError(f"the ranks' upload {upload_id} of this step's file is neither open nor completed "
                                 f"as this object (aborted, or removed by a lifecycle rule?)", tier=tier.name,
                                 key=key)
    members = sorted({r for p in parts if p is not None for r in p.group})
    for side in SideObjects(key, first["sides"], upload_id).all(pp, members):
        try:
            tier.delete(side)
        except Exception as exc:  # debris only: gc removes it
            log.warning("tier %r: could not remove %s after completing %s: %s", tier.name, side, key, exc)
    return merged_entry(key, plan, parts, zip_entries, directory)


__all__ = ["PEER_WAIT_S", "PartPlan", "finish_uploads", "plan_parts", "write_rank_parts"]
