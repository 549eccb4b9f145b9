"""Where a rank sits in the job: global rank, world size, and its (tp, pp, dp, ep) coordinates.

Megatron-LM's default rank order is tp-cp-ep-dp-pp (tp varies fastest): ``rank = tp + TP*(cp + CP*(ep + EP*(dp +
DP*pp)))``. The order is configurable because other launchers place ranks differently; it is recorded in every
manifest so a reader can tell which file came from which coordinates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension. ``world_size`` must equal their product."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for dim in _DIMS:
            v = getattr(self, dim)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParallelLayout.{dim}: expected a positive integer, got {v!r}")
        parts = self.order.split("-")
        if sorted(parts) != sorted(_DIMS):
            raise ValueError(f"ParallelLayout.order: expected a permutation of {'-'.join(_DIMS)}, got {self.order!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.ep * self.cp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        values = {}
        rest = rank
        for dim in self.order.split("-"):
            size = getattr(self, dim)
            values[dim] = rest % size
            rest //= size
        return RankCoords(rank=rank, layout=self, **values)

    def rank_of(self, **coords: int) -> int:
        rank, stride = 0, 1
        for dim in self.order.split("-"):
            rank += coords.get(dim, 0) * stride
            stride *= getattr(self, dim)
        return rank

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "order": self.order,
                "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: dict) -> ParallelLayout:
        return cls(**{k: d[k] for k in ("tp", "pp", "dp", "ep", "cp", "order") if k in d})


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp: int = 0
    pp: int = 0
    dp: int = 0
    ep: int = 0
    cp: int = 0
    layout: ParallelLayout = field(default_factory=ParallelLayout)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def to_dict(self) -> dict:
        return {"rank": self.rank, "tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp}


def detect(parallel: ParallelLayout | RankCoords | None = None, rank: int | None = None) -> RankCoords:
    """This process's coordinates: given explicitly, or from torch.distributed / RANK and WORLD_SIZE (pure DP)."""
    if isinstance(parallel, RankCoords):
        return parallel
    if rank is None or parallel is None:
        env_rank, env_world = _rank_and_world()
        rank = env_rank if rank is None else rank
        if parallel is None:
            parallel = ParallelLayout(dp=env_world)
    if parallel.world_size == 1 and rank:
        raise ValueError(f"rank {rank} given with a world of 1; pass parallel=ParallelLayout(...)")
    return parallel.coords(rank)


def _rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # torch.distributed missing or broken: fall back to the environment
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
