"""Content checksums computed while bytes stream to a tier (xxh3-128: faster than the disk and the network)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from .tiers.base import Chunk, as_memoryview

ALGORITHM = "xxh3_128"
# Large chunks are fed in pieces so hashing and writing interleave while the bytes are still in cache.
PIECE = 64 << 20
ASYNC_MIN = 4 << 20  # smaller pieces are hashed inline: a thread hand-off would cost more than it saves


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


class HashingStream:
    """Wraps an iterable of chunks; yields memoryviews of at most PIECE bytes and hashes them on the way.

    Large pieces are hashed on a helper thread while the consumer writes them (xxhash and ``os.write`` both
    release the GIL), so hashing adds nothing to a write that is slower than the hash. The stream waits for a
    piece's hash before asking the producer for more, so producers may still reuse their buffers.
    """

    def __init__(self, chunks: Iterable[Chunk]):
        self._chunks = chunks
        self._hasher = new_hasher()
        self.nbytes = 0

    def __iter__(self) -> Iterator[memoryview]:
        pending: Future | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-hash") as pool:
            for chunk in self._chunks:
                mv = as_memoryview(chunk)
                for start in range(0, len(mv), PIECE):
                    piece = mv[start:start + PIECE]
                    if pending is not None:
                        pending.result()
                        pending = None
                    if len(piece) >= ASYNC_MIN:
                        pending = pool.submit(self._hasher.update, piece)
                    else:
                        self._hasher.update(piece)
                    self.nbytes += len(piece)
                    yield piece
                if pending is not None:  # before the producer may touch this chunk's buffer again
                    pending.result()
                    pending = None

    @property
    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def digest(data: Chunk) -> str:
    h = new_hasher()
    mv = as_memoryview(data)
    for start in range(0, len(mv), PIECE):
        h.update(mv[start:start + PIECE])
    return h.hexdigest()
