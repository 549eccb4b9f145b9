"""tiered_ckpt: checkpoint large-model training state through GPU memory, shared memory, local disk and object
stores; save blocks only for a memory-speed copy; load returns the newest verified checkpoint.

The names below are imported on first use (PEP 562): ``import tiered_ckpt`` alone, the ``tiered-ckpt --help``
of the command line and the opt-in pytest plugin do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointEngine": "engine",
    "Config": "config",
    "load_config": "config",
    "ConfigError": "errors",
    "CapacityError": "errors",
    "CorruptionError": "errors",
    "EncodeError": "errors",
    "LayoutMismatchError": "errors",
    "LoadIntoError": "errors",
    "NoCheckpointError": "errors",
    "RunLockedError": "errors",
    "SavesFailedError": "handles",
    "CheckpointUnreadableError": "errors",
    "PeerFailedError": "errors",
    "StepNotFoundError": "errors",
    "TieredCkptError": "errors",
    "TierError": "errors",
    "TierUnavailableError": "errors",
    "Event": "events",
    "LoadResult": "handles",
    "SaveError": "handles",
    "SaveHandle": "handles",
    "hookimpl": "hookspecs",
    "ParallelLayout": "parallel",
    "RankCoords": "parallel",
}

__all__ = [
    "CapacityError", "CheckpointEngine", "CheckpointUnreadableError", "Config", "ConfigError", "CorruptionError",
    "EncodeError", "Event", "LayoutMismatchError", "LoadIntoError", "LoadResult", "NoCheckpointError",
    "ParallelLayout", "PeerFailedError", "RankCoords", "RunLockedError", "SaveError", "SaveHandle",
    "SavesFailedError", "StepNotFoundError", "TierError", "TierUnavailableError", "TieredCkptError", "hookimpl",
    "load_config", "__version__",
]

if TYPE_CHECKING:
    from .config import Config, load_config
    from .engine import CheckpointEngine
    from .errors import (
        CapacityError,
        CheckpointUnreadableError,
        ConfigError,
        CorruptionError,
        EncodeError,
        LayoutMismatchError,
        LoadIntoError,
        NoCheckpointError,
        PeerFailedError,
        RunLockedError,
        StepNotFoundError,
        TieredCkptError,
        TierError,
        TierUnavailableError,
    )
    from .events import Event
    from .handles import LoadResult, SaveError, SaveHandle, SavesFailedError
    from .hookspecs import hookimpl
    from .parallel import ParallelLayout, RankCoords


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
