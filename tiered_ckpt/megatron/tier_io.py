"""Reading Megatron checkpoints' files on tiers by range: verified against their manifest entry first, a
compressed one decompressed into a spooled copy. Writing, copying and committing them goes through the file
store (:meth:`~tiered_ckpt.file_store.FileStore.write_file`, ``copy_file``, ``commit_files``), with its retries,
events and crash points; the check of stored bytes against an entry is :func:`tiered_ckpt.file_streams.check_entry`
for both (docs/architecture.md).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

from ..file_streams import checked_pieces, decompressed, pieces
from ..manifest import FileEntry
from ..tiers.base import Tier

TORCH_CODEC = "torch"


def where(tier: Tier, key: str) -> str:
    """``key`` and the tier it is on, for messages."""
    return f"{key} on tier {tier.name!r} ({tier.describe()})"


def iter_pieces(tier: Tier, key: str, size: int | None = None) -> Iterator[bytes]:
    """The bytes of a blob in pieces (``read_range``)."""
    return pieces(tier, key, size)


class SpooledFile:
    """A decompressed copy of a compressed file in a temporary file, readable by range like a tier."""

    def __init__(self, name: str):
        self.name = name
        self._f = tempfile.TemporaryFile(prefix="tiered_ckpt-spool-")
        self._size = 0

    def append(self, data: bytes) -> None:
        self._f.write(data)
        self._size += len(data)

    def size(self, key: str) -> int:
        self._f.flush()
        return self._size

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        self._f.flush()
        return os.pread(self._f.fileno(), length, offset)

    def describe(self) -> str:
        return f"spooled copy of {self.name}"

    def close(self) -> None:
        self._f.close()


def open_ranges(tier: Tier, entry: FileEntry | None, key: str, *, verify: bool = True) -> tuple[Any, int]:
    """Something to read ``key`` by range from, and the bytes read to get it ready.

    Without ``entry`` (no manifest): the tier itself, unverified. With it: the file is checked first when
    ``verify``; a compressed file is decompressed into a :class:`SpooledFile` (checked on the way).
    """
    if entry is None:
        return tier, 0
    read = 0

    def count(n: int) -> None:
        nonlocal read
        read += n

    stored = checked_pieces(tier, key, entry, verify=verify, on_read=count)
    if entry.compression is None:
        if verify:
            for _ in stored:
                pass
        return tier, read
    spool = SpooledFile(where(tier, key))
    try:
        for out in decompressed(stored, entry, tier=tier.name, key=key):
            spool.append(out)
    except BaseException:
        spool.close()
        raise
    return spool, read
