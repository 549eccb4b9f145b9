"""``dcp``: PyTorch Distributed Checkpoint's own files, committed by our protocol.

A step directory is a plain DCP checkpoint: ``__{rank}_0.distcp`` per rank and ``.metadata``, so DCP's
``FileSystemReader`` (``dcp.load(..., checkpoint_id=<tier root>/iter_0000010)``) reads it as it reads
``FileSystemWriter``'s. Beside them, ``tiered_ckpt/`` holds our rank manifests and the checkpoint manifest (sizes
and checksums of every file), written last as on every layout.

The coordinator's pickled Metadata travels in its own snapshot as the ``dcp_metadata`` item and is staged at
``tiered_ckpt/dcp_metadata.bin``; once every rank's files are on the tier, :meth:`DcpLayout.finalize` writes it as
``.metadata`` (so a DCP reader never finds ``.metadata`` beside a missing data file).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..parallel import ParallelLayout, RankCoords
from .base import META_DIR, OPTIM_ITEM, Layout

if TYPE_CHECKING:
    from ..manifest import FileEntry

log = logging.getLogger(__name__)

DATA_ITEM = "dcp"
METADATA_ITEM = "dcp_metadata"
METADATA_FILE = ".metadata"
STAGED_METADATA = "dcp_metadata.bin"


class DcpLayout(Layout):
    name = "dcp"
    shared_items: tuple[str, ...] = ()

    def codec_for(self, item: str) -> str:
        return "distcp" if item in (DATA_ITEM, METADATA_ITEM) else "flat"

    def item_key(self, step: int, item: str, coords: RankCoords, extension: str) -> str | None:
        if item == DATA_ITEM:
            return f"{self.step_dir(step)}/__{coords.rank}_0.distcp"
        if item == METADATA_ITEM:
            return f"{self.step_dir(step)}/{META_DIR}/{STAGED_METADATA}"
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{item}.{extension}"

    def optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{OPTIM_ITEM}.pt"

    def metadata_key(self, step: int) -> str:
        return f"{self.step_dir(step)}/{METADATA_FILE}"

    def is_derived(self, entry: FileEntry) -> bool:
        return entry.key.endswith("/" + METADATA_FILE)

    def finalize(self, store: Any, step: int, parallel: ParallelLayout, files: list[FileEntry], scope: str
                 ) -> list[FileEntry]:
        """Write DCP's ``.metadata`` from the coordinator's staged copy (verified), once every rank's data is here."""
        from ..manifest import FileEntry

        if any(self.is_derived(f) for f in files):
            return []
        staged = next((f for f in files if f.item == METADATA_ITEM), None)
        if staged is None:
            # A node-local tier of a node without the coordinator: its data files are here, the step's
            # .metadata is on the coordinator's node and on the shared tiers.
            log.info("tier %r: step %d has no DCP metadata here (scope %s): load it from a shared tier",
                     store.name, step, scope)
            return []
        blob = store.read_verified(staged, step, staged.rank)
        raw = store.decode_stored(staged, blob)
        key = self.metadata_key(step)
        size, checksum, _ = store._write_file(key, lambda: [raw], step, staged.rank, compress=False)
        return [FileEntry(key=key, item=METADATA_ITEM, rank=staged.rank, codec="distcp", size=size,
                          checksum=checksum)]
