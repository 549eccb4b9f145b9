"""Content checksums computed while bytes stream to a tier (xxh3-128: faster than the disk and the network)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from .fast_crc import crc32
from .tiers.base import Chunk, as_memoryview, chunks_stable

ALGORITHM = "xxh3_128"
# Large chunks are fed in pieces so hashing and writing interleave while the bytes are still in cache.
PIECE = 64 << 20
ASYNC_MIN = 4 << 20  # smaller pieces are hashed inline: a thread hand-off would cost more than it saves


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


CRC32 = "crc32"  # Megatron's file written in place by the DP ranks: its checksum is combined from theirs


class Crc32Hasher:
    """``update``/``hexdigest`` over zlib's CRC-32 (eight hex digits)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Chunk) -> None:
        self.crc = crc32(as_memoryview(data), self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def hasher_for(checksum: str) -> Any:
    """A hasher of the algorithm a manifest's ``checksum`` names (``xxh3_128``, or ``crc32`` for files whose
    checksum was combined from ranges), or None for an unknown one."""
    algorithm = checksum.split(":", 1)[0]
    if algorithm == ALGORITHM:
        return new_hasher()
    return Crc32Hasher() if algorithm == CRC32 else None


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
        self.stable = chunks_stable(chunks)  # pieces are views of the chunks: as stable as they are

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


# Memory snapshots are checksummed piece by piece, so that a restore verifies them on every core at once: one
# xxh3 stream runs at about memory speed on one core, which on its own costs most of a copy of the snapshot.
SNAPSHOT_PIECE = 64 << 20
_SNAPSHOT_TAG = f"{ALGORITHM}*{SNAPSHOT_PIECE >> 20}MiB"
class LazyPool:
    """A thread pool made on first use, and made again in a forked child (which inherits the object but not its
    threads, and maybe a lock some other thread held at the fork)."""

    def __init__(self, workers: int, thread_name_prefix: str):
        self._workers, self._prefix = workers, thread_name_prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._lock = None, threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._prefix)
            return self._pool


# Threads for hashing (and copying) pieces in parallel: xxhash and numpy copies release the GIL.
_HASH_POOL = LazyPool(min(4, os.cpu_count() or 1), "tiered_ckpt-verify")
hash_pool = _HASH_POOL.get


def _piece_digests(mv: memoryview, piece: int) -> list[str]:
    pieces = [mv[i:i + piece] for i in range(0, len(mv), piece)] or [mv]
    if len(pieces) == 1:
        return [xxhash.xxh3_128(pieces[0]).hexdigest()]
    return list(hash_pool().map(lambda p: xxhash.xxh3_128(p).hexdigest(), pieces))


def snapshot_checksum(data: Chunk) -> str:
    """The checksum of a memory snapshot's item: xxh3-128 of each 64 MiB piece, computed in parallel."""
    return f"{_SNAPSHOT_TAG}:" + ",".join(_piece_digests(as_memoryview(data), SNAPSHOT_PIECE))


def is_piecewise(checksum: str) -> bool:
    return checksum.partition(":")[0] == _SNAPSHOT_TAG


def snapshot_matches(data: Chunk, checksum: str) -> bool:
    """Whether ``data`` matches ``checksum`` (:func:`snapshot_checksum`'s, or a plain ``xxh3_128:`` one)."""
    tag, _, value = checksum.partition(":")
    if tag == ALGORITHM:
        return digest(data) == value
    if tag != _SNAPSHOT_TAG:
        return False  # a format this version does not know: treated as a mismatch, so the next tier is used
    return ",".join(_piece_digests(as_memoryview(data), SNAPSHOT_PIECE)) == value
