"""Coordination across ranks, on a gloo group of our own so it never interleaves with the training's NCCL traffic.

Collectives run only at start-up (which ranks share a node) and on load (agreeing on one step): never on the
save path, where a slow or dead rank must not stall the others. Without ``torch.distributed`` initialised, a
single-process :class:`Coordinator` answers locally.

Every exchange is tagged with what it is for. A rank that fails between two exchanges sends :meth:`abort` in
place of its next one, so that the others raise :class:`PeerFailedError` there instead of waiting for it until the
group's timeout; ranks found at different exchanges (one retried a failed ``load()`` while the others went on)
all raise too, instead of reading one exchange's values as another's.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from .errors import ConfigError, PeerFailedError
from .parallel import RankCoords

log = logging.getLogger(__name__)

NODE_ENV = "TIERED_CKPT_NODE"  # overrides the host name as node identity (several "nodes" on one machine)
_ABORT = "abort"
_START_FAILED = "\0start-failed"  # in place of a node name at Coordinator.create: never a host's name
_T = TypeVar("_T")


def node_id() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


class Coordinator:
    """This rank's view of the job: who shares its node, and agreement on what to load.

    ``incarnation``: a token every rank of this job holds alike (rank 0's, exchanged at start-up), new for each
    start of the job; None where the ranks cannot agree on one (several ranks without ``torch.distributed``).
    Saves are told apart by it (docs/architecture.md, "Save identity")."""

    def __init__(self, coords: RankCoords, group: Any = None, node_ranks: list[int] | None = None,
                 incarnation: str | None = None, nodes: list[str] | None = None):
        self.coords = coords
        self.group = group
        self.node_ranks = node_ranks or [coords.rank]
        self.incarnation = incarnation
        self.node = node_id()
        self.nodes = nodes or [self.node]  # every node of the job (start-up exchange), once each
        #: after :meth:`agree_on_step`: rank -> the steps it holds that are newer than the one agreed on
        self.newer_elsewhere: dict[int, list[int]] = {}

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @classmethod
    def create(cls, coords: RankCoords, timeout_s: float = 600.0) -> Coordinator:
        import torch.distributed as dist  # always importable; is_available() tells a build without it

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(coords, incarnation=uuid.uuid4().hex[:16] if coords.world_size == 1 else None)
        if dist.get_world_size() != coords.world_size or dist.get_rank() != coords.rank:
            why = (f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()}, the parallel layout "
                   f"says rank {coords.rank} of {coords.world_size}: give CheckpointEngine a ParallelLayout whose "
                   "sizes multiply to the job's world size (or none: pure data parallel over torch.distributed)")
            cls.start_failed(f"ConfigError: {why}", timeout_s)  # the other ranks wait for this one below
            raise ConfigError(why)
        # Our own gloo group: CPU-only collectives that never share a communicator with the training.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        names: list[Any] = [None] * coords.world_size
        dist.all_gather_object(names, (node_id(), uuid.uuid4().hex[:16]), group=group)
        failed = {r: why for r, (n, why) in enumerate(names) if n == _START_FAILED}
        if failed:
            told = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            raise PeerFailedError(f"rank {coords.rank} stopped starting its engine: another rank's engine could not "
                                  f"start ({told}). Every rank stops here; the failing rank's own error says what "
                                  "to fix", failed)
        mine = names[coords.rank][0]
        return cls(coords, group, [r for r, (n, _) in enumerate(names) if n == mine], incarnation=names[0][1],
                   nodes=sorted({n for n, _ in names}))

    @staticmethod
    def start_failed(why: str, timeout_s: float = 600.0) -> None:
        """On a rank whose engine failed before :meth:`create`: take part in create's two collectives anyway,
        saying ``why``, so that the other ranks raise PeerFailedError there instead of waiting for this rank
        until the process group's timeout (a per-rank configuration error left them waiting minutes)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            names: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(names, (_START_FAILED, why[:2000]), group=group)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
            log.warning("could not tell the other ranks that this rank's engine failed to start: %s", exc)

    def all_gather(self, value: Any, what: str = "all_gather") -> list[Any]:
        """Every rank's ``value`` of the exchange ``what``, in rank order. Raises :class:`PeerFailedError` on every
        rank when some rank sent :meth:`abort`, or was at another exchange."""
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.coords.world_size
        dist.all_gather_object(out, (what, value), group=self.group)
        failed = {r: str(v) for r, (w, v) in enumerate(out) if w == _ABORT}
        if failed:
            told = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            raise PeerFailedError(f"rank {self.coords.rank} stopped at {what!r}: another rank failed ({told}). Every "
                                  "rank stops here; the failing rank's own error says what to fix", failed)
        if any(w != what for w, _ in out):
            where = ", ".join(f"rank {r} at {w!r}" for r, (w, _) in enumerate(out[:8]))
            raise PeerFailedError(f"the ranks are at different collective steps ({where}): every rank must call "
                                  "load() the same way, and none may retry it alone after an error")
        return [v for _, v in out]

    def alone(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``: this rank's own work between two exchanges. If it raises, the other ranks are told
        (:meth:`abort`: they raise PeerFailedError at the exchange they wait in), then the error goes on."""
        try:
            return fn(*args)
        except Exception as exc:
            self.abort(f"{type(exc).__name__}: {exc}")
            raise

    def abort(self, why: str) -> None:
        """Tell the other ranks, at the exchange they wait in, that this rank failed (``why``) and leaves."""
        if self.group is None:
            return
        import torch.distributed as dist

        out: list[Any] = [None] * self.coords.world_size
        try:
            dist.all_gather_object(out, (_ABORT, why), group=self.group)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
            log.warning("rank %d could not tell the other ranks that it failed: %s", self.coords.rank, exc)

    def agree_on_step(self, mine: set[int], requested: int | None = None) -> int | None:
        """The newest step every rank can read (or ``requested`` if every rank can); None if there is none."""
        everyone = self.all_gather(sorted(mine), "agree_on_step")
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        chosen = (requested if requested in common else None) if requested is not None else max(common, default=None)
        floor = -1 if chosen is None else chosen
        self.newer_elsewhere = {r: [s for s in steps if s > floor and s not in common]
                                for r, steps in enumerate(everyone) if any(s > floor for s in steps)}
        return chosen

    def all_succeeded(self, ok: bool, what: str = "all_succeeded") -> bool:
        return all(self.all_gather(bool(ok), what))
