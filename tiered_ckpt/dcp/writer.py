"""A DCP ``StorageWriter`` over a :class:`~tiered_ckpt.CheckpointEngine`.

``dcp.save(state_dict, storage_writer=TieredStorageWriter(engine), checkpoint_id=step)`` plans as DCP always does
(its collectives, its planner); :meth:`write_data` then hands this rank's write items to ``engine.save``: a copy
into the engine's pre-faulted slots (shared memory), which is all ``dcp.save`` waits for. The drain writes the
``.distcp`` file and ``.metadata`` to every file tier, with checksums, retries, manifest-last commit and retention.

The offsets DCP records in ``.metadata`` are computed from the plan (``torch.save``'s length depends only on dtype
and shape), so the WriteResults are exact before a byte is written; the coordinator's snapshot, taken in
:meth:`finish`, carries the pickled Metadata. A save on a cached plan (:meth:`finish_cached`, no collective) stages
every rank's own results instead, merged into ``.metadata`` at commit (``dcp/_metadata.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import re
import threading
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import ConfigError, TieredCkptError
from ..handles import SaveHandle
from ..layouts.dcp import DATA_ITEM, METADATA_ITEM, RANK_METADATA_ITEM, RESULTS_ITEM
from ._format import data_file, torch_save_length
from ._metadata import dump_rank_results

CURRENT_DCP_VERSION = "1.0.0"  # what FileSystemWriter stamps into Metadata.version
_STEP = re.compile(r"^(?:iter_|step_|step-)?(\d+)$")


def parse_step(checkpoint_id: Any) -> int:
    """The step a DCP ``checkpoint_id`` names: an int, ``"10"``, ``"iter_0000010"``, ``"step_10"``, or a path whose
    last part is one of those."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, str | os.PathLike):
        name = os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
        m = _STEP.match(name)
        if m:
            return int(m.group(1))
    raise ValueError(f"checkpoint_id {checkpoint_id!r} names no step: pass the training step (checkpoint_id=10, "
                     "or 'iter_0000010'); the engine's tiers decide where it is stored")


def check_engine(engine: Any) -> None:
    """The engine must use the ``dcp`` layout, without compression on a file tier (DCP reads plain files)."""
    source = engine.config.source
    if engine.config.layout != "dcp":
        raise ConfigError(f"tiered_ckpt.dcp needs an engine with layout: dcp (this one has "
                          f"{engine.config.layout!r}): set layout: dcp in its configuration", key_path="layout",
                          source=source)
    index = {t.name: i for i, t in enumerate(engine.config.tiers)}
    for name, store in engine.pipeline.stores.items():
        if (files := store.files()) is not None and files.compression_name:
            raise ConfigError(f"compression would make .distcp files DCP's own reader cannot read (tier {name!r}): "
                              "remove the tier's compression setting, or set compression: {codec: none}, for "
                              "layout dcp", key_path=f"tiers[{index.get(name, '?')}].compression", source=source)


def _raw(data: bytes) -> dict[str, torch.Tensor]:
    return {"metadata": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


class TieredStorageWriter(StorageWriter, BlockingAsyncStager):
    """DCP storage writer: the snapshot into the engine's memory tier is the save; the drain does the rest.

    ``step``: the step to save (otherwise ``checkpoint_id`` names it on every ``dcp.save``). ``persistent=False``:
    memory tiers only (no file tier takes these steps). For ``dcp.async_save`` this writer is also DCP's stager
    (a CPU copy, DCP's own ``BlockingAsyncStager``; ``cache_staged_state_dict`` keeps its buffers between saves):
    the engine's snapshot then runs in DCP's upload thread. ``handles`` holds the latest saves'
    :class:`~tiered_ckpt.handles.SaveHandle` (newest last); :meth:`wait` waits until the last one is durable."""

    def __init__(self, engine: Any, step: int | None = None, *, persistent: bool = True,
                 cache_staged_state_dict: bool = False):
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        check_engine(engine)
        self.engine = engine
        self.step = step
        self.persistent = persistent
        self.handles: collections.deque[SaveHandle] = collections.deque(maxlen=16)  # the latest saves' handles
        self._pending: dict[str, Any] | None = None  # the coordinator's items, snapshotted in finish()
        self._lock = threading.Lock()
        self._is_coordinator = False
        self._use_collectives = True
        self._rank = engine.coords.rank
        self._save_id = str(uuid.uuid4())
        self._cached_save = False  # a save on a cached plan: every rank's snapshot waits for finish_cached()
        # Raw files the coordinator's snapshot carries beside DCP's (layouts.dcp.STEP_FILES: Megatron's common.pt
        # and metadata.json), {item: {"metadata": uint8 tensor}}; set before each save by the caller.
        self.step_files: dict[str, dict[str, torch.Tensor]] = {}

    # ----- DCP's protocol ----------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_step(checkpoint_id)
        self._save_id = str(uuid.uuid4())
        self._pending = None
        self._cached_save = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("TieredStorageWriter: no step to save: pass checkpoint_id=<step> to dcp.save, or "
                             "TieredStorageWriter(engine, step=...)")
        rank = kwargs.get("rank", self._rank)
        if rank is not None and rank != self.engine.coords.rank:
            raise TieredCkptError(f"DCP saves as rank {rank} of its process group, the engine is rank "
                                  f"{self.engine.coords.rank}: use the default process group (all ranks)")
        # use_collectives=False: DCP plans each rank alone and every rank's finish() gets its own Metadata
        self._use_collectives = kwargs.get("use_collectives", True) is not False
        self._is_coordinator = is_coordinator
        self._pending = None  # a save that failed before finish() left its items here

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self._use_collectives:  # this rank's plan alone
            return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{self._rank}_")) for p in plans]
        world = self.engine.coords.world_size
        if len(plans) != world:
            raise TieredCkptError(f"DCP planned {len(plans)} ranks, the engine's job has {world}: save on the "
                                  "default process group")
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        entries = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                entries.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                               else torch.empty(0, dtype=torch.uint8))
            else:
                if not isinstance(data, torch.Tensor):
                    raise TieredCkptError(f"rank {self._rank}: write item {item.index.fqn!r} resolved to "
                                          f"{type(data).__name__}, not a tensor")
                entries.append(data.detach())
        # FileSystemWriter's order: BYTE_IO items first, then the tensors (so on the CPU the files are its bytes)
        order = sorted(range(len(entries)), key=lambda i: plan.items[i].type != WriteItemType.BYTE_IO)
        plan_items = [plan.items[i] for i in order]
        entries = [entries[i] for i in order]
        index, results = self._file_layout(plan_items, entries)
        items = {DATA_ITEM: {"entries": entries, "index": index}}
        if self._is_coordinator or not self._use_collectives or self._cached_save:
            self._pending = items  # the snapshot waits for the Metadata (finish): the coordinator's, or each rank's
        else:
            self._snapshot(items)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        pickled = pickle.dumps(metadata)
        items = dict(self._pending or {DATA_ITEM: {"entries": [], "index": []}})
        item = METADATA_ITEM if self._use_collectives else RANK_METADATA_ITEM
        items[item] = {"metadata": torch.frombuffer(bytearray(pickled), dtype=torch.uint8)}
        if self._is_coordinator:
            items.update(self.step_files)
        self._pending = None
        self._snapshot(items)

    def start_cached(self, save_id: str) -> None:
        """The save about to run reuses a cached plan (no collective): ``save_id`` names it on every rank alike
        (the same on all ranks: nothing else ties their snapshots to one save), and each rank's snapshot waits for
        :meth:`finish_cached`. Call after ``set_up_storage_writer``."""
        self._cached_save = True
        self._save_id = save_id

    def finish_cached(self, results: list[WriteResult], metadata: Metadata | None) -> None:
        """This rank's snapshot of a save on a cached plan: its data, its own WriteResults, and on the coordinator
        (``metadata``: the cached plan's Metadata) that Metadata without ``storage_data``: the layout's commit and
        the reader merge every rank's results of the same ``save_id`` into ``.metadata``."""
        if not self._cached_save:
            raise TieredCkptError("finish_cached() without start_cached(): not a save on a cached plan")
        items = dict(self._pending or {DATA_ITEM: {"entries": [], "index": []}})
        items[RESULTS_ITEM] = _raw(dump_rank_results(self._rank, self.engine.coords.world_size, self._save_id,
                                                     results))
        if metadata is not None:
            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data = None  # the ranks' results, merged at commit and on load
            metadata.storage_meta = self.storage_meta()
            items[METADATA_ITEM] = _raw(pickle.dumps(metadata))
            items.update(self.step_files)
        self._pending = None
        self._cached_save = False
        self._snapshot(items)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    @property
    def checkpoint_id(self) -> str:
        return f"iter_{self.step:07d}" if self.step is not None else ""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never chosen by DCP on its own: it needs an engine

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """DCP's blocking CPU copy; the kept copy is page-locked only where CUDA is there to use it (DCP's own
        stager pins unconditionally, which fails on a machine without an accelerator)."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if not self.cache_staged_state_dict:
            return BlockingAsyncStager.stage(self, state_dict)
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.state_dict_cache)

    def __reduce__(self) -> Any:
        raise TypeError("TieredStorageWriter holds a CheckpointEngine and cannot go to another process: use "
                        "dcp.async_save's thread executor (the default), not AsyncCheckpointerType.PROCESS")

    # ----- ours --------------------------------------------------------------------------------------------
    def _file_layout(self, plan_items: list[Any], entries: list[torch.Tensor]
                     ) -> tuple[list[dict], list[WriteResult]]:
        """Where each write item sits in this rank's .distcp file, and DCP's WriteResults for it. A tensor's
        ``torch.save`` length comes from its dtype and shape alone (cached): no byte is serialized here."""
        name = data_file(self._rank)
        index: list[dict] = []
        results: list[WriteResult] = []
        offset = 0
        for item, data in zip(plan_items, entries, strict=True):
            if item.type == WriteItemType.BYTE_IO:
                info: dict[str, Any] = {"fqn": item.index.fqn, "kind": "bytes"}
                length = data.numel()
            else:
                td = item.tensor_data
                shape = tuple(int(s) for s in data.shape)
                if td is not None and (tuple(td.chunk.sizes) != shape or td.properties.dtype != data.dtype):
                    raise TieredCkptError(f"rank {self._rank}: write item {item.index.fqn!r} resolved to a tensor "
                                          f"of shape {list(shape)} {data.dtype}, the plan says "
                                          f"{list(td.chunk.sizes)} {td.properties.dtype}")
                info = {"fqn": item.index.fqn, "kind": "tensor"}
                length = torch_save_length(data.dtype, shape)
            info.update(offset=offset, length=length)
            index.append(info)
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
            offset += length
        return index, results

    def _snapshot(self, items: dict[str, Any]) -> None:
        assert self.step is not None
        handle = self.engine.save(self.step, items, persistent=self.persistent)
        with self._lock:
            self.handles.append(handle)

    @property
    def last_handle(self) -> SaveHandle | None:
        return self.handles[-1] if self.handles else None

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the last save is committed on every due tier, on every rank that calls it (raises
        :class:`~tiered_ckpt.handles.SaveError` if a tier could not take it): a load right after it finds the
        step (:meth:`~tiered_ckpt.engine.CheckpointEngine.wait_committed`)."""
        handle = self.last_handle
        if handle is not None:
            self.engine.wait_committed(handle, timeout=timeout)
