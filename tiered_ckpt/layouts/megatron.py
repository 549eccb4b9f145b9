"""``megatron``: byte-for-byte Megatron-LM's legacy ``torch`` format.

``distrib_optim.pt`` sits beside ``model_optim_rng.pt`` and holds the DP-gathered buckets, written by DP rank 0
of each model-parallel group.
"""

from __future__ import annotations

from ..parallel import RankCoords
from .base import OPTIM_ITEM, Layout, model_parallel_dir


class MegatronLayout(Layout):
    name = "megatron"

    def optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        if coords.dp != 0:
            return None
        return f"{self.step_dir(step)}/{model_parallel_dir(coords)}/{OPTIM_ITEM}.pt"
