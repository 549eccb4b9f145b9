"""``megatron``: byte-for-byte Megatron-LM's legacy ``torch`` format.

``distrib_optim.pt`` sits beside ``model_optim_rng.pt`` and holds the DP-gathered buckets. No rank holds the
gathered state when it saves. On a POSIX file tier whose commit covers the job, each rank writes its own byte
ranges of Megatron's file in place (:meth:`write_in_place`, :mod:`tiered_ckpt.megatron.inplace`) and the
committing rank completes it at commit: no gather. On S3 each rank uploads its ranges as parts of one multipart
upload the committing rank completes (:mod:`tiered_ckpt.megatron.inplace_parts`). Elsewhere (other fsspec tiers,
node-local commits, compression, chained optimizers with EP > 1) each rank writes its own shard where the
``rank_sharded`` layout does (:meth:`optimizer_key`, the staging file); at commit, one rank merges a step's
staging files into :meth:`merged_optimizer_key` of every model-parallel group
(:func:`tiered_ckpt.megatron.merge.merge_step_on_tier`, streamed). All give the bytes Megatron writes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..parallel import ParallelLayout, RankCoords
from .base import OPTIM_ITEM, Layout, model_parallel_dir

if TYPE_CHECKING:
    from ..manifest import FileEntry

log = logging.getLogger(__name__)


def is_merged_optimizer_file(entry: FileEntry) -> bool:
    """Megatron's ``iter_N/mp_rank_*/distrib_optim.pt``: every DP rank's optimizer state of one model group."""
    parts = entry.key.split("/")
    return entry.item == OPTIM_ITEM and len(parts) == 3 and parts[1].startswith("mp_rank_")


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
        return is_merged_optimizer_file(entry)

    def placement(self, item: str, value: Any, tier: Any) -> Mapping[int, int] | None:
        """On a tier this rank writes Megatron's file into in place: each optimizer shard at its offset in that
        file, modulo a page, so the writes go from the slot with ``O_DIRECT`` (ranks whose ranges sat at other
        offsets in memory wrote them through bounce buffers, about 1.3x the time in ``benchmarks/README.md``)."""
        if item != OPTIM_ITEM or tier.positional() is None:
            return None
        from ..codecs.flat import ALIGNMENT as FLAT_ALIGNMENT
        from ..codecs.flat import PLACEMENT_MODULUS
        from ..megatron import inplace, rank_shard

        try:
            shard = rank_shard.parse(value, where=f"the {OPTIM_ITEM} item")
            wish = inplace.shard_placement(shard, PLACEMENT_MODULUS)
        except Exception as exc:  # only speed depends on it: what is wrong with the item, the drain reports
            log.debug("no placement for %s: %s", OPTIM_ITEM, exc)
            return None
        # A shard at a file offset that is not a multiple of 64 bytes cannot sit congruent with it in a flat
        # snapshot (64-byte aligned): its pages still go through bounce buffers (docs/layouts.md).
        odd = sum(1 for r in wish.values() if r % FLAT_ALIGNMENT)
        if odd:
            log.debug("rank %d: %d of %d optimizer shards sit at file offsets that are not multiples of %d bytes",
                      shard.rank, odd, len(wish), FLAT_ALIGNMENT)
        return wish

    def write_in_place(self, store: Any, step: int, coords: RankCoords, src: Any, key: str) -> FileEntry | None:
        """This rank's ranges of its directory's ``distrib_optim.pt``, written into the file all its DP group
        writes (None: the tier cannot, or this job's optimizers need the gather; ``key``, its staging file, is
        then written instead)."""
        if src.name != OPTIM_ITEM:
            return None
        writer = store.tier.positional()
        uploads = store.tier.shared_parts() if writer is None else None
        if writer is None and uploads is None:
            return None
        from ..megatron import inplace, inplace_parts, rank_shard

        shard = rank_shard.parse(src.materialize(), where=f"rank {coords.rank}'s {OPTIM_ITEM}")
        if writer is not None:
            def write() -> dict[str, Any] | None:
                return inplace.write_rank_pieces(writer, self.step_dir(step), shard, run_id=store.run_id, step=step)
        else:
            def write() -> dict[str, Any] | None:
                return inplace_parts.write_rank_parts(uploads, store.tier, self.step_dir(step), shard,
                                                      run_id=store.run_id, step=step)
        facts = store._retry(write, step, coords.rank, f"write {OPTIM_ITEM} in place")
        if facts is None:
            return None
        from ..manifest import FileEntry

        size, checksum = inplace.piece_checksum(facts)
        # its key: the file it holds ranges of (``meta.in_place.pieces``); kept in the rank manifest only
        return FileEntry(key=facts["key"], item=OPTIM_ITEM, rank=coords.rank, codec="torch", size=size,
                         checksum=checksum, compression=None, raw_size=size, meta={"in_place": facts})

    def checkpoint_files(self, files: list[FileEntry], derived: list[FileEntry]) -> list[FileEntry]:
        """The ranks' ranges of a file written in place are not files: the checkpoint manifest lists the file
        (its entry: ``written: in_place``), the ranges stay in the rank manifests, where a load finds them."""
        return [f for f in files if "in_place" not in f.meta] + derived

    def finalize(self, store: Any, step: int, parallel: ParallelLayout, files: list[FileEntry], scope: str
                 ) -> list[FileEntry]:
        """Complete Megatron's files the ranks wrote in place, or merge the step's per-rank optimizer shards into
        them (streamed, verified)."""
        pieces = [f for f in files if "in_place" in f.meta]
        if pieces:
            from ..errors import LayoutMismatchError
            from ..megatron.inplace import finish_files

            uploads = any("upload" in f.meta["in_place"] for f in pieces)
            writer = store.tier.shared_parts() if uploads else store.tier.positional()
            mixed = [f.rank for f in files if f.item == OPTIM_ITEM and "in_place" not in f.meta
                     and not self.is_derived(f)]
            if mixed or scope != "job" or writer is None:
                why = f"ranks {mixed[:8]} did not" if mixed else "this commit cannot finish them"
                raise LayoutMismatchError(f"step {step}: ranks wrote {OPTIM_ITEM} in place on tier {store.name!r}, "
                                          f"but {why}")
            if uploads:
                from ..megatron.inplace_parts import finish_uploads

                return store._retry(lambda: finish_uploads(writer, store.tier, step, pieces), step, 0,
                                    f"finish {OPTIM_ITEM}'s upload")
            return store._retry(lambda: finish_files(writer, step, pieces), step, 0, f"finish {OPTIM_ITEM} in place")
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
