"""One step of a Megatron-style checkpoint on a tier, read lazily, whatever its layout or writer.

A :class:`StepSource` gives the model files of each ``mp_rank_*`` directory (verified against our manifest
when there is one) and the distributed optimizer's state of each directory as Megatron's world tensors, either
straight from ``distrib_optim.pt`` (opened for range reads) or assembled from the rank files of the
``rank_sharded`` layout (:class:`~.merge.ShardWorld`). From there any rank of a job with the same TP, PP, EP and
CP and any DP gets its local shards (:func:`~.distrib_optim.iter_split`), in memory (:meth:`rank_items`) or
streamed into a file (:meth:`streamed_rank_shard`).

Bucket geometry comes, in this order, from the caller (a live optimizer), from our manifest (``meta`` of the
merged files), from the rank files themselves, or is recomputed from the model state (:mod:`.infer`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..checksum import new_hasher
from ..compression import decompress_to_tensor
from ..errors import CorruptionError, LayoutMismatchError, UnsafePickleError
from ..file_streams import check_entry
from ..layouts.base import META_DIR
from ..manifest import CheckpointManifest, FileEntry, load_checkpoint
from ..parallel import RankCoords
from ..tiers.base import Tier, as_memoryview
from . import rank_shard, safe_load, tier_io
from .checkpoint_info import CheckpointInfo, LoadedItems
from .distrib_optim import iter_split, split_state, sub_optimizer_states
from .geometry import OptimizerGeometry
from .infer import infer_geometry
from .lazy_torch import LazyTorchFile, materialize, zip_crc_mismatches
from .merge import OpenedFiles, check_same_model_parallel, open_rank_shards, plan_dirs, world_view
from .naming import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME, MegatronTopology
from .torch_zip import StreamedTensor

DEFAULT_KINDS = {1: ["dense"], 2: ["dense", "expert"]}  # what a Megatron-written chained file holds
State = tuple[Any, OptimizerGeometry, str]  # (Megatron's dict for one sub-optimizer, its geometry, kind)


class StepSource:
    def __init__(self, tier: Tier, info: CheckpointInfo, *, trust_pickles: bool = False, verify: bool = True,
                 geometry: Sequence[OptimizerGeometry | None] | None = None):
        self.tier, self.info = tier, info
        self.trust_pickles = trust_pickles
        self.verify = verify and info.has_manifest
        self.check_crcs = verify and not info.has_manifest  # Megatron-LM's files: their zip CRC-32s
        self.geometry_override = list(geometry) if geometry is not None else None
        self.files = OpenedFiles(verify=self.verify)
        self.manifest: CheckpointManifest | None = None
        self.entries: dict[str, FileEntry] = {}
        if info.has_manifest:
            key = f"{info.step_dir}/{META_DIR}/manifest.json"
            self.manifest = load_checkpoint(as_memoryview(tier.read_blob(key)).tobytes(), key, tier.name)
            self.entries = {e.key: e for e in self.manifest.files}
        self._lazy: dict[str, LazyTorchFile] = {}
        self._states: dict[str, list[State | None]] | None = None
        self.model_bytes_read = 0

    def __enter__(self) -> StepSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.files.close()

    @property
    def topology(self) -> MegatronTopology:
        return self.info.topology

    @property
    def bytes_read(self) -> int:
        return self.files.total_read + self.model_bytes_read

    # ----- files ---------------------------------------------------------------------------------------------
    def key(self, directory: str, filename: str) -> str:
        return f"{self.info.step_dir}/{directory}/{filename}"

    def entry(self, key: str) -> FileEntry | None:
        """The manifest entry of ``key``; a file the manifest does not list is an error when there is one."""
        if self.manifest is None:
            return None
        try:
            return self.entries[key]
        except KeyError:
            raise CorruptionError(f"{tier_io.where(self.tier, key)}: not listed in the step's manifest") from None

    def lazy(self, key: str) -> LazyTorchFile:
        if key not in self._lazy:
            self._lazy[key] = self.files.open(self.tier, key, self.entry(key))
        return self._lazy[key]

    def load_model(self, directory: str) -> dict[str, Any]:
        """A directory's ``model_optim_rng.pt`` in full, verified when there is a manifest."""
        key = self.key(directory, MODEL_FILENAME)
        where = tier_io.where(self.tier, key)
        entry = self.entry(key)
        # Hashed while it is read (the local tier hashes its parallel pieces as they arrive), not in a second pass.
        hasher = new_hasher() if entry is not None and self.verify else None
        blob = self.tier.read_blob_hashed(key, hasher)
        self.model_bytes_read += blob.numel()
        if entry is not None:
            if hasher is not None:
                check_entry(entry, blob.numel(), hasher.hexdigest(), tier=self.tier.name, key=key)
            if entry.compression is not None:
                blob = decompress_to_tensor(blob, entry.raw_size or 0, where=key, tier=self.tier.name)
                return safe_load.load_views(blob, where=where, trust_pickles=self.trust_pickles)
        elif self.check_crcs and blob.device.type == "cpu":
            # Megatron-LM's file: no checksum of ours, but torch's CRC-32 of each record (torch.load checks none)
            damaged = zip_crc_mismatches(as_memoryview(blob), where)
            if damaged:
                raise CorruptionError(f"{where}: record {damaged[0]} (damaged; checked against the CRC-32s of the "
                                      "file's zip directory)")
        return self._load_blob(blob, where)

    def _load_blob(self, blob: torch.Tensor, where: str) -> Any:
        if not self.tier.capabilities.zero_copy_read and blob.device.type == "cpu":
            # Bytes read into memory of our own: the storages can be views of them instead of second copies.
            return safe_load.load_views(blob, where=where, trust_pickles=self.trust_pickles)
        return safe_load.load_bytes(as_memoryview(blob), where=where, trust_pickles=self.trust_pickles)

    # ----- the optimizer's state, per directory --------------------------------------------------------------
    def dir_states(self) -> dict[str, list[State | None]]:
        """Per ``mp_rank_*`` directory: per sub-optimizer, Megatron's (lazy) dict, geometry and kind, or None
        where that sub-optimizer's DP rank 0 lives in another directory."""
        if self._states is None:
            # Megatron's gathered files when there are any (layout megatron), else our rank files (rank_sharded,
            # or a megatron-layout step whose files were not merged); DLRover's rank files hold no bucket data.
            if self.info.has_distrib_optim and self.info.layout != "rank_sharded":
                self._states = self._states_from_megatron_files()
            elif self.info.rank_files and self.info.layout != "dlrover":
                self._states = self._states_from_rank_files()
            else:
                self._states = {}
        return self._states

    def _states_from_rank_files(self) -> dict[str, list[State | None]]:
        keys = {self.key(f"rank_{r:05d}", DISTRIB_OPTIM_FILENAME): r for r in self.info.rank_files}
        shards = open_rank_shards(self.tier, keys, self.files, self.entries if self.manifest else None)
        return {d: [None if p is None else (world_view(p), p.geometry, p.kind) for p in parts]
                for d, parts in plan_dirs(shards).items()}

    def _states_from_megatron_files(self) -> dict[str, list[State | None]]:
        out: dict[str, list[State | None]] = {}
        for d in self.info.rank_dirs:
            key = self.key(d, DISTRIB_OPTIM_FILENAME)
            if not self.tier.exists(key):
                continue
            states = sub_optimizer_states(self.lazy(key).obj)
            geos, kinds = self._geometry(d, key, states)
            out[d] = [None if s is None else (s, g, k) for s, g, k in zip(states, geos, kinds, strict=True)]
        return out

    def _geometry(self, directory: str, key: str, states: list[Any]) -> tuple[list[Any], list[str]]:
        where = tier_io.where(self.tier, key)
        kinds = DEFAULT_KINDS.get(len(states))
        meta = (self.entries.get(key).meta or {}).get("optimizers") if self.manifest is not None else None
        if meta is not None:
            if len(meta) != len(states):
                raise CorruptionError(f"{where}: the manifest describes {len(meta)} optimizers, the file holds "
                                      f"{len(states)}")
            geos = [None if m is None else OptimizerGeometry.from_dict(m["geometry"]) for m in meta]
            return geos, [m["kind"] if m else (kinds or ["dense"] * len(meta))[i] for i, m in enumerate(meta)]
        if kinds is None:
            raise LayoutMismatchError(f"{where}: a chained optimizer of {len(states)} sub-optimizers; only "
                                      "[dense] and [dense, expert] files are understood")
        if self.geometry_override is not None:
            if len(self.geometry_override) != len(states):
                raise LayoutMismatchError(f"{where}: {len(self.geometry_override)} geometries given for "
                                          f"{len(states)} sub-optimizers")
            return list(self.geometry_override), kinds
        model = self._model_state(directory)
        pp_rank = self.info.topology.position(self._rank_in(directory)).pp
        geos = infer_geometry(model, model.get("args") or self.info.args, pp_rank=pp_rank,
                              pp_size=self.info.topology.pp, distrib_optim=self.lazy(key).obj, where=where)
        return geos, kinds

    def _model_state(self, directory: str) -> Any:
        """A directory's model state for its names and shapes: only the pickle is read, unless it needs
        ``trust_pickles`` (then the whole file)."""
        try:
            return self.lazy(self.key(directory, MODEL_FILENAME)).obj
        except UnsafePickleError:
            if not self.trust_pickles:
                raise
            return self.load_model(directory)

    def _rank_in(self, directory: str) -> int:
        topo = self.info.topology
        return next(r for r in range(topo.world_size) if topo.rank_dir(r) == directory)

    def kinds(self) -> list[str]:
        states = self.dir_states()
        n = max((len(v) for v in states.values()), default=0)
        kinds: list[str | None] = [None] * n
        for parts in states.values():
            for i, p in enumerate(parts):
                if p is not None:
                    kinds[i] = p[2]
        if any(k is None for k in kinds):
            raise LayoutMismatchError(f"{self.info.where}: some sub-optimizer has no state in any directory")
        return [k for k in kinds if k is not None]

    def rank_parts(self, target: MegatronTopology, rank: int) -> list[tuple[str, list[int], int, Any,
                                                                           OptimizerGeometry]]:
        """For ``rank`` of ``target``: per sub-optimizer (kind, DP group, DP rank, Megatron's dict, geometry)."""
        check_same_model_parallel(self.info.topology, target)
        states = self.dir_states()
        out = []
        for i, kind in enumerate(self.kinds()):
            group = rank_shard.dp_group(target, rank, kind)
            owner = target.rank_dir(group[0])
            found = states.get(owner, [])
            if i >= len(found) or found[i] is None:
                raise LayoutMismatchError(f"{self.info.where}: no state of optimizer {i} ({kind}) in {owner}")
            state, geo, _ = found[i]
            out.append((kind, group, group.index(rank), state, geo))
        return out

    # ----- a rank's items ------------------------------------------------------------------------------------
    def rank_items(self, coords: RankCoords) -> LoadedItems:
        target = rank_shard.as_topology(coords.layout)
        check_same_model_parallel(self.info.topology, target)
        rank, info = coords.rank, self.info
        items: dict[str, Any] = {"model_optim_rng": self.load_model(target.rank_dir(rank))}
        formats = {"model_optim_rng": "megatron"}
        notes = list(info.notes)
        if info.layout == "dlrover":
            if target.dp != info.topology.dp:
                raise LayoutMismatchError(f"{info.where}: DLRover's per-rank optimizer files hold per-param "
                                          f"fragments and load only at the DP size that wrote them "
                                          f"({info.topology.dp}, this job has {target.dp})")
            key = self.key(f"rank_{rank:05d}", DISTRIB_OPTIM_FILENAME)
            blob = self.tier.read_blob(key)
            self.model_bytes_read += blob.numel()
            items["distrib_optim"] = self._load_blob(blob, tier_io.where(self.tier, key))
            formats["distrib_optim"] = "dlrover"
        elif info.layout == "rank_sharded" and target.dp == info.topology.dp:
            f = self.lazy(self.key(f"rank_{rank:05d}", DISTRIB_OPTIM_FILENAME))
            rank_shard.parse(f.obj, where=f.where)
            items["distrib_optim"] = materialize(f.obj)
            formats["distrib_optim"] = "rank_shard"
        elif self.dir_states():
            subs = []
            for kind, group, dp_rank, state, geo in self.rank_parts(target, rank):
                shards = split_state(state, geo, dp_rank, dp_size=len(group))
                subs.append(rank_shard.SubOptimizerShard(geo.with_dp_size(len(group)), dp_rank, tuple(group),
                                                         shards, kind))
            items["distrib_optim"] = rank_shard.build(rank=rank, topology=target, optimizers=subs)
            formats["distrib_optim"] = "rank_shard"
        else:
            notes.append("no distributed-optimizer state in this checkpoint")
        return LoadedItems(items, info=info, verified=self.verify, formats=formats, notes=notes)

    def streamed_rank_shard(self, target: MegatronTopology, rank: int) -> dict[str, Any]:
        """The rank file of ``rank`` in ``target``, each shard streamed out of :func:`iter_split` when written."""
        subs = []
        for kind, group, dp_rank, state, geo in self.rank_parts(target, rank):
            moved = geo.with_dp_size(len(group))
            pieces = _KeyedPieces(iter_split(state, geo, dp_rank, dp_size=len(group)))
            shards = {}
            for g, buf in enumerate(moved.buffers):
                for b in range(len(buf.buckets)):
                    for k in moved.state_keys:
                        name = f"gbuf{g}/bucket{b}/{k}"
                        shards[name] = StreamedTensor(torch.float32, (buf.shard_numel(b),),
                                                      lambda name=name, pieces=pieces: pieces.take(name))
            subs.append(rank_shard.SubOptimizerShard(moved, dp_rank, tuple(group), shards, kind))
        return rank_shard.build(rank=rank, topology=target, optimizers=subs)


class _KeyedPieces:
    def __init__(self, pieces: Iterator[tuple[str, torch.Tensor]]):
        self._pieces = pieces

    def take(self, name: str) -> Iterator[torch.Tensor]:
        key, t = next(self._pieces)
        if key != name:
            raise RuntimeError(f"split out of order: got {key}, wanted {name}")
        yield t
        del t


def model_dirs(topo: MegatronTopology) -> Mapping[str, int]:
    """Every ``mp_rank_*`` directory with the rank that writes its files (the first, i.e. DP rank 0)."""
    out: dict[str, int] = {}
    for r in range(topo.world_size):
        out.setdefault(topo.rank_dir(r), r)
    return out
