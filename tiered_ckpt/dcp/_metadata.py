"""DCP's pickled ``.metadata``, read with an allow-list, and the merge a save on a cached plan needs.

A save on a cached plan (Megatron's ``torch_dist`` with a constant structure, :mod:`tiered_ckpt.megatron.torch_dist`)
runs no collective, so no rank learns another rank's write results: the coordinator's snapshot carries the cached
Metadata without ``storage_data`` (:func:`is_partial`), and every rank's snapshot carries its own results
(:func:`dump_rank_results`), both stamped with the save's id. :func:`merge` builds the complete Metadata from them:
at commit on a file tier (``layouts/dcp.py``), and when a load reads the step from memory snapshots
(``dcp/reader.py``). It refuses results of another save (another ``save_id``) and a missing rank, never mixes two.

Imports nothing of ``tiered_ckpt`` but its errors, so the ``dcp`` layout can use it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptionError, DecodeError

_ALLOWED_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.", "torch.distributed.tensor.")
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),  # FileSystemWriter's storage_meta.checkpoint_id
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex")}
RESULTS_FORMAT = "tiered_ckpt.dcp.rank_results/1"  # a rank's write results of a save on a cached plan


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's own reader unpickles ``.metadata`` with pickle's full power; ours allows DCP's metadata classes,
    torch dtypes and layouts, and nothing that could run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                           torch.dtype | torch.layout
                                                                           | torch.memory_format)):
            return super().find_class(module, name)
        if module.startswith(_ALLOWED_MODULES):
            cls = super().find_class(module, name)
            if isinstance(cls, type):  # DCP's dataclasses and enums; never a function
                return cls
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def load_metadata(data: bytes | memoryview, where: str) -> Any:
    try:
        return _MetadataUnpickler(io.BytesIO(bytes(data))).load()
    except Exception as exc:  # any failure here is a damaged or foreign file
        raise DecodeError(f"{where}: not a DCP .metadata file this reader accepts: {type(exc).__name__}: {exc}"
                          ) from None


def is_partial(metadata: Any) -> bool:
    """A cached plan's Metadata as the coordinator staged it: every rank's write results still to be merged."""
    return getattr(metadata, "storage_data", None) is None


def save_id(metadata: Any) -> str | None:
    return getattr(getattr(metadata, "storage_meta", None), "save_id", None)


def dump_rank_results(rank: int, world: int, sid: str, results: list[Any]) -> bytes:
    """One rank's WriteResults of a save on a cached plan (its part of ``storage_data``), pickled."""
    return pickle.dumps({"format": RESULTS_FORMAT, "rank": rank, "world": world, "save_id": sid,
                         "storage_data": {wr.index: wr.storage_data for wr in results}})


def load_rank_results(data: bytes | memoryview, where: str) -> dict[str, Any]:
    got = load_metadata(data, where)
    if not isinstance(got, dict) or got.get("format") != RESULTS_FORMAT or not isinstance(got.get("storage_data"),
                                                                                        dict):
        raise CorruptionError(f"{where}: not a rank's DCP write results ({RESULTS_FORMAT})")
    return got


def merge(metadata: Any, parts: Mapping[int, dict[str, Any]], where: str) -> Any:
    """The complete Metadata: the coordinator's partial one with every rank's ``storage_data``, in rank order (as
    DCP's coordinator builds it from the gathered results). ``parts``: rank -> :func:`load_rank_results`."""
    sid = save_id(metadata)
    if not is_partial(metadata) or sid is None:
        raise CorruptionError(f"{where}: the coordinator's DCP metadata is not a cached plan's (nothing to merge)")
    worlds = {p["world"] for p in parts.values()}
    if len(worlds) != 1:
        raise CorruptionError(f"{where}: the ranks' write results disagree on the world size ({sorted(worlds)})")
    (world,) = worlds
    missing = [r for r in range(world) if r not in parts]
    if missing:
        raise CorruptionError(f"{where}: no write results of rank(s) {missing[:8]} for save {sid}")
    other = sorted(r for r, p in parts.items() if p["save_id"] != sid or p["rank"] != r)
    if other:
        raise CorruptionError(f"{where}: the write results of rank(s) {other[:8]} are of another save than the "
                              f"coordinator's metadata ({sid}): never mixed")
    storage: dict[Any, Any] = {}
    for r in range(world):
        storage.update(parts[r]["storage_data"])
    metadata.storage_data = storage
    return metadata


def merged_bytes(metadata: bytes | memoryview, parts: Mapping[int, bytes | memoryview], where: str) -> bytes:
    """:func:`merge` on staged bytes (the coordinator's partial Metadata, each rank's results): ``.metadata``."""
    md = load_metadata(metadata, f"{where} (the coordinator's metadata)")
    loaded = {r: load_rank_results(b, f"{where} (rank {r}'s write results)") for r, b in parts.items()}
    return pickle.dumps(merge(md, loaded, where))
