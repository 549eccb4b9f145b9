"""The ``megatron`` layout's commit without the gather: every DP rank writes its own bytes of Megatron's file.

``mp_rank_*/distrib_optim.pt`` is ``torch.save``'s zip (:mod:`.torch_zip`): records stored, 64-byte aligned,
CRC-32s in data descriptors after the data. Where each record sits depends only on the pickle and the record
sizes, and both follow from the bucket geometry, which every rank of a DP group holds: :func:`plan_file`
computes the whole layout on any rank, without the shards' values. So, on a POSIX file tier whose commit covers
the job:

1. each rank (:func:`write_rank_pieces`) opens one temporary file of the directory, named after the plan's
   digest so every rank of the group finds the same one (never truncated; extended, sparse, to the plan's size),
   writes the bytes of its own shard in each world tensor (per bucket: ``[dp_rank * N_b/DP, min(U_b, ...))``,
   docs/megatron-format.md, "Merging the DP shards into the file") through the tier's positional writer
   (:mod:`tiered_ckpt.tiers._positional`: whole pages with ``O_DIRECT``, the pages it shares with its neighbours
   through the page cache), CRC-32s them on the way,
   calls ``fdatasync``, and lists the ranges in its rank manifest: one entry keyed by the merged file, with each
   range's CRC-32 (``meta.in_place``);
2. the committing rank (:func:`finish_files`), once every rank's manifest is there, checks that the ranges tile
   every tensor record, writes the rest (local headers, ``data.pkl`` and the small records, data descriptors with
   the CRC-32s combined from the ranks' pieces, :mod:`.crc_combine`, the serialization id, the central directory
   and zip64 end records), fsyncs (its own few KiB: the ranks synced theirs), renames the file into place, and
   returns its entry; the checkpoint manifest comes after, as always, and lists the file, not the ranges (those
   stay in the rank manifests, where a load of a rank's part finds them: ``step_read.py``). The file's checksum
   in the manifest is its CRC-32 (``crc32:``), combined the same way: xxh3 cannot be computed from pieces.

The bytes equal the gather path's (:func:`.merge.write_megatron_file`), which stays for what cannot write in
place: fsspec tiers without positional writes (S3 has its own way, :mod:`.inplace_parts`), node-local commits,
compression, chained optimizers whose sub-optimizers are sharded over different groups (EP > 1).

A rank resumed at the same DP size reads its ranges back (:func:`read_rank_shard`), each once, checked as it
arrives.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..checksum import Crc32Hasher
from ..crashpoints import crash_point
from ..errors import CorruptionError, LayoutMismatchError
from ..manifest import FileEntry
from .crc_combine import crc32_combine, crc32_of_parts
from .distrib_optim import shard_key
from .geometry import OptimizerGeometry
from .merge import GroupPart, megatron_object, owner_rank, parts_meta
from .naming import DISTRIB_OPTIM_FILENAME
from .torch_zip import (
    ALIGNMENT,
    StreamedTensor,
    _Entry,
    central_directory,
    descriptor,
    local_header,
    pickle_with_streams,
    serialization_id,
)

ARCHIVE = "distrib_optim"
CRC32 = "crc32"
_SID_LEN = 40  # two zero-padded 20-digit numbers
READ_AHEAD = 8  # ranges read at once when a rank's pieces are checked


@dataclass(frozen=True)
class Record:
    name: str
    offset: int  # of its local header
    header: bytes
    size: int
    data: bytes | None  # the bytes of a small record; None for a tensor

    @property
    def data_offset(self) -> int:
        return self.offset + len(self.header)

    @property
    def end(self) -> int:
        return self.data_offset + self.size + len(descriptor(0, self.size))


@dataclass(frozen=True)
class FilePlan:
    records: tuple[Record, ...]
    tensors: Mapping[int, tuple[int, int, str]]  # record index -> (sub-optimizer, buffer, state key)
    digest: str  # of the pickle and the record layout
    total: int  # the file's size: the central directory's length does not depend on the CRC-32s

    @property
    def end(self) -> int:
        """Where the central directory starts."""
        return self.records[-1].end


def plan_file(parts: Sequence[GroupPart | None]) -> FilePlan:
    """Where every record of the directory's ``distrib_optim.pt`` goes (the shards are not read)."""
    obj = megatron_object(parts)
    states = obj if isinstance(obj, list) else [obj]
    tags: dict[int, tuple[int, int, str]] = {}
    for i, (part, state) in enumerate(zip(parts, states, strict=True)):
        if part is None:
            continue
        for g, buf in enumerate(part.geometry.buffers):
            for key in part.geometry.state_keys:
                tags[id(state[g][buf.dtype_key][key])] = (i, g, key)
    pkl, streams = pickle_with_streams(obj)
    small = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
             ("byteorder", b"little")]
    records: list[Record] = []
    tensors: dict[int, tuple[int, int, str]] = {}
    offset = 0

    def add(name: str, size: int, data: bytes | None) -> None:
        nonlocal offset
        r = Record(name, offset, local_header(f"{ARCHIVE}/{name}".encode(), size, offset), size, data)
        records.append(r)
        offset = r.end

    for name, data in small:
        add(name, len(data), data)
    for i, s in enumerate(streams):
        if not isinstance(s, StreamedTensor) or id(s) not in tags:
            raise LayoutMismatchError("distrib_optim: a tensor of the plan is not a world tensor")
        tensors[len(records)] = tags[id(s)]
        add(f"data/{i}", s.nbytes, None)
    add("version", 2, b"3\n")
    add(".data/serialization_id", _SID_LEN, None)
    h = hashlib.sha256(pkl)
    for r in records:
        h.update(f"{r.name}:{r.offset}:{r.size};".encode())
    tail = central_directory([_Entry(f"{ARCHIVE}/{r.name}".encode(), r.offset, r.size, 0) for r in records], offset)
    return FilePlan(tuple(records), tensors, h.hexdigest()[:32], offset + len(tail))


def temp_key(merged_key: str, plan: FilePlan, run_id: str, step: int) -> str:
    """The temporary file every rank of the directory writes: the same name on each (a tier's temporary-name
    pattern, so listings skip it and ``gc`` knows it), another for another plan, run or step."""
    d, base = merged_key.rsplit("/", 1)
    tag = hashlib.sha256(f"{run_id}\0{step}\0{plan.digest}".encode()).hexdigest()[:16]
    return f"{d}/.{base}.tmp-{tag}"


@dataclass(frozen=True)
class Span:
    """One DP rank's bytes of one bucket of a tensor record: ``[dp * N_b/DP, min(U_b, (dp + 1) * N_b/DP))`` of
    the bucket (docs/megatron-format.md, "Merging the DP shards into the file"), at ``pos`` bytes from the record's
    data."""

    rank: int
    record: int
    pos: int
    length: int
    optimizer: int  # sub-optimizer index
    buffer: int
    bucket: int
    key: str  # state key (param, exp_avg, ...)


def rank_spans(plan: FilePlan, parts: Sequence[GroupPart | None], rank: int | None = None) -> list[Span]:
    """Every DP rank's spans of the file's tensor records (``rank``: one rank's), in file order."""
    out = []
    for t, (i, g, key) in plan.tensors.items():
        part = parts[i]
        assert part is not None
        buf = part.geometry.buffers[g]
        for b, off in enumerate(buf.world_offsets()):
            n, unpadded = buf.shard_numel(b), buf.buckets[b].numel_unpadded
            for dp, owner in enumerate(part.group):
                lo, hi = dp * n, min((dp + 1) * n, unpadded)
                if lo < hi and (rank is None or owner == rank):
                    out.append(Span(owner, t, 4 * (off + lo), 4 * (hi - lo), i, g, b, key))
    return out


def span_bytes(shard: Any, span: Span) -> memoryview:
    """The bytes of one of this rank's spans, from its shard (fp32, as Megatron's file holds them)."""
    src = shard.optimizers[span.optimizer].shards[shard_key(span.buffer, span.bucket, span.key)][:span.length // 4]
    data = src.to(torch.float32).contiguous() if src.dtype != torch.float32 else src.contiguous()
    return memoryview(data.numpy()).cast("B")


def shard_placement(shard: Any, modulus: int) -> dict[int, int]:
    """Where this rank's shard tensors start in its directory's file, modulo ``modulus``: ``{id(tensor): offset %
    modulus}`` for those :func:`span_bytes` sends as they are (fp32: a snapshot's copy is contiguous). A snapshot
    that places them so in memory lets the positional writer send every whole page from the slot, with no bounce
    copy. Empty when the rank cannot plan the file alone (:func:`directory_parts`)."""
    found = directory_parts(shard)
    if found is None:
        return {}
    _, parts = found
    plan = plan_file(parts)
    out: dict[int, int] = {}
    for span in rank_spans(plan, parts, shard.rank):
        t = shard.optimizers[span.optimizer].shards[shard_key(span.buffer, span.bucket, span.key)]
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            out[id(t)] = (plan.records[span.record].data_offset + span.pos) % modulus
    return out


# ------------------------------------------------------------------------------------------------------------
# which ranks write in place


def directory_parts(shard: Any) -> tuple[str, list[GroupPart]] | None:
    """``(mp_rank directory, parts)`` of the file this rank's optimizer state goes to, when the rank can plan it
    alone: every sub-optimizer's DP group has its rank 0 in the same directory (one optimizer, or EP = 1); None
    otherwise (the gather path). ``shard``: the rank's parsed :class:`~.rank_shard.RankShard`."""
    topo = shard.topology
    if len(shard.optimizers) > 1 and topo.ep != 1:
        return None  # the same answer on every rank: the dense and expert groups differ
    dirs = {topo.rank_dir(sub.group[0]) for sub in shard.optimizers}
    if len(dirs) != 1:
        return None
    parts = [GroupPart(i, sub.kind, tuple(sub.group), sub.geometry, ()) for i, sub in enumerate(shard.optimizers)]
    return dirs.pop(), parts


def parts_from_meta(optimizers: Sequence[Mapping[str, Any] | None]) -> list[GroupPart | None]:
    return [None if o is None else GroupPart(i, o["kind"], tuple(o["group"]),
                                             OptimizerGeometry.from_dict(o["geometry"]), ())
            for i, o in enumerate(optimizers)]


def _parts_dicts(parts: Sequence[GroupPart | None]) -> list[dict[str, Any] | None]:
    return [None if p is None else {"kind": p.kind, "group": list(p.group), "geometry": p.geometry.to_dict()}
            for p in parts]


# ------------------------------------------------------------------------------------------------------------
# a rank's part


def write_rank_pieces(writer: Any, step_dir: str, shard: Any, *, run_id: str, step: int) -> dict[str, Any] | None:
    """Write this rank's ranges of its directory's ``distrib_optim.pt`` into the shared temporary file; return
    the ``in_place`` facts for its manifest entry (None: this rank cannot plan the file alone, see
    :func:`directory_parts`). ``writer``: the tier's positional writer (``Tier.positional()``)."""
    found = directory_parts(shard)
    if found is None:
        return None
    directory, parts = found
    plan = plan_file(parts)
    merged = f"{step_dir}/{directory}/{DISTRIB_OPTIM_FILENAME}"
    tmp = temp_key(merged, plan, run_id, step)
    pieces: list[list[int]] = []
    f = writer.open(tmp, size=plan.total)  # sparse until every rank has written
    try:
        for span in rank_spans(plan, parts, shard.rank):
            mv = span_bytes(shard, span)
            crc = Crc32Hasher()
            # whole pages direct, the edges (shared) through the cache
            writer.write_range(f, mv, plan.records[span.record].data_offset + span.pos, crc)
            pieces.append([span.record, span.pos, len(mv), crc.crc])
        writer.sync(f, data_only=True)  # durable before the rank manifest says so: the commit syncs only its own
    finally:
        writer.close(f)
    crash_point("megatron.pieces_written")
    return {"key": merged, "temp": tmp, "plan": plan.digest, "optimizers": _parts_dicts(parts), "pieces": pieces}


def piece_checksum(facts: Mapping[str, Any]) -> tuple[int, str]:
    """Size and checksum of a rank's pieces, in the order written (its manifest entry's)."""
    ps = facts["pieces"]
    return sum(p[2] for p in ps), f"{CRC32}:{crc32_of_parts((p[3], p[2]) for p in ps):08x}"


# ------------------------------------------------------------------------------------------------------------
# the committing rank


def finish_files(writer: Any, step: int, entries: Sequence[FileEntry]) -> list[FileEntry]:
    """Complete every temporary file the ranks' ``in_place`` entries name, rename each into place, and return the
    merged files' entries (as :func:`.merge.merge_step_on_tier` does)."""
    by_key: dict[str, list[FileEntry]] = {}
    for e in entries:
        by_key.setdefault(e.meta["in_place"]["key"], []).append(e)
    return [_finish_one(writer, step, key, group) for key, group in sorted(by_key.items())]


def checked_group(key: str, entries: Sequence[FileEntry], same: Sequence[str] = ("temp",)
                  ) -> tuple[list[GroupPart | None], FilePlan, dict[int, int]]:
    """The parts, plan and tensor records' CRC-32s of the file ``entries`` (every rank's ``in_place`` facts for
    ``key``) wrote, after checking that exactly the file's ranks wrote, all the same plan (and ``same`` facts),
    and that their pieces tile every tensor record."""
    first = entries[0].meta["in_place"]
    parts = parts_from_meta(first["optimizers"])
    plan = plan_file(parts)
    members = sorted({r for p in parts if p is not None for r in p.group})
    got = sorted(e.rank for e in entries)
    if got != members:
        raise LayoutMismatchError(f"{key}: pieces from ranks {got}, the file needs ranks {members}")
    for e in entries:
        facts = e.meta["in_place"]
        if (facts["plan"] != plan.digest or facts["optimizers"] != first["optimizers"]
                or any(facts.get(k) != first.get(k) for k in same)):
            raise LayoutMismatchError(f"{key}: rank {e.rank} planned another file than rank {entries[0].rank}")
    return parts, plan, record_crcs(key, plan, [p for e in entries for p in e.meta["in_place"]["pieces"]])


def _finish_one(writer: Any, step: int, key: str, entries: list[FileEntry]) -> FileEntry:
    parts, plan, crcs = checked_group(key, entries)
    tmp = entries[0].meta["in_place"]["temp"]
    segments, zip_entries, tail = zip_rest(plan, crcs)
    assert zip_entries is not None and tail is not None
    total = plan.end + len(tail)
    if total != plan.total:
        raise LayoutMismatchError(f"{key}: {total} bytes, the plan said {plan.total}")
    f = writer.open(tmp)
    try:
        for offset, data in segments:
            writer.pwrite(f, memoryview(data), offset)
        writer.truncate(f, total)  # a longer file left by another attempt
        writer.sync(f)
    finally:
        writer.close(f)
    crash_point("megatron.in_place_complete")
    writer.rename(tmp, key)
    crash_point("megatron.in_place_renamed")
    return merged_entry(key, plan, parts, zip_entries, tail)


def zip_rest(plan: FilePlan, crcs: Mapping[int, int]) -> tuple[list[tuple[int, bytes]], list[_Entry] | None,
                                                                bytes | None]:
    """Every byte of the file but the tensors' data, as ``(offset, bytes)`` segments in file order, given each
    tensor record's CRC-32 (``crcs``, by record index): then also the zip entries and the central directory (the
    last segment). Given only some, the segments that do not depend on the others: every local header, the small
    records, and the descriptors of the tensor records given (entries and directory: None)."""
    segments: list[tuple[int, bytes]] = []
    zip_entries: list[_Entry] = []
    names, nonempty = [], []
    whole = all(t in crcs for t in plan.tensors)
    for t, r in enumerate(plan.records):
        if r.name == ".data/serialization_id":
            if not whole:
                segments.append((r.offset, r.header))
                continue
            data = serialization_id(names, nonempty).encode()
            assert len(data) == r.size
        else:
            data = r.data
        crc = zlib.crc32(data) if data is not None else crcs.get(t)
        if crc is not None:
            zip_entries.append(_Entry(f"{ARCHIVE}/{r.name}".encode(), r.offset, r.size, crc))
            names.append(r.name)
            if r.size:
                nonempty.append(crc)
        if data is not None:
            segments.append((r.offset, r.header + data + descriptor(crc, r.size)))
        else:
            segments.append((r.offset, r.header))
            if crc is not None:
                segments.append((r.data_offset + r.size, descriptor(crc, r.size)))
    if not whole:
        return segments, None, None
    tail = central_directory(zip_entries, plan.end)
    segments.append((plan.end, tail))
    return segments, zip_entries, tail


def merged_entry(key: str, plan: FilePlan, parts: Sequence[GroupPart | None], zip_entries: list[_Entry],
                 tail: bytes) -> FileEntry:
    """The checkpoint manifest's entry of a merged file the ranks wrote in place (its CRC-32 combined)."""
    total = plan.end + len(tail)
    return FileEntry(key=key, item=ARCHIVE, rank=owner_rank(parts), codec="torch", size=total,
                     checksum=f"{CRC32}:{_file_crc(plan, zip_entries, tail):08x}", compression=None, raw_size=total,
                     meta={**parts_meta(parts), "written": "in_place", "plan": plan.digest})


def record_crcs(key: str, plan: FilePlan, pieces: list[list[int]]) -> dict[int, int]:
    """Each tensor record's CRC-32, combined from the pieces that must tile it exactly."""
    by_record: dict[int, list[list[int]]] = {t: [] for t in plan.tensors}
    for p in pieces:
        if p[0] not in by_record:
            raise CorruptionError(f"{key}: a piece names record {p[0]}, which is not a tensor of the file")
        by_record[p[0]].append(p)
    out = {}
    for t, ps in by_record.items():
        ps.sort(key=lambda p: p[1])
        pos, crc = 0, 0
        for _, start, length, piece_crc in ps:
            if start != pos:
                raise CorruptionError(f"{key}: {plan.records[t].name}: bytes [{pos}, {start}) written by no rank"
                                      if start > pos else f"{key}: {plan.records[t].name}: ranks overlap at {start}")
            crc, pos = crc32_combine(crc, piece_crc, length), pos + length
        if pos != plan.records[t].size:
            raise CorruptionError(f"{key}: {plan.records[t].name}: {pos} of {plan.records[t].size} bytes written")
        out[t] = crc
    return out


def _file_crc(plan: FilePlan, entries: list[_Entry], tail: bytes) -> int:
    crc = 0
    for r, e in zip(plan.records, entries, strict=True):
        crc = crc32_combine(crc, zlib.crc32(r.header), len(r.header))
        crc = crc32_combine(crc, e.crc, r.size)
        d = descriptor(e.crc, r.size)
        crc = crc32_combine(crc, zlib.crc32(d), len(d))
    return crc32_combine(crc, zlib.crc32(tail), len(tail))


def read_rank_shard(tier: Any, entry: FileEntry, rank: int, topology: Any, *, verify: bool) -> dict[str, Any]:
    """Rank ``rank``'s optimizer shard (the item :func:`.rank_shard.build` makes) read back from the merged file
    its manifest ``entry`` describes (``meta.in_place``), at the DP size that wrote it: only the rank's ranges
    are read, each once, a few at a time (on an object store each is a request of its own), and checked against
    the CRC-32s the rank recorded while writing them (``verify``; a CorruptionError names the file, rank, offset
    and record). The padding Megatron's file does not hold is zeros, as a load through Megatron's object gives.
    LayoutMismatchError when ``topology`` puts the rank in other DP groups than the ones that wrote the file."""
    from .rank_shard import SubOptimizerShard, as_topology, build, dp_group

    facts = entry.meta["in_place"]
    key = facts["key"]
    parts = parts_from_meta(facts["optimizers"])
    plan = plan_file(parts)
    topo = as_topology(topology)
    subs: dict[int, SubOptimizerShard] = {}  # by sub-optimizer index
    for part in parts:
        if part is None:
            continue
        if tuple(dp_group(topo, rank, part.kind)) != part.group:
            raise LayoutMismatchError(f"{key}: rank {rank}'s {part.kind} DP group in this job is not the group "
                                      f"{list(part.group)} that wrote the file")
        geo = part.geometry
        shards = {shard_key(g, b, k): torch.zeros(buf.shard_numel(b), dtype=torch.float32)
                  for g, buf in enumerate(geo.buffers) for b in range(len(buf.buckets)) for k in geo.state_keys}
        subs[part.index] = SubOptimizerShard(geo, part.group.index(rank), part.group, shards, part.kind)
    spans = rank_spans(plan, parts, rank)
    pieces = facts["pieces"]
    if [(s.record, s.pos, s.length) for s in spans] != [tuple(p[:3]) for p in pieces]:
        raise CorruptionError(f"{key}: rank {rank}'s manifest lists other ranges than the file's plan gives it",
                              key=key)

    def fill(span_piece: tuple[Span, Sequence[int]]) -> None:
        span, (t, pos, length, crc) = span_piece
        data = tier.read_range(key, plan.records[t].data_offset + pos, length)  # the tier refuses a short range
        if verify:
            hasher = Crc32Hasher()
            hasher.update(data)
            if hasher.crc != crc:
                raise CorruptionError(f"{key}: rank {rank}'s bytes at {pos} of {plan.records[t].name} differ "
                                      "from what it wrote", key=key)
        out = subs[span.optimizer].shards[shard_key(span.buffer, span.bucket, span.key)]
        memoryview(out.view(torch.uint8).numpy())[:length] = data

    with ThreadPoolExecutor(max(1, min(READ_AHEAD, len(spans))), thread_name_prefix="tiered_ckpt-pieces") as pool:
        list(pool.map(fill, zip(spans, pieces, strict=True)))
    return build(rank=rank, topology=topo, optimizers=list(subs.values()))
