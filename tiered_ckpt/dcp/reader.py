"""A DCP ``StorageReader`` over a :class:`~tiered_ckpt.CheckpointEngine`, or over a plain DCP directory.

``dcp.load(state_dict, storage_reader=TieredStorageReader(engine))`` loads the newest step every rank can read
(``checkpoint_id=<step>`` for another one). Planning is DCP's; each data file a rank's plan needs comes from the
fastest tier that holds a verified copy of it:

* a memory tier: the snapshot of the rank that wrote it, in this node's shared memory (no file is decoded: the
  tensors are views of the slot), checked against the snapshot's checksum where the drain recorded one;
* a file tier with our manifest: the whole ``.distcp`` read (the ``local`` tier reads in parallel pieces) and
  checked against the manifest's checksum before a byte is used;
* a plain DCP directory (written by DCP's ``FileSystemWriter``, no manifest): only the byte ranges the plan
  needs, unverified (there is nothing to verify them against), and the reader says so (``verified``).

Files are fetched on a thread pool (``threads``) and applied as each arrives; a file that fails on one tier
(missing, corrupt) is taken from the next. ``.metadata`` is unpickled with an allow-list of DCP's metadata classes.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from .. import events as ev
from ..errors import CorruptionError, DecodeError, TieredCkptError, TierError
from ..layouts.dcp import (
    DATA_ITEM,
    METADATA_FILE,
    METADATA_ITEM,
    RANK_METADATA_ITEM,
    RESULTS_ITEM,
    rank_metadata_file,
)
from ..store import SnapshotStore, Store
from ..tiers.base import as_memoryview, bytes_to_tensor
from ._format import load_metadata, parse_data_file
from ._metadata import is_partial, load_rank_results, merge, save_id
from .writer import check_engine, parse_step

if TYPE_CHECKING:
    from ..file_store import FileStore

log = logging.getLogger(__name__)


_PLAIN_METADATA = re.compile(rf"(__\d+)?{re.escape(METADATA_FILE)}")  # .metadata, or a rank's __<rank>.metadata


class _NoMetadata(TieredCkptError):
    """No tier holds the step's .metadata (a save without collectives has per-rank ones instead)."""
Fetched = Callable[[int, int, bool], Any]  # (offset, length, is_tensor) → tensor, or bytes for BYTE_IO


class TieredStorageReader(StorageReader):
    """DCP storage reader. ``engine``: read through its tiers (fastest verified first); ``path``: a plain DCP
    directory instead (no engine needed). ``step``: the step to load (default: the newest every rank can read;
    ``checkpoint_id`` passed to ``dcp.load`` names one too). After a load, ``step`` is the step loaded,
    ``sources`` maps each data file to the tier it came from, ``verified`` says whether every byte was checked."""

    def __init__(self, engine: Any = None, step: int | None = None, *, path: str | os.PathLike | None = None,
                 threads: int = 8):
        super().__init__()
        if engine is None and path is None:
            raise ValueError("TieredStorageReader needs an engine (its tiers) or path= (a plain DCP directory)")
        if engine is not None:
            check_engine(engine)
        self.engine = engine
        self.requested = step
        self.path = os.fspath(path) if path is not None else None
        self.threads = max(1, threads)
        self.step: int | None = None
        self.sources: dict[str, str] = {}
        self.verified = True
        self.storage_data: dict[Any, Any] = {}
        self._metadata_tier: str | None = None
        self._metadata_error: Exception | None = None
        self._committed: dict[str, set[int]] = {}  # file tier → committed steps, listed once per load
        self._unreachable: dict[str, str] = {}  # tiers this load could not list → why
        # (tier, step) → its manifest, read once per load: a cache kept across loads could be another process's
        # earlier commit of a step saved again (the drain worker commits, not this process)
        self._manifests: dict[tuple[str, int], Any] = {}
        self._t0, self._nbytes = 0.0, 0  # this load's start and bytes read (the load event)
        self._metadata_created: float | None = None  # the coordinator's snapshot, when .metadata came from memory
        # A save on a cached plan, its .metadata merged from memory: each rank's snapshot of that save (created)
        self._rank_created: dict[int, float] | None = None

    # ----- DCP's protocol ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        self._committed = {}
        self._manifests = {}
        self._metadata_error = None
        self.sources = {}
        self.verified = True
        if checkpoint_id is None:
            return
        if self.engine is None or (isinstance(checkpoint_id, str | os.PathLike) and os.path.isdir(checkpoint_id)
                                   and any(n.endswith(METADATA_FILE) for n in os.listdir(checkpoint_id))
                                   and not self._in_a_tier(checkpoint_id)):
            self.path = os.fspath(checkpoint_id)  # a plain DCP directory (until another checkpoint_id, as DCP's)
        else:
            self.path = None
            self.requested = parse_step(checkpoint_id)

    def _in_a_tier(self, directory: str | os.PathLike) -> bool:
        """Whether ``directory`` is a step directory of one of the engine's file tiers: then it names that step,
        read through the tiers (verified, the fastest copy, fallback), not as a plain directory (a DCP trial:
        checkpoint_id=<tier>/iter_N read a damaged file unverified, with verified copies in memory)."""
        path = os.path.abspath(os.fspath(directory).rstrip("/"))
        parent = os.path.realpath(os.path.dirname(path))
        for store in self.engine.pipeline.durable_stores().values():
            if store.layout.parse_step_dir(os.path.basename(path)) is None:
                continue  # a directory there that is not a step's (an export): read as a plain one
            where = store.tier.location or ""
            where = where.removeprefix("file://") if where.startswith("file://") or "://" not in where else ""
            if where and os.path.realpath(where) == parent:
                return True
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:
            # DCP's fallback after the global .metadata was not found: this rank's own (a save without
            # collectives). Anything else failed first: say again why. No collective here.
            if not isinstance(self._metadata_error, _NoMetadata | FileNotFoundError):
                raise self._metadata_error or TieredCkptError("read_metadata(rank=...) before the global metadata")
            try:
                return self._read_metadata(rank)
            except (_NoMetadata, FileNotFoundError) as exc:
                raise TieredCkptError(f"{self._metadata_error}; and no {rank_metadata_file(rank)} either: {exc}"
                                      ) from None
        try:
            return self._read_metadata(None)
        except Exception as exc:
            self._metadata_error = exc
            raise

    def _read_metadata(self, rank: int | None) -> Metadata:
        self.sources, self.verified = {}, True  # this load's
        self._t0, self._nbytes = time.perf_counter(), 0
        self._metadata_created = None
        self._rank_created = None
        name = METADATA_FILE if rank is None else rank_metadata_file(rank)
        if self.engine is None or self.path is not None:
            where = os.path.join(self.path or "", name)
            with open(where, "rb") as f:
                metadata = load_metadata(f.read(), where)
            self.verified = False
            self._metadata_tier = "directory"
        else:
            if rank is None:
                self.step = self._choose_step()  # collective: the global attempt only
            assert self.step is not None
            metadata = self._engine_metadata(self.step, rank)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptionError("DCP metadata without storage_data: not a complete checkpoint")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            transforms = getattr(info, "transform_descriptors", None)
            if transforms:  # FileSystemWriter(_extensions=[...]): the bytes are not a torch record
                raise DecodeError(f"{info.relative_path}: {req.storage_index.fqn!r} is stored through DCP's "
                                  f"transform(s) {', '.join(map(str, transforms))} (FileSystemWriter's _extensions), "
                                  "which this reader does not decode: load it with DCP's FileSystemReader")
            per_file.setdefault(info.relative_path, []).append(req)
        with ThreadPoolExecutor(min(self.threads, max(1, len(per_file))),
                                thread_name_prefix="tiered_ckpt-dcp-read") as pool:
            pending: dict[Future, str] = {pool.submit(self._fetch, name, reqs): name for name, reqs in per_file.items()}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    name = pending.pop(fut)
                    get, tier, verified = fut.result()
                    self.sources[name] = tier
                    self.verified = self.verified and verified
                    self._apply(per_file[name], get, planner)  # on this thread: DCP's planner is not shared
        if self.engine is not None and self.step is not None and self.sources:
            tier = Counter(self.sources.values()).most_common(1)[0][0]
            self._emit(ev.LOAD, tier, seconds=time.perf_counter() - self._t0,
                       nbytes=self._nbytes, detail={"verified": self.verified, "sources": dict(self.sources),
                                                    "format": "dcp"})
        out: TorchFuture[None] = TorchFuture()
        out.set_result(None)
        return out

    @property
    def checkpoint_id(self) -> Any:
        return self.path if self.path is not None else (f"iter_{self.step:07d}" if self.step is not None else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never chosen by DCP on its own

    # ----- applying ----------------------------------------------------------------------------------------
    def _apply(self, reqs: list[ReadItem], get: Fetched, planner: LoadPlanner) -> None:
        for req in reqs:
            info = self.storage_data[req.storage_index]
            self._nbytes += info.length
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(get(info.offset, info.length, False)))
                continue
            tensor = narrow_tensor_by_index(get(info.offset, info.length, True), req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CorruptionError(f"{info.relative_path}: {req.storage_index.fqn} has shape {tuple(tensor.size())}"
                                      f" in the checkpoint, the plan expects {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    def _emit(self, kind: str, tier: str | None, **fields: Any) -> None:
        """An event through the engine's observers, as the engine's own loads emit them (docs/hooks.md)."""
        emit = getattr(self.engine, "_emit", None)
        if emit is not None:
            emit(ev.Event(kind, step=self.step, rank=self.engine.coords.rank, tier=tier, **fields))

    # ----- choosing a step ---------------------------------------------------------------------------------
    def _stores(self) -> list[tuple[str, Store]]:
        return [(name, self.engine.pipeline.stores[name]) for name in self.engine.tiers]

    @staticmethod
    def _snapshot(slots: SnapshotStore, rank: int, step: int, item: str, not_after: float | None = None,
                  created: float | None = None) -> Any:
        """The newest snapshot record of ``step`` holding ``item`` in ``rank``'s slots on this node (taken no later
        than ``not_after``; ``created``: taken exactly then), or None."""
        view = slots.for_rank(rank)
        metas = [m for m in view.metas().values() if m.step == step and any(it.name == item for it in m.items)
                 and (not_after is None or m.created <= not_after) and (created is None or m.created == created)]
        return (view, max(metas, key=lambda m: m.created)) if metas else None

    def _loadable_here(self) -> set[int]:
        steps: set[int] = set()
        self._unreachable = {}
        for name, store in self._stores():
            try:
                if (slots := store.slots()) is not None:
                    # any world size: DCP reshards, and this node's snapshots of every rank are readable here
                    steps.update(m.step for m in slots.metas().values() if any(it.name == DATA_ITEM for it in m.items))
                elif (files := store.files()) is not None:
                    self._committed[name] = set(files.committed_steps())
                    steps.update(s for s in self._committed[name] if _is_dcp_step(files, s))
                    steps.update(self._plain_steps(files))
            except (TierError, OSError, CorruptionError) as exc:
                log.warning("dcp load: cannot list tier %r: %s", name, exc)
                self._emit(ev.TIER_UNREACHABLE, name, message=str(exc))
                self._unreachable[name] = str(exc)
        return steps

    @staticmethod
    def _plain_steps(store: FileStore) -> set[int]:
        """Step directories holding DCP's .metadata, or its per-rank ``__<rank>.metadata`` (a save without
        collectives), but no manifest of ours (written by DCP's FileSystemWriter)."""
        out = set()
        for key in store.tier.list(""):
            top, _, rest = key.partition("/")
            step = store.layout.parse_step_dir(top)
            if step is not None and step not in out and _PLAIN_METADATA.fullmatch(rest) \
                    and not store.tier.exists(store.layout.manifest_key(step)):
                out.add(step)
        return out

    def _choose_step(self) -> int:
        mine = self.engine.coordinator.alone(self._loadable_here)  # a failure here stops every rank
        chosen = self.engine.coordinator.agree_on_step(mine, self.requested)  # collective with several ranks
        if chosen is None:
            what = f"step {self.requested}" if self.requested is not None else "a DCP checkpoint"
            # NoCheckpointError (or StepNotFoundError) only when every rank listed every tier; else, on every
            # rank, TierUnavailableError: a tier that could not be listed may hold one (the engine's rule)
            self.engine._nothing_loadable(
                self._unreachable, f"rank {self.engine.coords.rank}: no tier holds {what} that every rank can read "
                f"(this rank sees steps {sorted(mine) or 'none'} on tiers {', '.join(self.engine.tiers)})",
                requested=self.requested)
        return chosen

    # ----- the metadata ------------------------------------------------------------------------------------
    def _engine_metadata(self, step: int, rank: int | None = None) -> Metadata:
        """The step's ``.metadata`` (``rank``: that rank's ``__{rank}.metadata``), from the fastest tier."""
        reasons = []
        item = METADATA_ITEM if rank is None else RANK_METADATA_ITEM
        for name, store in self._stores():
            try:
                if (slots := store.slots()) is not None:
                    found = self._snapshot(slots, 0 if rank is None else rank, step, item)
                    if found is None:
                        continue
                    view, meta = found
                    state = view.load(meta, copy=True, verify=True, only={item})[item]
                    data = bytes(as_memoryview(state["metadata"]))
                    verified = meta.verified_origin  # a restart's checksums of what it found prove nothing
                    if rank is None:
                        where = f"tier {name!r} step {step} {METADATA_FILE}"
                        metadata = load_metadata(data, where)
                        if is_partial(metadata):  # a save on a cached plan: every rank's results, same save
                            merged = self._merge_from_memory(slots, step, metadata, where)
                            if merged is None:
                                continue
                            metadata, verified = merged[0], verified and merged[1]
                        self.verified = self.verified and verified
                        self._metadata_tier = name
                        # The coordinator snapshots last (in finish(), after every rank's write_data): a rank's
                        # snapshot of this save is no newer than this one. A newer one is a later, failed save.
                        # (A save on a cached plan: _rank_created names each rank's snapshot instead.)
                        self._metadata_created = meta.created
                        return metadata
                    self._metadata_created = meta.created
                elif (files := store.files()) is not None:
                    key = files.layout.metadata_key(step) if rank is None else \
                        f"{files.layout.step_dir(step)}/{rank_metadata_file(rank)}"
                    data, verified = self._file_bytes(files, step, key)
                    if data is None:
                        continue
                else:
                    continue
                metadata = load_metadata(data, f"tier {name!r} step {step} "
                                         f"{METADATA_FILE if rank is None else rank_metadata_file(rank)}")
                self.verified = self.verified and verified
                self._metadata_tier = name
                return metadata
            except (TierError, OSError, CorruptionError, TieredCkptError) as exc:
                reasons.append(f"tier {name!r}: {exc}")
                log.warning("dcp load: step %d: DCP metadata unusable on tier %r: %s", step, name, exc)
        what = METADATA_FILE if rank is None else rank_metadata_file(rank)
        error = TieredCkptError if reasons else _NoMetadata
        raise error(f"rank {self.engine.coords.rank}: step {step}: no tier holds a usable DCP {what} "
                    f"({'; '.join(reasons) or 'none holds one'})")

    def _merge_from_memory(self, slots: SnapshotStore, step: int, metadata: Metadata, where: str
                           ) -> tuple[Metadata, bool] | None:
        """A save on a cached plan: the coordinator's partial Metadata merged with every rank's write results of
        the same save (its id), each from that rank's snapshot on this node; None if a rank's is not here (another
        node's rank: the committed .metadata on a file tier has them all). Records which snapshot of each rank
        the data files are then read from, so a load never mixes two saves."""
        sid = save_id(metadata)
        parts: dict[int, dict[str, Any]] = {}
        created: dict[int, float] = {}
        verified = True
        rank, world = 0, 1
        while rank < world:
            view = slots.for_rank(rank)
            metas = sorted((m for m in view.metas().values() if m.step == step
                            and any(it.name == RESULTS_ITEM for it in m.items)), key=lambda m: -m.created)
            for meta in metas:  # newest first: the one of this save
                state = view.load(meta, copy=True, verify=True, only={RESULTS_ITEM})[RESULTS_ITEM]
                part = load_rank_results(as_memoryview(state["metadata"]), f"{where}: rank {rank}'s write results")
                if part["save_id"] == sid:
                    parts[rank], created[rank] = part, meta.created
                    verified = verified and meta.verified_origin
                    break
            if rank not in parts:
                log.info("dcp load: step %d: rank %d's snapshot of save %s is not in this node's memory: the "
                         ".metadata of a file tier is used", step, rank, sid)
                return None
            if rank == 0:
                world = int(parts[0]["world"])
            rank += 1
        self._rank_created = created
        return merge(metadata, parts, where), verified

    def _file_bytes(self, store: FileStore, step: int, key: str) -> tuple[bytes | None, bool]:
        """A whole file of ``step``: verified against the manifest, or unverified from a plain DCP directory."""
        manifest = self._manifest(store, step)
        if manifest is not None:
            entry = next((f for f in manifest.files if f.key == key), None)
            if entry is None:
                return None, False
            blob = store.read_verified(entry, step, self.engine.coords.rank)
            return bytes(as_memoryview(store.decode_stored(entry, blob))), _origin_verified(entry)
        if not store.tier.exists(key):
            return None, False
        return bytes(as_memoryview(store.tier.read_blob(key))), False

    def _manifest(self, store: FileStore, step: int) -> Any:
        committed = self._committed.get(store.name)
        if committed is None:  # not listed by this load (a tier that could not be listed then)
            committed = self._committed[store.name] = set(store.committed_steps())
        if step not in committed:
            return None
        if (store.name, step) not in self._manifests:
            self._manifests[store.name, step] = store.read_manifest(step)
        return self._manifests[store.name, step]

    # ----- fetching data files -----------------------------------------------------------------------------
    def _fetch(self, name: str, reqs: list[ReadItem]) -> tuple[Fetched, str, bool]:
        """How to get the bytes of ``name`` (a data file of the step), from the fastest tier that has them."""
        if self.engine is None or self.path is not None:
            return self._from_directory(os.path.join(self.path or "", name)), "directory", False
        step = self.step
        assert step is not None
        reasons = []
        for tier_name, store in self._stores():
            try:
                if (slots := store.slots()) is not None:
                    got = self._from_memory(slots, name, step)
                elif (files := store.files()) is not None:
                    got = self._from_files(files, name, step, reqs)
                else:
                    got = None
                if got is not None:
                    return got[0], tier_name, got[1]
            except (TierError, OSError, CorruptionError, TieredCkptError) as exc:
                reasons.append(f"tier {tier_name!r}: {exc}")
                log.warning("dcp load: step %d: %s unusable on tier %r (%s); trying the next tier", step, name,
                            tier_name, exc)
                self._emit(ev.FALLBACK, tier_name, message=str(exc), detail={"key": name})
        raise TieredCkptError(f"rank {self.engine.coords.rank}: step {step}: no tier holds a usable {name} "
                              f"({'; '.join(reasons) or 'no tier has it'})")

    def _from_memory(self, store: SnapshotStore, name: str, step: int) -> tuple[Fetched, bool] | None:
        rank = parse_data_file(name)
        if rank is None or not name.endswith("_0.distcp") or self._metadata_created is None:
            return None  # snapshots are used with the coordinator's own: nothing else tells which save they are
        if self._rank_created is not None:  # a save on a cached plan: the snapshot its results came from
            if rank not in self._rank_created:
                return None
            found = self._snapshot(store, rank, step, DATA_ITEM, created=self._rank_created[rank])
        else:
            found = self._snapshot(store, rank, step, DATA_ITEM, not_after=self._metadata_created)
        if found is None:
            return None
        view, meta = found
        state = view.load(meta, copy=False, verify=True, only={DATA_ITEM})[DATA_ITEM]
        by_offset = {info["offset"]: (entry, info) for entry, info in zip(state["entries"], state["index"],
                                                                          strict=True)}

        def get(offset: int, length: int, tensor: bool) -> Any:
            try:
                entry, info = by_offset[offset]
            except KeyError:
                raise CorruptionError(f"rank {rank}'s snapshot of step {step} has no entry at byte {offset} of "
                                      f"{name}", tier=store.name) from None
            if info["length"] != length:
                raise CorruptionError(f"{name} byte {offset}: the snapshot's entry is {info['length']} bytes, the "
                                      f"metadata says {length}", tier=store.name)
            return entry if tensor else bytes(as_memoryview(entry))

        return get, meta.verified_origin

    def _from_files(self, store: FileStore, name: str, step: int, reqs: list[ReadItem]
                    ) -> tuple[Fetched, bool] | None:
        key = f"{store.layout.step_dir(step)}/{name}"
        manifest = self._manifest(store, step)
        if manifest is None:
            if not store.tier.exists(key):
                return None
            tier = store.tier
            return _range_getter(lambda off, n: tier.read_range(key, off, n), key), False
        entry = next((f for f in manifest.files if f.key == key), None)
        if entry is None:
            return None
        blob = store.decode_stored(entry, store.read_verified(entry, step, self.engine.coords.rank))
        return _blob_getter(blob, key), _origin_verified(entry)

    @staticmethod
    def _from_directory(path: str) -> Fetched:
        def read(offset: int, length: int) -> bytes:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise CorruptionError(f"{path}: {length} bytes at {offset} announced, the file has {len(data)}")
            return data

        return _range_getter(read, path)


def _origin_verified(entry: Any) -> bool:
    """A file drained from a snapshot of unverified origin matches its checksums, but nothing showed its bytes
    were the ones saved (snapshot_record.UNVERIFIED)."""
    return entry.meta.get("origin") != "unverified"


def _is_dcp_step(store: FileStore, step: int) -> bool:
    try:
        return store.read_manifest(step, cached=True).layout == "dcp"
    except (TierError, OSError, CorruptionError) as exc:  # this step only: the others may be fine
        log.warning("dcp load: tier %r step %d: %s", store.name, step, exc)
        return False


def _decode_tensor(blob: torch.Tensor, where: str) -> torch.Tensor:
    from ..megatron.safe_load import load_views

    t = load_views(blob, where=where, map_location="cpu")
    if not isinstance(t, torch.Tensor):
        raise CorruptionError(f"{where}: expected a tensor record, found {type(t).__name__}")
    return t


def _blob_getter(blob: torch.Tensor, key: str) -> Fetched:
    def get(offset: int, length: int, tensor: bool) -> Any:
        if offset < 0 or offset + length > blob.numel():
            raise CorruptionError(f"{key}: range {offset}+{length} is outside the file of {blob.numel()} bytes")
        piece = blob[offset:offset + length]
        return _decode_tensor(piece, f"{key}@{offset}") if tensor else bytes(as_memoryview(piece))

    return get


def _range_getter(read: Callable[[int, int], bytes], where: str) -> Fetched:
    def get(offset: int, length: int, tensor: bool) -> Any:
        data = read(offset, length)
        return _decode_tensor(bytes_to_tensor(data), f"{where}@{offset}") if tensor else data

    return get

