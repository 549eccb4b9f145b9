"""What a tier holds for one step of a checkpoint without our layouts' own reader (Megatron's, DLRover's, ours
read as Megatron's), and a rank's items loaded from it.

Kept apart from :mod:`.legacy` (which detects a checkpoint) and :mod:`.source` (which reads one) so that both can
use them without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import rank_shard
from .naming import Iteration, MegatronTopology


@dataclass(frozen=True)
class CheckpointInfo:
    """What a tier holds for one step (see the module doc)."""

    layout: str  # megatron | rank_sharded | dlrover
    iteration: Iteration
    step_dir: str  # iter_XXXXXXX or release
    has_manifest: bool
    topology: MegatronTopology
    rank_dirs: tuple[str, ...]  # mp_rank_* directories
    rank_files: tuple[int, ...]  # ranks with rank_RRRRR/distrib_optim.pt
    has_distrib_optim: bool  # mp_rank_*/distrib_optim.pt present
    tracker: Iteration | None  # what the tracker says (None: no tracker)
    writer: str  # tiered_ckpt | megatron | dlrover
    where: str
    args: Any = field(default=None, repr=False)  # the checkpoint's argparse.Namespace, when read
    notes: tuple[str, ...] = ()

    @property
    def verifiable(self) -> bool:
        return self.has_manifest

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "iteration": self.iteration, "step_dir": self.step_dir,
                "has_manifest": self.has_manifest, "topology": rank_shard.topology_dict(self.topology),
                "rank_dirs": list(self.rank_dirs), "rank_files": len(self.rank_files),
                "has_distrib_optim": self.has_distrib_optim, "tracker": self.tracker, "writer": self.writer,
                "where": self.where, "notes": list(self.notes)}


class LoadedItems(dict):
    """A rank's items (item name -> state), plus what is known about where they came from."""

    def __init__(self, items: dict[str, Any], *, info: CheckpointInfo, verified: bool, formats: dict[str, str],
                 notes: Sequence[str] = ()):
        super().__init__(items)
        self.info = info
        self.step = info.iteration
        self.layout = info.layout
        self.verified = verified
        self.formats = formats  # item -> "megatron" | "rank_shard" | "dlrover" (the layout of its content)
        self.notes = list(notes)
