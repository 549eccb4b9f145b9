"""Megatron-LM compatibility: its legacy ``torch`` checkpoint format, as plain library code.

- :mod:`.naming`: ``iter_*`` / ``mp_rank_*`` names, the tracker file, rank order and which rank writes which
  file;
- :mod:`.geometry`: the distributed optimizer's bucket geometry (padded/unpadded sizes, param and DP ranges);
- :mod:`.distrib_optim`: ``distrib_optim.pt`` content: merging DP shards into it, splitting it for any DP
  size;
- :mod:`.safe_load`: loading Megatron's pickles with Megatron's allow-list, without Megatron installed.
"""
