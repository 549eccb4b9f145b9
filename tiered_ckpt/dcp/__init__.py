"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) through the tiers: see docs/dcp.md.

``TieredStorageWriter`` and ``TieredStorageReader`` are DCP's StorageWriter / StorageReader over a
:class:`~tiered_ckpt.CheckpointEngine` configured with ``layout: dcp``. Planning is DCP's; staging, drain,
checksums, commit, retention and tiers are ours.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TieredStorageReader", "TieredStorageWriter"]


def __getattr__(name: str) -> Any:  # torch.distributed.checkpoint is imported on first use
    if name == "TieredStorageWriter":
        from .writer import TieredStorageWriter

        return TieredStorageWriter
    if name == "TieredStorageReader":
        from .reader import TieredStorageReader

        return TieredStorageReader
    raise AttributeError(name)
