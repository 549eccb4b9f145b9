"""``rank_sharded``: every rank writes its own distributed-optimizer shard; no gather on the save path."""

from __future__ import annotations

from ..parallel import RankCoords
from .base import OPTIM_ITEM, Layout


class RankShardedLayout(Layout):
    name = "rank_sharded"

    def optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{OPTIM_ITEM}.pt"
