"""Rank-sharded optimizer files → Megatron's ``mp_rank_*/distrib_optim.pt``, streamed and checksummed.

:func:`merge_step_on_tier` is the engine's hook for the ``megatron`` layout: once every rank's
``iter_XXXXXXX/rank_RRRRR/distrib_optim.pt`` (:mod:`.rank_shard`) of a step is on a tier, it writes each
``mp_rank_*/distrib_optim.pt`` from them and returns the manifest entries of the new files. It reads the rank
files range by range and writes bucket by bucket (:func:`~.distrib_optim.iter_merge` into a streamed
``torch.save``, :mod:`.torch_zip`), so memory stays at about one bucket whatever the model size.

The same pieces serve :mod:`.convert` (merge and re-split) and :mod:`.legacy` (a rank's shards at another DP):
:func:`plan_dirs` groups rank files into DP groups and target directories, :class:`ShardWorld` shows a DP group's
shards as Megatron's world tensor without building it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CorruptionError, LayoutMismatchError
from ..manifest import FileEntry
from ..tiers.base import Tier
from . import rank_shard, tier_io
from .distrib_optim import BUCKETS_COALESCED, NUMEL_UNPADDED, MergedPiece, iter_merge, shard_key
from .geometry import BufferGeometry, OptimizerGeometry
from .lazy_torch import LazyArray, LazyTorchFile, copy_range, open_lazy
from .naming import DISTRIB_OPTIM_FILENAME, MegatronTopology, iteration_dir_name
from .torch_zip import StreamedTensor, iter_torch_save

if TYPE_CHECKING:
    from ..file_store import FileStore

OPTIM_ITEM = "distrib_optim"
Progress = Callable[[int], None]


@dataclass(frozen=True)
class GroupPart:
    """One DistributedOptimizer of one DP group: every member's shards, in DP-rank order."""

    index: int  # sub-optimizer index (ChainedOptimizer order)
    kind: str
    group: tuple[int, ...]
    geometry: OptimizerGeometry
    shards: tuple[Mapping[str, Any], ...]


class OpenedFiles:
    """Torch files opened for range reads, verified first when a manifest entry is given; spooled copies of
    compressed files are removed on close."""

    def __init__(self, *, verify: bool = True):
        self.verify = verify
        self.bytes_read = 0
        self._spools: list[Any] = []
        self.files: list[LazyTorchFile] = []

    def open(self, tier: Tier, key: str, entry: FileEntry | None = None) -> LazyTorchFile:
        source, read = tier_io.open_ranges(tier, entry, key, verify=self.verify)
        self.bytes_read += read
        if source is not tier:
            self._spools.append(source)
        f = open_lazy(source, key, where=tier_io.where(tier, key))
        self.files.append(f)
        return f

    @property
    def total_read(self) -> int:
        return self.bytes_read + sum(f.reader.bytes_read for f in self.files)

    def close(self) -> None:
        for s in self._spools:
            s.close()
        self._spools.clear()

    def __enter__(self) -> OpenedFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------------------
# grouping


def plan_dirs(shards: Mapping[int, rank_shard.RankShard]) -> dict[str, list[GroupPart | None]]:
    """For every ``mp_rank_*`` directory that gets a ``distrib_optim.pt``: per sub-optimizer, the DP group whose
    rank 0 lives there (None where it lives elsewhere). Checks that the files form a complete, consistent job.
    """
    if not shards:
        raise LayoutMismatchError("no rank_sharded distrib_optim files to merge")
    first = shards[min(shards)]
    topo, nsub = first.topology, len(first.optimizers)
    missing = sorted(set(range(topo.world_size)) - set(shards))
    if missing:
        raise LayoutMismatchError(f"rank files missing for ranks {missing[:16]} (world {topo.world_size})")
    for r, s in shards.items():
        if s.topology != topo or len(s.optimizers) != nsub:
            raise LayoutMismatchError(f"rank {r}'s file says topology {rank_shard.topology_dict(s.topology)} with "
                                      f"{len(s.optimizers)} optimizers; rank {first.rank}'s says "
                                      f"{rank_shard.topology_dict(topo)} with {nsub}")
    dirs: dict[str, list[GroupPart | None]] = {}
    for r in sorted(shards):
        for i, sub in enumerate(shards[r].optimizers):
            if sub.group[0] != r:
                continue
            members = []
            for dp_rank, m in enumerate(sub.group):
                other = shards[m].optimizers[i]
                if other.group != sub.group or other.dp_rank != dp_rank or other.kind != sub.kind \
                        or other.geometry != sub.geometry:
                    raise LayoutMismatchError(f"rank {m} disagrees with rank {r} on optimizer {i} (kind, DP group "
                                              f"{list(sub.group)} or bucket geometry)")
                members.append(other.shards)
            dirs.setdefault(topo.rank_dir(r), [None] * nsub)[i] = GroupPart(i, sub.kind, sub.group, sub.geometry,
                                                                              tuple(members))
    return dict(sorted(dirs.items()))


def owner_rank(parts: Sequence[GroupPart | None]) -> int:
    """The rank that writes a directory's ``distrib_optim.pt`` (DP rank 0 of its first group)."""
    return next(p.group[0] for p in parts if p is not None)


def parts_meta(parts: Sequence[GroupPart | None]) -> dict[str, Any]:
    """Manifest facts for a merged file: each sub-optimizer's kind, DP size and geometry (so the file can be
    split again exactly, without recomputing the buckets from the model)."""
    return {"optimizers": [None if p is None else {"kind": p.kind, "dp_size": len(p.group),
                                                   "geometry": p.geometry.to_dict()} for p in parts],
            "merged_from": sorted(r for p in parts if p is not None for r in p.group)}


# ------------------------------------------------------------------------------------------------------------
# writing Megatron's file


class _Pieces:
    """Hands the pieces of one :func:`iter_merge` run out to the tensors of the file, checking the order."""

    def __init__(self, pieces: Iterator[MergedPiece]):
        self._pieces = pieces

    def take(self, g: int, key: str, nbuckets: int) -> Iterator[torch.Tensor]:
        for b in range(nbuckets):
            piece = next(self._pieces)
            if (piece.buffer_idx, piece.key, piece.bucket_idx) != (g, key, b):
                raise RuntimeError(f"merge out of order: got {piece[:3]}, wanted {(g, b, key)}")
            tensor = piece.tensor
            del piece
            yield tensor
            del tensor  # the writer is done with it: free it before the next bucket


def streamed_state(part: GroupPart) -> dict[Any, Any]:
    """Megatron's dict for one sub-optimizer (docs/megatron-format.md, "distrib_optim.pt"), each world tensor streamed
    bucket by bucket."""
    pieces = _Pieces(iter_merge(part.shards, part.geometry))
    state: dict[Any, Any] = {BUCKETS_COALESCED: True}
    for g, buf in enumerate(part.geometry.buffers):
        entry: dict[str, Any] = {}
        for key in part.geometry.state_keys:
            entry[key] = StreamedTensor(torch.float32, (buf.numel_unpadded,),
                                        lambda g=g, key=key, n=len(buf.buckets): pieces.take(g, key, n))
        entry[NUMEL_UNPADDED] = buf.numel_unpadded
        state[g] = {buf.dtype_key: entry}
    return state


def megatron_object(parts: Sequence[GroupPart | None]) -> Any:
    """The content of one ``distrib_optim.pt``: a dict for a single optimizer, the list for a chained one."""
    states = [None if p is None else streamed_state(p) for p in parts]
    return states if len(states) > 1 else states[0]


def counted(chunks: Iterator[Any], progress: Progress | None) -> Iterator[Any]:
    if progress is None:
        yield from chunks
        return
    for c in chunks:
        yield c
        progress(memoryview(c).nbytes if not isinstance(c, torch.Tensor) else c.numel() * c.element_size())


def write_megatron_file(store: FileStore, key: str, parts: Sequence[GroupPart | None], *, step: int,
                        progress: Progress | None = None) -> FileEntry:
    """Merge the DP groups of one directory into ``key`` (Megatron's ``distrib_optim.pt``), streamed through
    the file store (its retries and events)."""
    return store.write_file(
        key, lambda: counted(iter_torch_save(megatron_object(parts), archive="distrib_optim"), progress),
        item=OPTIM_ITEM, rank=owner_rank(parts), step=step, meta=parts_meta(parts))


# ------------------------------------------------------------------------------------------------------------
# the engine's hook


def rank_file_keys(tier: Tier, step: int) -> dict[str, int]:
    """``iter_XXXXXXX/rank_RRRRR/distrib_optim.pt`` keys of a step on a tier, with their rank."""
    prefix = f"{iteration_dir_name(step)}/rank_"
    out = {}
    for key in tier.list(prefix):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == DISTRIB_OPTIM_FILENAME and parts[1][5:].isdigit():
            out[key] = int(parts[1][5:])
    return out


def open_rank_shards(tier: Tier, keys: Mapping[str, int], files: OpenedFiles,
                     entries: Mapping[str, FileEntry] | None = None) -> dict[int, rank_shard.RankShard]:
    shards = {}
    for key, rank in keys.items():
        f = files.open(tier, key, (entries or {}).get(key))
        shard = rank_shard.parse(f.obj, where=f.where)
        if shard.rank != rank:
            raise CorruptionError(f"{f.where}: holds rank {shard.rank}'s state, not rank {rank}'s")
        shards[rank] = shard
    return shards


def merge_step_on_tier(
    store: FileStore,
    step: int,
    *,
    topology: Any = None,
    entries: Sequence[FileEntry] | None = None,
    verify: bool = True,
    progress: Progress | None = None,
) -> list[FileEntry]:
    """Write ``iter_<step>/mp_rank_*/distrib_optim.pt`` on ``store`` from the step's rank files; return their
    manifest entries (item ``distrib_optim``, rank = the directory's DP rank 0, ``meta`` = kinds, DP sizes and
    bucket geometry). The rank files stay; the caller decides whether the checkpoint manifest lists them.

    ``topology``: the job's (a ParallelLayout, MegatronTopology or dict), checked against the files.
    ``entries``: the rank files' manifest entries (from the rank manifests): each file is then verified before
    it is used (``verify``) and decompressed if its tier compressed it. Without them nothing is verified.
    """
    tier = store.tier
    keys = rank_file_keys(tier, step)
    by_key = {e.key: e for e in entries or ()}
    with OpenedFiles(verify=verify) as files:
        shards = open_rank_shards(tier, keys, files, by_key)
        if not shards:
            raise LayoutMismatchError(f"step {step}: no rank_*/distrib_optim.pt on tier {tier.name!r}")
        topo = next(iter(shards.values())).topology
        if topology is not None:
            want = rank_shard.as_topology(topology)
            if (want.tp, want.pp, want.dp, want.ep, want.cp) != (topo.tp, topo.pp, topo.dp, topo.ep, topo.cp):
                raise LayoutMismatchError(f"step {step}: rank files were written by {rank_shard.topology_dict(topo)}, "
                                          f"the job is {rank_shard.topology_dict(want)}")
        step_dir = iteration_dir_name(step)
        return [write_megatron_file(store, f"{step_dir}/{d}/{DISTRIB_OPTIM_FILENAME}", parts, step=step,
                                    progress=progress)
                for d, parts in plan_dirs(shards).items()]


# ------------------------------------------------------------------------------------------------------------
# a DP group's shards seen as Megatron's world tensors


class ShardWorld(LazyArray):
    """Buffer ``g``'s world tensor for one state key (docs/megatron-format.md, "distrib_optim.pt"), read from a DP
    group's local shards only where sliced: ``w[a:b]`` reads the parts of the shards that cover ``[a, b)``."""

    def __init__(self, shards: Sequence[Mapping[str, Any]], buf: BufferGeometry, g: int, key: str):
        self.shards, self.buf, self.g, self.key = shards, buf, g, key
        self.dtype = torch.float32
        self.shape = torch.Size([buf.numel_unpadded])
        self._offsets = buf.world_offsets()

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, _ = index.indices(self.numel())
        out = torch.empty(max(0, stop - start), dtype=torch.float32)
        self.copy_into(out, start, max(start, stop))
        return out

    def copy_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        for b, o in enumerate(self._offsets):
            u, n = self.buf.buckets[b].numel_unpadded, self.buf.shard_numel(b)
            lo, hi = max(start, o) - o, min(stop, o + u) - o  # in the bucket
            p = lo
            while p < hi:
                r = p // n
                e = min(hi, (r + 1) * n)
                copy_range(out[o + p - start:o + e - start], self.shards[r][shard_key(self.g, b, self.key)],
                           p - r * n, e - r * n)
                p = e


def world_view(part: GroupPart) -> dict[Any, Any]:
    """Megatron's dict for one DP group, as :class:`ShardWorld` views (for :func:`~.distrib_optim.iter_split`)."""
    state: dict[Any, Any] = {BUCKETS_COALESCED: True}
    for g, buf in enumerate(part.geometry.buffers):
        entry: dict[str, Any] = {k: ShardWorld(part.shards, buf, g, k) for k in part.geometry.state_keys}
        entry[NUMEL_UNPADDED] = buf.numel_unpadded
        state[g] = {buf.dtype_key: entry}
    return state


def check_same_model_parallel(src: MegatronTopology, dst: MegatronTopology) -> None:
    changed = [d for d in ("tp", "pp", "ep", "cp") if getattr(src, d) != getattr(dst, d)]
    if changed:
        raise LayoutMismatchError(
            "only the DP size can change: " + ", ".join(f"{d.upper()} {getattr(src, d)} → {getattr(dst, d)}"
                                                        for d in changed)
            + " (Megatron's torch format cannot be re-sharded across TP, PP, EP or CP)")
