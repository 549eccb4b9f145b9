"""Coordination across ranks, on a gloo group of our own so it never interleaves with the training's NCCL traffic.

Collectives run only at start-up (which ranks share a node) and on load (agreeing on one step): never on the
save path, where a slow or dead rank must not stall the others. Without ``torch.distributed`` initialised, a
single-process :class:`Coordinator` answers locally.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

from .parallel import RankCoords

log = logging.getLogger(__name__)

NODE_ENV = "TIERED_CKPT_NODE"  # overrides the host name as node identity (several "nodes" on one machine)


def node_id() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


class Coordinator:
    """This rank's view of the job: who shares its node, and agreement on what to load."""

    def __init__(self, coords: RankCoords, group: Any = None, node_ranks: list[int] | None = None):
        self.coords = coords
        self.group = group
        self.node_ranks = node_ranks or [coords.rank]

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @classmethod
    def create(cls, coords: RankCoords, timeout_s: float = 600.0) -> Coordinator:
        import torch.distributed as dist  # always importable; is_available() tells a build without it

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(coords)
        if dist.get_world_size() != coords.world_size or dist.get_rank() != coords.rank:
            raise ValueError(f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()}, the "
                             f"parallel layout says rank {coords.rank} of {coords.world_size}")
        # Our own gloo group: CPU-only collectives that never share a communicator with the training.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        names: list[Any] = [None] * coords.world_size
        dist.all_gather_object(names, node_id(), group=group)
        mine = names[coords.rank]
        return cls(coords, group, [r for r, n in enumerate(names) if n == mine])

    def all_gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.coords.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def agree_on_step(self, mine: set[int], requested: int | None = None) -> int | None:
        """The newest step every rank can read (or ``requested`` if every rank can); None if there is none."""
        everyone = self.all_gather(sorted(mine))
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        if requested is not None:
            return requested if requested in common else None
        return max(common) if common else None

    def all_succeeded(self, ok: bool) -> bool:
        return all(self.all_gather(bool(ok)))
