"""Where a rank sits in the job: global rank, world size, and its (tp, pp, dp, ep) coordinates.

Megatron-LM's default rank order is tp-cp-ep-dp-pp (tp varies fastest): ``rank = tp + TP*(cp + CP*(ep + EP*(dp +
DP*pp)))``. The order is configurable because other launchers place ranks differently; it is recorded in every
manifest so a reader can tell which file came from which coordinates. :class:`ParallelLayout` is the only
topology class: Megatron's format code (``megatron/``) uses it too, under the name ``MegatronTopology``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def mp_rank_name(tp: int, pp: int, ep: int, *, pp_size: int, ep_size: int) -> str:
    """Megatron's ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]`` for valid coordinates: the pp part when
    ``pp_size > 1``, the ep part when ``ep_size > 1`` (``megatron.naming.rank_dir_name`` checks its arguments
    first; its parser lives there too)."""
    name = f"mp_rank_{tp:02d}"
    if pp_size > 1:
        name += f"_{pp:03d}"
    if ep_size > 1:
        name += f"_{ep:03d}"
    return name
_DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the tp/pp/dp/ep/cp dimensions and the order in which ranks fill them (first = fastest); the
    world size is their product. The one topology class: Megatron's format code knows it as
    ``megatron.naming.MegatronTopology``.

    ``order`` names each dimension once; one of size 1 may be left out (it then varies slowest). ``dp`` is the
    size of the order's dp *dimension*: with EP > 1, Megatron's dense data-parallel group (which shards the dense
    distributed optimizer) spans the ep and dp dimensions, the expert-data-parallel group only dp.
    """

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
                raise ConfigError(f"ParallelLayout.{dim}: expected a positive integer, got {v!r}")
        tokens = self.order.split("-") if isinstance(self.order, str) else []
        if not tokens or len(set(tokens)) != len(tokens) or not set(tokens) <= set(_DIMS):
            raise ConfigError(f"ParallelLayout.order {self.order!r}: expected distinct dims among {'-'.join(_DIMS)}")
        left_out = [d for d in _DIMS if d not in tokens and getattr(self, d) > 1]
        if left_out:
            raise ConfigError(f"ParallelLayout.order {self.order!r} leaves out {left_out}, whose size is > 1")

    @classmethod
    def from_layout(cls, layout: Any) -> ParallelLayout:
        """From any object with ``tp, pp, dp, ep, cp`` (and optionally ``order``) attributes."""
        return cls(**{d: getattr(layout, d, 1) for d in _DIMS}, order=getattr(layout, "order", DEFAULT_ORDER))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.ep * self.cp

    def _dims(self) -> list[str]:
        tokens = self.order.split("-")
        return tokens + [d for d in _DIMS if d not in tokens]  # left-out dims have size 1

    def coords(self, rank: int) -> RankCoords:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ConfigError(f"rank: expected a non-negative integer, got {rank!r}")
        if rank >= self.world_size:
            raise ConfigError(f"rank {rank} is outside a world of {self.world_size}")
        values = {}
        rest = rank
        for dim in self._dims():
            size = getattr(self, dim)
            values[dim] = rest % size
            rest //= size
        return RankCoords(rank=rank, layout=self, **values)

    position = coords  # Megatron's format code asks for a rank's position

    def rank_of(self, *, tp: int = 0, pp: int = 0, dp: int = 0, ep: int = 0, cp: int = 0) -> int:
        coords = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        rank, stride = 0, 1
        for dim in self._dims():
            size = getattr(self, dim)
            if not 0 <= coords[dim] < size:
                raise ConfigError(f"{dim}={coords[dim]} is outside size {size}")
            rank += coords[dim] * stride
            stride *= size
        return rank

    def group(self, rank: int, dims: str | Iterable[str]) -> list[int]:
        """The ranks that differ from ``rank`` only along ``dims`` (e.g. ``"tp"``, ``["ep", "dp"]``), sorted."""
        dims = [dims] if isinstance(dims, str) else list(dims)
        unknown = [d for d in dims if d not in _DIMS]
        if unknown:
            raise ConfigError(f"unknown dims {unknown}; expected some of {_DIMS}")
        pos = self.coords(rank)
        combos: list[dict[str, int]] = [{d: getattr(pos, d) for d in _DIMS}]
        for d in dims:
            combos = [{**c, d: i} for c in combos for i in range(getattr(self, d))]
        return sorted(self.rank_of(**c) for c in combos)

    def tp_group(self, rank: int) -> list[int]:
        return self.group(rank, "tp")

    def pp_group(self, rank: int) -> list[int]:
        return self.group(rank, "pp")

    def dp_group(self, rank: int, *, with_cp: bool = False) -> list[int]:
        """Megatron's dense data-parallel group (ep and dp dims; plus cp for the optimizer's ``intra_dp_cp``)."""
        return self.group(rank, ["ep", "dp", "cp"] if with_cp else ["ep", "dp"])

    def expert_dp_group(self, rank: int) -> list[int]:
        return self.group(rank, "dp")

    def ep_group(self, rank: int) -> list[int]:
        return self.group(rank, "ep")

    def rank_dir(self, rank: int) -> str:
        """Megatron's ``mp_rank_*`` directory holding this rank's model shard."""
        pos = self.coords(rank)
        return mp_rank_name(pos.tp, pos.pp, pos.ep, pp_size=self.pp, ep_size=self.ep)

    def writes_model_optim_rng(self, rank: int) -> bool:
        """Whether this rank writes ``model_optim_rng.pt``: exactly one writer per rank directory.

        Megatron writes where ``dp_rank == 0 or expert_dp_rank == 0`` (DP without CP), i.e. dp == 0 in any ep
        and any cp; ranks with cp > 0 write the same path with the same content. We pick cp == 0 of those.
        """
        pos = self.coords(rank)
        return pos.dp == 0 and pos.cp == 0

    def writes_distrib_optim(self, rank: int) -> bool:
        """Whether this rank writes ``distrib_optim.pt``: DP rank 0 of the optimizer's group (dp == cp == 0).

        With EP > 1 that holds in every ep directory: Megatron's chained optimizer then saves ``[dense,
        expert]`` in ep = 0 and ``[None, expert]`` elsewhere.
        """
        pos = self.coords(rank)
        return pos.dp == 0 and pos.cp == 0

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


def layout_changes(saved: dict, current: ParallelLayout) -> list[str]:
    """What differs between a checkpoint's recorded parallel layout (``to_dict()``) and ``current``
    ("DP 4 → 2", ...); empty when they are the same."""
    now = current.to_dict()

    def size(layout: dict, dim: str) -> int:
        # DP as Megatron counts it, expert ranks included (world / (TP x PP x CP)), as `convert --dp` does:
        # ParallelLayout.dp leaves EP out, and "DP 2 → 1" read wrong to a MoE user whose DP went 4 → 2
        return layout.get(dim, 1) * (layout.get("ep", 1) if dim == "dp" else 1)

    changed = [f"{dim.upper()} {size(saved, dim)} → {size(now, dim)}" for dim in ("tp", "pp", "dp", "ep", "cp")
               if size(saved, dim) != size(now, dim)]
    if saved.get("world_size", 1) != now["world_size"] and not changed:
        changed.append(f"world size {saved.get('world_size')} → {now['world_size']}")
    return changed


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
