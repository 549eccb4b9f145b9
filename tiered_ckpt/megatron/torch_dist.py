"""Megatron-LM's ``torch_dist`` checkpoint format through the tiers (``args.ckpt_format == "torch_dist"``).

Megatron's ``dist_checkpointing`` splits a sharded state dict into a *common* part (rank 0's ``common.pt``), and
ShardedTensors / ShardedObjects that its ``TorchDistSaveShardedStrategy`` hands to PyTorch DCP; ``metadata.json``
names the backend. Here the same steps run with Megatron's own functions (``save_preprocess``, its DCP planners,
``load_preprocess``, the key translations), but DCP gets our :class:`~tiered_ckpt.dcp.TieredStorageWriter` /
:class:`~tiered_ckpt.dcp.TieredStorageReader`: the save blocks for a copy into shm, the drain writes the step
directory (``__R_0.distcp``, ``.metadata``, ``common.pt``, ``metadata.json``) to every file tier, and Megatron's own
``dist_checkpointing.load`` reads it there, at any TP/PP/DP its sharding type allows. Loading reads a step from the
fastest tier that holds it, ours or one Megatron wrote.

Planning: with ``cache_plan`` (the adapter sets it from Megatron's ``args.ckpt_assume_constant_structure``) the
first save plans with DCP's collectives, keeps every rank's final plan and the coordinator's Metadata, and rank 0
broadcasts an id for the plan. Later saves of the same structure run no collective at all: each rank checks its own
plan against the cached one (a rank whose structure changed raises instead of saving), copies its data into shm and
stages its own write results (where each item sits in its ``.distcp``: a ShardedObject's pickled length may change
between saves, shifting what follows), the coordinator the cached Metadata, all stamped with the save's id (the
plan's id and the number of saves on it, alike on every rank). The layout's commit merges them into ``.metadata``
once every rank's files are on the tier, and a load from shm merges the same snapshots (``dcp/_metadata.py``):
never results of two saves; a rank that failed leaves the step uncommitted.

Imports megatron.core: used only when a job has it.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import uuid
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy, SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save

from ..dcp.reader import TieredStorageReader
from ..dcp.writer import TieredStorageWriter
from ..errors import CorruptionError, TieredCkptError, TierError
from ..layouts.dcp import STEP_FILES
from ..tiers.base import as_memoryview

log = logging.getLogger(__name__)

BACKEND, VERSION = "torch_dist", 1
COMMON_ITEM, CONFIG_ITEM = "megatron_common", "megatron_config"
COMMON_FILE, CONFIG_FILE = STEP_FILES[COMMON_ITEM], STEP_FILES[CONFIG_ITEM]
CONTENT_METADATA_KEY = "content_metadata"  # where dist_checkpointing.save puts content_metadata


def _raw(data: bytes) -> dict[str, torch.Tensor]:
    return {"metadata": torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
            else torch.empty(0, dtype=torch.uint8)}


def _plan_signature(plan: Any) -> list[tuple]:
    """What a rank's local plan says about the structure: each write item's key, offsets, sizes, dtype."""
    out = []
    for item in plan.items:
        td = item.tensor_data
        out.append((item.index.fqn, tuple(item.index.offset or ()), item.type.name,
                    None if td is None else (tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes),
                                             str(td.properties.dtype))))
    return out


class _RecordingWriter(TieredStorageWriter):
    """Our writer, keeping what a cached save needs: this rank's local and final plans, the coordinator's
    Metadata as DCP built it (before finish() fills in storage data)."""

    record = False  # set while a save whose plan is to be cached runs
    local_plan: Any = None
    final_plan: Any = None
    metadata: Any = None

    def prepare_local_plan(self, plan: Any) -> Any:
        if self.record:
            self.local_plan = plan
        return super().prepare_local_plan(plan)

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.record:
            self.final_plan = plan
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        if self.record:
            self.metadata = copy.deepcopy(metadata)
        super().finish(metadata, results)


class TieredSaveShardedStrategy(SaveShardedStrategy):
    """Megatron's sharded save strategy (backend ``torch_dist``, version 1) writing through a CheckpointEngine.

    ``save(sharded_state_dict, checkpoint_dir)``: ``checkpoint_dir`` names the step (``iter_0000100`` or a path
    ending in it); the engine's tiers decide where it goes. ``step_files`` (rank 0): Megatron's ``common.pt`` and
    ``metadata.json`` bytes for the coordinator's snapshot. ``cache_plan``: see the module's docstring."""

    def __init__(self, engine: Any, *, persistent: bool = True, cache_plan: bool = False):
        super().__init__(BACKEND, VERSION)
        self.engine = engine
        self.writer = _RecordingWriter(engine, persistent=persistent)
        self.cache_plan = cache_plan
        self.step_files: dict[str, bytes] = {}
        self._cached: tuple[list[tuple], Any, Any] | None = None  # (local signature, final plan, Metadata)
        self._plan_id = ""  # the cached plan's, the same on every rank (broadcast by rank 0 when planned)
        self.planned_saves = 0  # saves that ran DCP's planning collectives (the rest reused the cached plan)
        self.cached_saves = 0  # saves on the cached plan (each counted when it starts, on every rank alike)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # ShardedObjects go through DCP as bytes, as in Megatron's own strategy

    @property
    def handles(self) -> Any:
        return self.writer.handles

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        # Megatron's translation: only main replicas, keyed by their global (sharded) keys
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
        writer = self.writer
        writer.reset(checkpoint_id=checkpoint_dir)
        writer.step_files = {item: _raw(data) for item, data in self.step_files.items()}
        planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        if self._cached is not None:
            self._save_cached(pyt_state_dict, planner)
            return
        writer.record = self.cache_plan
        try:
            dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)
        finally:
            writer.record = False
        self.planned_saves += 1
        if self.cache_plan:
            ids = [uuid.uuid4().hex if self.engine.coords.rank == 0 else None]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(ids, src=0)  # the planned save's last collective
            self._plan_id = str(ids[0])
            self.cached_saves = 0
            self._cached = (_plan_signature(writer.local_plan), writer.final_plan, writer.metadata)

    def _save_cached(self, pyt_state_dict: Any, planner: Any) -> None:
        """The plan of the first save, reused, with no collective: every rank snapshots its own write results, the
        coordinator the cached Metadata, under one save id (see the module's docstring)."""
        assert self._cached is not None
        signature, final_plan, metadata = self._cached
        self.cached_saves += 1  # first: a rank that fails below still counts the save, as the others do
        rank = self.engine.coords.rank
        coordinator = rank == 0
        writer = self.writer
        planner.set_up_planner(state_dict=pyt_state_dict, storage_meta=writer.storage_meta(),
                               is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        writer.start_cached(f"{self._plan_id}-{self.cached_saves}")
        local = planner.create_local_plan()
        mine = _plan_signature(local)
        if mine != signature:
            changed = sorted({s[0] for s in set(mine) ^ set(signature)})[:5]
            raise TieredCkptError(f"rank {rank}: the state's structure changed since the save plan was cached "
                                  f"(items {changed}...): args.ckpt_assume_constant_structure promises it does "
                                  "not; unset it to plan every save")
        results = writer.write_data(planner.finish_plan(dataclasses.replace(final_plan)), planner).value()
        writer.finish_cached(results, copy.deepcopy(metadata) if coordinator else None)


class _StepReader(TieredStorageReader):
    """Our DCP reader, plus the step's Megatron files (``common.pt``, ``metadata.json``) from the fastest tier."""

    def open_step(self) -> int:
        """Agree with every rank on the step to load (collective); later reads use it."""
        self.step = self._choose_step()
        self.requested = self.step
        return self.step

    def step_file(self, item: str, name: str) -> tuple[bytes, str, bool]:
        """(bytes, tier, verified) of one of Megatron's files of the chosen step."""
        assert self.step is not None
        reasons = []
        for tier, store in self._stores():
            try:
                slots, files = store.slots(), store.files()  # the Store protocol: no switch on its class
                if slots is not None:
                    found = self._snapshot(slots, 0, self.step, item)
                    if found is None:
                        continue
                    view, meta = found
                    state = view.load(meta, copy=True, verify=True, only={item})[item]
                    return bytes(as_memoryview(state["metadata"])), tier, all(
                        it.checksum for it in meta.items if it.name == item)
                if files is not None:
                    data, verified = self._file_bytes(files, self.step, f"{files.layout.step_dir(self.step)}/{name}")
                    if data is not None:
                        return data, tier, verified
            except (TierError, OSError, CorruptionError, TieredCkptError) as exc:
                reasons.append(f"tier {tier!r}: {exc}")
                log.warning("torch_dist load: step %d: %s unusable on tier %r: %s", self.step, name, tier, exc)
        raise TieredCkptError(f"rank {self.engine.coords.rank}: step {self.step}: no tier holds Megatron's {name} "
                              f"({'; '.join(reasons) or 'none has it'}): not a torch_dist checkpoint, or incomplete")


def save(engine: Any, step: int, sharded_state_dict: dict[str, Any], strategy: TieredSaveShardedStrategy, *,
         validate_access_integrity: bool = True, preprocess_common: Any = None,
         content_metadata: dict[str, Any] | None = None) -> Any:
    """Megatron's ``dist_checkpointing.save`` into the engine: ``common.pt`` and ``metadata.json`` from rank 0,
    the sharded part through ``strategy``. Returns the last SaveHandle of this rank."""
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity, preprocess_common)
    strategy.step_files = {}
    if engine.coords.rank == 0:
        buf = io.BytesIO()
        torch.save(common, buf)
        config = dataclasses.asdict(CheckpointingConfig(strategy.backend, strategy.version))
        strategy.step_files = {COMMON_ITEM: buf.getvalue(), CONFIG_ITEM: json.dumps(config).encode()}
    strategy.save(sharded, f"iter_{step:07d}")
    return strategy.writer.last_handle


class TieredLoadShardedStrategy(LoadShardedStrategy):
    """Megatron's sharded load strategy over our reader: DCP's MCoreLoadPlanner, each data file from the fastest
    tier with a verified copy (shm snapshots, local disk, S3, or a directory Megatron wrote)."""

    def __init__(self, reader: TieredStorageReader):
        super().__init__()
        self.reader = reader

    def check_backend_compatibility(self, loaded_backend: Any) -> None:
        pass

    def check_version_compatibility(self, loaded_version: Any) -> None:
        pass

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        raise NotImplementedError("use Megatron's dist_checkpointing.load_tensors_metadata on the step directory")

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> dict[str, Any]:
        # as Megatron's TorchDistLoadShardedStrategy.load, with our reader
        flexible = [t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in nested_values(sharded_state_dict)
                    if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        original = sharded_state_dict
        sharded, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded, True)
        dcp_load(pyt_state_dict, storage_reader=self.reader,
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=flexible,
                                          allow_shape_mismatch_sharded_tensors=mismatch))
        out = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        out = _replace_sharded_keys_with_state_dict_keys(out, flat_mapping, rename_mapping)
        _restore_dict_types(out, original)
        return out


def open_step(engine: Any, step: int | None) -> tuple[_StepReader, dict[str, Any]]:
    """The step to load (collective: the newest every rank can read, or ``step``) and its common state dict."""
    from .safe_load import load_bytes

    reader = _StepReader(engine, step)
    chosen = reader.open_step()
    data, tier, verified = reader.step_file(CONFIG_ITEM, CONFIG_FILE)
    try:
        config = CheckpointingConfig(**json.loads(data))
    except (ValueError, TypeError) as exc:
        raise CorruptionError(f"step {chosen} {CONFIG_FILE} (tier {tier!r}): not Megatron's checkpoint config: "
                              f"{exc}", tier=tier) from None
    if config.sharded_backend != BACKEND or config.common_backend != "torch":
        raise TieredCkptError(f"step {chosen} (tier {tier!r}): a {config.sharded_backend}/{config.common_backend} "
                              "checkpoint; only torch_dist/torch is read here")
    data, tier, verified = reader.step_file(COMMON_ITEM, COMMON_FILE)
    common = load_bytes(data, where=f"step {chosen} {COMMON_FILE} (tier {tier!r})",
                        trust_pickles=engine.config.load.trust_pickles)
    if not verified:
        log.warning("step %d: %s from tier %r has no checksum to verify it against (written by Megatron)", chosen,
                    COMMON_FILE, tier)
    return reader, common


def load(reader: _StepReader, common: dict[str, Any], sharded_state_dict: dict[str, Any], *,
         validate_access_integrity: bool = False) -> dict[str, Any]:
    """Megatron's ``dist_checkpointing.load`` of ``sharded_state_dict`` from the reader's step (collective)."""
    from megatron.core.dist_checkpointing.validation import (
        StrictHandling,
        determine_global_metadata,
        validate_integrity_and_strict_load,
    )

    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    state = copy.copy(common)
    merge(state, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)
    if validate_access_integrity:
        local_md, global_md = determine_global_metadata(sharded)
        sharded, _, _ = validate_integrity_and_strict_load(sharded, StrictHandling.ASSUME_OK_UNEXPECTED, True,
                                                           local_md, global_md, None)
    loaded = TieredLoadShardedStrategy(reader).load(sharded, reader.checkpoint_id)
    merge(state, loaded)
    return apply_factory_merges(state, factories)
