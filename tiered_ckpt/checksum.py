"""Content checksums computed while bytes stream to a tier (xxh3-128: faster than the disk and the network)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import xxhash

from .tiers.base import Chunk, as_memoryview

ALGORITHM = "xxh3_128"
# Large chunks are fed in pieces so hashing and writing interleave while the bytes are still in cache.
PIECE = 64 << 20


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


class HashingStream:
    """Wraps an iterable of chunks; yields memoryviews of at most PIECE bytes and hashes them on the way."""

    def __init__(self, chunks: Iterable[Chunk]):
        self._chunks = chunks
        self._hasher = new_hasher()
        self.nbytes = 0

    def __iter__(self) -> Iterator[memoryview]:
        for chunk in self._chunks:
            mv = as_memoryview(chunk)
            for start in range(0, len(mv), PIECE):
                piece = mv[start:start + PIECE]
                self._hasher.update(piece)
                self.nbytes += len(piece)
                yield piece

    @property
    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def digest(data: Chunk) -> str:
    h = new_hasher()
    mv = as_memoryview(data)
    for start in range(0, len(mv), PIECE):
        h.update(mv[start:start + PIECE])
    return h.hexdigest()
