"""``megatron``: byte-for-byte Megatron-LM's legacy ``torch`` format.

``distrib_optim.pt`` sits beside ``model_optim_rng.pt`` and holds the DP-gathered buckets. No rank holds the
gathered state when it saves, so each rank first writes its own shard where the ``rank_sharded`` layout does
(:meth:`optimizer_key`, the staging file); at commit, one rank merges a step's staging files into
:meth:`merged_optimizer_key` of every model-parallel group (:func:`tiered_ckpt.megatron.merge.merge_step_on_tier`,
streamed, byte-identical to what Megatron writes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..parallel import ParallelLayout, RankCoords
from .base import OPTIM_ITEM, Layout, model_parallel_dir

if TYPE_CHECKING:
    from ..manifest import FileEntry

log = logging.getLogger(__name__)


class MegatronLayout(Layout):
    name = "megatron"

    def optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        """Every rank's staging file: its own shard and bucket geometry (merged at commit)."""
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{OPTIM_ITEM}.pt"

    def merged_optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        """Megatron's gathered file of ``coords``' model-parallel group; written for DP rank 0 (dp = cp = 0)."""
        if coords.dp != 0 or coords.cp != 0:
            return None
        return f"{self.step_dir(step)}/{model_parallel_dir(coords)}/{OPTIM_ITEM}.pt"

    def is_derived(self, entry: FileEntry) -> bool:
        parts = entry.key.split("/")
        return entry.item == OPTIM_ITEM and len(parts) == 3 and parts[1].startswith("mp_rank_")

    def finalize(self, store: Any, step: int, parallel: ParallelLayout, files: list[FileEntry], scope: str
                 ) -> list[FileEntry]:
        """Merge the step's per-rank optimizer shards into Megatron's gathered files (streamed, verified)."""
        staged = [f for f in files if f.item == OPTIM_ITEM and not self.is_derived(f)]
        if not staged or any(self.is_derived(f) for f in files):
            return []  # nothing to merge, or the Megatron files are already there (written by `convert`)
        if scope != "job":
            # A node-local tier holds only its node's shards: Megatron's files need every DP rank's. The step
            # stays loadable here from the shards; the shared tier gets the Megatron files.
            log.info("tier %r: step %d holds per-rank optimizer shards only (node-local: no Megatron merge)",
                     store.name, step)
            return []
        from ..megatron.merge import merge_step_on_tier

        return merge_step_on_tier(store, step, topology=parallel, entries=files)
