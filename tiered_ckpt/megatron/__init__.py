"""Megatron-LM compatibility: its legacy ``torch`` checkpoint format, as plain library code (no Megatron import).

Format:
- :mod:`.naming`: ``iter_*`` / ``mp_rank_*`` names, the tracker file, rank order and which rank writes which file;
- :mod:`.geometry`: the distributed optimizer's bucket geometry (padded/unpadded sizes, param and DP ranges);
- :mod:`.distrib_optim`: ``distrib_optim.pt`` content: merging DP shards into it, splitting it for any DP size;
- :mod:`.rank_shard`: the ``rank_sharded`` layout's per-rank file (a rank's shards plus the geometry);
- :mod:`.safe_load`: loading Megatron's pickles with Megatron's allow-list, without Megatron installed;
- :mod:`.torch_zip` / :mod:`.lazy_torch`: ``torch.save`` files written as streams and read by byte range.

Operations:
- :mod:`.merge`: rank files -> Megatron's ``distrib_optim.pt`` on a tier (the ``megatron`` layout's commit hook);
- :mod:`.legacy` / :mod:`.source`: checkpoints without our manifest (Megatron's, DLRover's): detect, load a rank;
- :mod:`.infer`: bucket geometry of a Megatron-written checkpoint, from its own model state;
- :mod:`.convert` / :mod:`.cli_convert`: layout conversion and DP re-splitting, ``tiered-ckpt convert``;
- :mod:`.adapter`: ``save_checkpoint`` / ``load_checkpoint`` mirroring Megatron-LM's, through the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_checkpoint", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the adapter is not needed to read or write the format.
    if name in __all__:
        from . import adapter

        return getattr(adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
