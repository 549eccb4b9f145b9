"""The built-in kinds, registered through the same hooks a third-party plugin uses."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def tiered_ckpt_register_tiers(registry):
    from .tiers.fsspec_tier import FsspecTier
    from .tiers.gpu import GpuTier
    from .tiers.local import LocalTier
    from .tiers.shm import ShmTier

    registry.add("gpu", GpuTier)
    registry.add("shm", ShmTier)
    registry.add("local", LocalTier)
    registry.add("fsspec", FsspecTier)


@hookimpl
def tiered_ckpt_register_layouts(registry):
    from .layouts.megatron import MegatronLayout
    from .layouts.rank_sharded import RankShardedLayout

    registry.add("megatron", MegatronLayout)
    registry.add("rank_sharded", RankShardedLayout)
    registry.add("dcp", __import__("tiered_ckpt.layouts.dcp", fromlist=["_"]).DcpLayout)  # DCP's files (issue #14)


@hookimpl
def tiered_ckpt_register_codecs(registry):
    from .codecs.file_codecs import FlatFileCodec, TorchFileCodec

    registry.add("flat", FlatFileCodec)
    registry.add("torch", TorchFileCodec)
    registry.add("distcp", __import__("tiered_ckpt.dcp._format", fromlist=["_"]).DistcpCodec)  # DCP (issue #14)
