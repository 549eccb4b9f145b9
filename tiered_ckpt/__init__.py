"""tiered_ckpt: checkpoint large-model training state through GPU memory, shared memory, local disk and object
stores; save blocks only for a memory-speed copy; load returns the newest verified checkpoint."""

from __future__ import annotations

from .config import Config, load_config
from .engine import CheckpointEngine
from .errors import (
    ConfigError,
    CorruptionError,
    NoCheckpointError,
    TieredCkptError,
    TierError,
)
from .events import Event
from .handles import LoadResult, SaveError, SaveHandle
from .hookspecs import hookimpl
from .parallel import ParallelLayout, RankCoords

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "Config", "ConfigError", "CorruptionError", "Event", "LoadResult", "NoCheckpointError",
    "ParallelLayout", "RankCoords", "SaveError", "SaveHandle", "TierError", "TieredCkptError", "hookimpl",
    "load_config", "__version__",
]
