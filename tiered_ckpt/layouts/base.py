"""Layout policies: where each (step, item, rank) lives on a file tier, and how steps are found again.

Both built-in layouts share Megatron-LM's step directories (``iter_0000010``), its tracker file, and
``mp_rank_*/model_optim_rng.pt``; they differ in where the distributed optimizer's state goes. Items that are not
Megatron's go to ``iter_XXXXXXX/rank_RRRRR/<item>.<ext>`` in both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ..parallel import ParallelLayout, RankCoords

if TYPE_CHECKING:
    from ..manifest import FileEntry

TRACKER = "latest_checkpointed_iteration.txt"
META_DIR = "tiered_ckpt"  # inside each step directory: manifests
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")
_MANIFEST = re.compile(r"^iter_(\d{7,})/" + META_DIR + r"/manifest\.json$")
_RANK_MANIFEST = re.compile(r"^iter_(\d{7,})/" + META_DIR + r"/rank_(\d{5,})\.json$")
_RANK_FAILED = re.compile(r"^iter_(\d{7,})/" + META_DIR + r"/rank_(\d{5,})\.failed$")

MODEL_ITEM = "model_optim_rng"
OPTIM_ITEM = "distrib_optim"


def model_parallel_dir(coords: RankCoords) -> str:
    """Megatron's ``mp_rank_TT[_PPP][_EEE]``: the pp suffix when PP > 1, the ep suffix when EP > 1."""
    from ..megatron.naming import rank_dir_name

    return rank_dir_name(coords.tp, coords.pp, coords.ep, pp_size=coords.layout.pp, ep_size=coords.layout.ep)


class Layout:
    """The parts every layout shares. Subclasses decide where Megatron's optimizer state goes."""

    name = "base"
    tracker = TRACKER

    def step_dir(self, step: int) -> str:
        return f"iter_{step:07d}"

    def parse_step_dir(self, name: str) -> int | None:
        m = _STEP_DIR.match(name)
        return int(m.group(1)) if m else None

    def manifest_key(self, step: int) -> str:
        return f"{self.step_dir(step)}/{META_DIR}/manifest.json"

    def rank_manifest_key(self, step: int, rank: int) -> str:
        return f"{self.step_dir(step)}/{META_DIR}/rank_{rank:05d}.json"

    def started_key(self, step: int, rank: int) -> str:
        """The marker a rank writes before its first file of ``step``: the step directory is ours from then on,
        even if the save fails before any manifest (layouts/foreign.py tells Megatron-LM's directories by it)."""
        return f"{self.step_dir(step)}/{META_DIR}/rank_{rank:05d}.started"

    def rank_failed_key(self, step: int, rank: int) -> str:
        """Where a rank records that its part of ``step`` could not be written (failure_records.py)."""
        return f"{self.step_dir(step)}/{META_DIR}/rank_{rank:05d}.failed"

    def commit_failed_key(self, step: int) -> str:
        """Where the committing rank records that ``step`` will not be committed (failure_records.py)."""
        return f"{self.step_dir(step)}/{META_DIR}/commit.failed"

    @staticmethod
    def parse_rank_failed_key(key: str) -> tuple[int, int] | None:
        m = _RANK_FAILED.match(key)
        return (int(m.group(1)), int(m.group(2))) if m else None

    def rank_manifest_prefix(self, step: int) -> str:
        return f"{self.step_dir(step)}/{META_DIR}/"

    @staticmethod
    def parse_manifest_key(key: str) -> int | None:
        m = _MANIFEST.match(key)
        return int(m.group(1)) if m else None

    @classmethod
    def committed_in(cls, keys: Iterable[str]) -> set[int]:
        """The steps whose checkpoint manifest is among ``keys`` (a tier's listing): its committed steps."""
        return {s for s in map(cls.parse_manifest_key, keys) if s is not None}

    @staticmethod
    def parse_rank_manifest_key(key: str) -> tuple[int, int] | None:
        m = _RANK_MANIFEST.match(key)
        return (int(m.group(1)), int(m.group(2))) if m else None

    # Items whose files another program reads, with the codec it needs: a tier's ``codec``/``codecs`` cannot change
    # them (config.py refuses it, naming the key). Megatron-LM loads its two files with torch.load.
    fixed_codecs: ClassVar[dict[str, str]] = {MODEL_ITEM: "torch", OPTIM_ITEM: "torch"}
    fixed_codec_reason: ClassVar[str] = "Megatron-LM loads this file with torch.load"
    # The codec of every other item, unless the tier's configuration names one (``codec``, ``codecs``).
    default_codec: ClassVar[str] = "flat"

    def codec_for(self, item: str) -> str:
        """The layout's own choice of codec for ``item``. Any choice but :attr:`default_codec` is fixed: a tier's
        configuration cannot change it (a layout overriding this method keeps its files' formats that way)."""
        return self.fixed_codecs.get(item, self.default_codec)

    def file_codec(self, item: str, tier: Any = None) -> str:
        """The codec of ``item``'s file on a tier configured by ``tier`` (a TierConfig; None: the layout's own
        choice): the layout's fixed choice, else the tier's ``codecs[item]``, its ``codec``, the default."""
        own = self.codec_for(item)
        if own != self.default_codec or tier is None:
            return own
        return (getattr(tier, "codecs", None) or {}).get(item) or getattr(tier, "codec", None) or own

    def refused_items(self, names: Iterable[str]) -> str | None:
        """Why a save of items with these names cannot go into this layout (asked before the copy), or None."""
        return None

    def item_key(self, step: int, item: str, coords: RankCoords, extension: str) -> str | None:
        """The file of ``item`` written by ``coords`` at ``step``, or None when this rank does not write it."""
        if item == MODEL_ITEM:
            # Megatron's model state is the same on every DP rank: DP rank 0 of each model-parallel group writes it.
            if coords.dp != 0 or coords.cp != 0:  # context-parallel ranks would write the same path
                return None
            return f"{self.step_dir(step)}/{model_parallel_dir(coords)}/{MODEL_ITEM}.pt"
        if item == OPTIM_ITEM:
            return self.optimizer_key(step, coords)
        return f"{self.step_dir(step)}/rank_{coords.rank:05d}/{item}.{extension}"

    def optimizer_key(self, step: int, coords: RankCoords) -> str | None:
        raise NotImplementedError

    def files_for_rank(self, files: Iterable[FileEntry], parallel: dict, coords: RankCoords) -> list[FileEntry]:
        """The files ``coords`` reads at load: its own, plus Megatron's model file of its model-parallel group
        (written once per group, by DP rank 0)."""
        saved = ParallelLayout.from_dict(parallel)
        mine = []
        for entry in files:
            if self.is_derived(entry):
                continue
            if entry.rank == coords.rank:
                mine.append(entry)
            elif entry.item in self.shared_items and _same_model_group(saved.coords(entry.rank), coords):
                mine.append(entry)
        return mine

    # Items written once per model-parallel group and read by every DP rank of it.
    shared_items: tuple[str, ...] = (MODEL_ITEM,)

    def is_derived(self, entry: FileEntry) -> bool:
        """Files made at commit from other files (not a rank's own item): never loaded as a rank's item."""
        return False

    def placement(self, item: str, value: Any, tier: Any) -> Mapping[int, int] | None:
        """Where tensors of ``item`` (its ``value``, as saved) should sit in the memory tier's slot for this
        layout's writes to ``tier``: ``{id(tensor): offset modulo a page}`` (a multiple of 64), or None (the
        default: anywhere). Asked when a save places the item anew, on the blocking path; the slot's layout
        then serves every later save of the same structure. Only speed depends on it: whatever it says, every
        byte is written where it belongs."""
        return None

    def write_in_place(self, store: Any, step: int, coords: RankCoords, src: Any, key: str) -> FileEntry | None:
        """Write item ``src`` (whose own file would be ``key``) into a file the layout derives at commit, when the
        store's commit covers the job; return its entry, or None to write ``key`` as usual (the default)."""
        return None

    def checkpoint_files(self, files: list[FileEntry], derived: list[FileEntry]) -> list[FileEntry]:
        """The checkpoint manifest's files: the ranks' (``files``) and those :meth:`finalize` made (``derived``).
        Every one names a file of the step, whole. Default: all of them."""
        return files + derived

    def finalize(self, store: Any, step: int, parallel: ParallelLayout, files: list[FileEntry], scope: str
                 ) -> list[FileEntry]:
        """Called by the committing rank once every rank's files of ``step`` are on ``store``, before the
        checkpoint manifest: write files derived from them and return their entries (default: none)."""
        return []


def _same_model_group(a: RankCoords, b: RankCoords) -> bool:
    return (a.tp, a.pp, a.ep, a.cp) == (b.tp, b.pp, b.ep, b.cp)
