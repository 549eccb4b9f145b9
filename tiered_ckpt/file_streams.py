"""Stored files as byte streams: read by range, checked against their manifest entry, decompressed.

The one place that decides whether stored bytes are the file a manifest describes (:func:`check_entry`): the
file store's whole-file reads and the streamed reads of Megatron's format code (``megatron/tier_io.py``) both end
there (docs/architecture.md). Only ``Tier`` primitives are used, and no whole file is held in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import zstandard

from .checksum import ALGORITHM, CRC32, hasher_for
from .errors import CorruptionError
from .manifest import FileEntry
from .tiers.base import Tier

PIECE = 16 << 20  # bytes per read_range when streaming a file (a writer may hold two)


def check_entry(entry: FileEntry, size: int, hexdigest: str, *, tier: str, key: str | None = None) -> None:
    """Raise :class:`CorruptionError` (naming ``tier`` and the file) unless stored bytes of ``size`` bytes with
    ``hexdigest`` (under the algorithm the entry names) are the file ``entry`` describes."""
    key = entry.key if key is None else key
    if size != entry.size:
        raise CorruptionError(f"size is {size} bytes, the manifest says {entry.size}", tier=tier, key=key)
    algorithm = entry.checksum.split(":", 1)[0]
    if algorithm not in (ALGORITHM, CRC32):
        raise CorruptionError(f"unknown checksum algorithm {algorithm!r}", tier=tier, key=key)
    if f"{algorithm}:{hexdigest}" != entry.checksum:
        raise CorruptionError(f"checksum mismatch: the file's bytes differ from what was written (the manifest says "
                              f"{entry.checksum}, they hash to {algorithm}:{hexdigest})", tier=tier, key=key)


def pieces(tier: Tier, key: str, size: int | None = None, piece: int = PIECE) -> Iterator[bytes]:
    """The bytes of a blob in pieces of at most ``piece`` bytes (``read_range``)."""
    size = tier.size(key) if size is None else size
    for start in range(0, size, piece):
        yield tier.read_range(key, start, min(piece, size - start))


def checked_pieces(tier: Tier, key: str, entry: FileEntry | None, *, verify: bool = True,
                   on_read: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """:func:`pieces` of ``key``, hashed on the way and checked against ``entry`` after the last one (when there
    is an entry and ``verify``): a damaged file raises before the stream ends, so nothing built from it is
    used. ``on_read(n)`` counts the bytes read."""
    hasher = hasher_for(entry.checksum) if entry is not None and verify else None
    n = 0
    for piece in pieces(tier, key, entry.size if entry is not None else None):
        if hasher is not None:
            hasher.update(piece)
        n += len(piece)
        if on_read is not None:
            on_read(len(piece))
        yield piece
    if hasher is not None:
        assert entry is not None
        check_entry(entry, n, hasher.hexdigest(), tier=tier.name, key=key)


def decompressed(stored: Iterable[bytes], entry: FileEntry, *, tier: str, key: str) -> Iterator[bytes]:
    """The raw bytes of a file stored with ``entry.compression``, as a stream."""
    if entry.compression != "zstd":
        raise CorruptionError(f"unknown compression {entry.compression!r}", tier=tier, key=key)
    dobj = zstandard.ZstdDecompressor().decompressobj()
    n = 0
    try:
        for piece in stored:
            out = dobj.decompress(piece)
            n += len(out)
            if out:
                yield out
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"zstd stream is corrupt: {exc}", tier=tier, key=key) from None
    if entry.raw_size is not None and n != entry.raw_size:
        raise CorruptionError(f"decompressed to {n} bytes, the manifest says {entry.raw_size}", tier=tier, key=key)


def raw_pieces(tier: Tier, key: str, entry: FileEntry | None, *, verify: bool = True,
               on_read: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """The file's raw bytes (decompressed where its entry says it was stored compressed), checked as
    :func:`checked_pieces` does."""
    stored = checked_pieces(tier, key, entry, verify=verify, on_read=on_read)
    if entry is not None and entry.compression is not None:
        return decompressed(stored, entry, tier=tier.name, key=key)
    return stored
