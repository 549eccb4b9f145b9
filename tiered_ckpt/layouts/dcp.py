"""``dcp``: PyTorch Distributed Checkpoint's own files, committed by our protocol.

A step directory is a plain DCP checkpoint: ``__{rank}_0.distcp`` per rank and ``.metadata``, so DCP's
``FileSystemReader`` (``dcp.load(..., checkpoint_id=<tier root>/iter_0000010)``) reads it as it reads
``FileSystemWriter``'s. Beside them, ``tiered_ckpt/`` holds our rank manifests and the checkpoint manifest (sizes
and checksums of every file), written last as on every layout.

The coordinator's pickled Metadata travels in its own snapshot as the ``dcp_metadata`` item and is staged at
``tiered_ckpt/dcp_metadata.bin``; once every rank's files are on the tier, :meth:`DcpLayout.finalize` writes it as
``.metadata`` (so a DCP reader never finds ``.metadata`` beside a missing data file). A save without collectives
(``dcp.save(..., use_collectives=False)``) gives every rank its own Metadata (``dcp_rank_metadata``), staged at
``tiered_ckpt/dcp_metadata_RRRRR.bin`` and written as DCP's ``__{rank}.metadata``.

A save on a cached plan (Megatron's ``torch_dist`` with a constant structure: no collective, so no rank has the
others' write results) stages the coordinator's Metadata without ``storage_data`` and, from every rank, its own
write results (``dcp_rank_results``, at ``tiered_ckpt/dcp_results_RRRRR.bin``); ``finalize`` merges them into
``.metadata`` (``dcp/_metadata.py``), refusing results of another save.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..parallel import ParallelLayout, RankCoords
from .base import META_DIR, MODEL_ITEM, OPTIM_ITEM, Layout

if TYPE_CHECKING:
    from ..manifest import FileEntry

log = logging.getLogger(__name__)

DATA_ITEM = "dcp"
METADATA_ITEM = "dcp_metadata"
RANK_METADATA_ITEM = "dcp_rank_metadata"  # a save without collectives: each rank's own Metadata
RESULTS_ITEM = "dcp_rank_results"  # a save on a cached plan: each rank's own write results
METADATA_FILE = ".metadata"
STAGED_METADATA = "dcp_metadata.bin"
METADATA_NAME = re.compile(r"^(?:__\d+)?\.metadata$")  # DCP's .metadata, or a rank's __{rank}.metadata
# Files beside DCP's that a framework on top of it writes once per step (Megatron's torch_dist: its common state and
# its metadata.json), carried as raw bytes in the coordinator's snapshot and written at the step directory's top.
STEP_FILES = {"megatron_common": "common.pt", "megatron_config": "metadata.json"}
DCP_ITEMS = frozenset({DATA_ITEM, METADATA_ITEM, RANK_METADATA_ITEM, RESULTS_ITEM, *STEP_FILES})


def rank_metadata_file(rank: int) -> str:
    return f"__{rank}{METADATA_FILE}"


class DcpLayout(Layout):
    name = "dcp"
    shared_items: tuple[str, ...] = ()

    def codec_for(self, item: str) -> str:
        return "distcp" if item in (DATA_ITEM, METADATA_ITEM, RANK_METADATA_ITEM, RESULTS_ITEM) or item in STEP_FILES \
            else "flat"

    def refused_items(self, names: Iterable[str]) -> str | None:
        # Items of engine.save's own would land beside DCP's files, which DCP's reader could not load (and
        # `verify` would fail the step): this layout holds what DCP's planner hands our storage writer.
        foreign = sorted(set(names) - DCP_ITEMS)
        if not foreign:
            return None
        megatron = " (Megatron's torch format: layout: megatron; its torch_dist format is what writes DCP's files)" \
            if {MODEL_ITEM, OPTIM_ITEM} & set(foreign) else ""
        return (f"layout: dcp holds what dcp.save writes through tiered_ckpt.dcp.TieredStorageWriter; engine.save "
                f"was given items {foreign}, which DCP could not load from it. Save them with dcp.save("
                "state_dict, storage_writer=TieredStorageWriter(engine)), or use layout: rank_sharded for "
                f"engine.save{megatron} (docs/dcp.md)")

    def item_key(self, step: int, item: str, coords: RankCoords, extension: str) -> str | None:
        if item == DATA_ITEM:
            return f"{self.step_dir(step)}/__{coords.rank}_0.distcp"
        if item == METADATA_ITEM:
            return f"{self.step_dir(step)}/{META_DIR}/{STAGED_METADATA}"
        if item == RANK_METADATA_ITEM:
            return f"{self.step_dir(step)}/{META_DIR}/dcp_metadata_{coords.rank:05d}.bin"
        if item == RESULTS_ITEM:
            return f"{self.step_dir(step)}/{META_DIR}/dcp_results_{coords.rank:05d}.bin"
        if item in STEP_FILES:
            return f"{self.step_dir(step)}/{STEP_FILES[item]}"
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{item}.{extension}"

    def optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{OPTIM_ITEM}.pt"

    def metadata_key(self, step: int) -> str:
        return f"{self.step_dir(step)}/{METADATA_FILE}"

    def is_derived(self, entry: FileEntry) -> bool:
        return bool(METADATA_NAME.match(entry.key.rsplit("/", 1)[-1]))

    def finalize(self, store: Any, step: int, parallel: ParallelLayout, files: list[FileEntry], scope: str
                 ) -> list[FileEntry]:
        """Write DCP's ``.metadata`` from the coordinator's staged copy (verified), once every rank's data is here;
        a save on a cached plan: merged with every rank's staged write results."""
        from ..manifest import FileEntry

        if any(self.is_derived(f) for f in files):
            return []
        staged = [f for f in files if f.item in (METADATA_ITEM, RANK_METADATA_ITEM)]
        results = {f.rank: f for f in files if f.item == RESULTS_ITEM}
        if not staged:
            # A node-local tier of a node without the coordinator: its data files are here, the step's
            # .metadata is on the coordinator's node and on the shared tiers.
            log.info("tier %r: step %d has no DCP metadata here (scope %s): load it from a shared tier",
                     store.name, step, scope)
            return []
        if results and set(results) != set(range(parallel.world_size)):
            # A node-local tier holds this node's ranks' results only: the merge needs every rank's.
            log.info("tier %r: step %d (saved on a cached plan) holds the write results of ranks %s only (scope %s): "
                     "its .metadata is on the shared tiers", store.name, step, sorted(results), scope)
            return []

        def read(entry: FileEntry) -> Any:
            return store.decode_stored(entry, store.read_verified(entry, step, entry.rank))

        out = []
        for entry in staged:
            blob = read(entry)
            if results and entry.item == METADATA_ITEM:
                from ..dcp._metadata import merged_bytes
                from ..tiers.base import as_memoryview

                blob = merged_bytes(as_memoryview(blob), {r: as_memoryview(read(e)) for r, e in results.items()},
                                    f"tier {store.name!r} step {step}")
            name = METADATA_FILE if entry.item == METADATA_ITEM else rank_metadata_file(entry.rank)
            key = f"{self.step_dir(step)}/{name}"
            size, checksum, _ = store._write_file(key, lambda b=blob: [b], step, entry.rank, compress=False)
            out.append(FileEntry(key=key, item=entry.item, rank=entry.rank, codec="distcp", size=size,
                                 checksum=checksum))
        return out
