"""Files of Megatron checkpoints on tiers: written with their checksum computed on the way out, copied and
verified piece by piece, opened for range reads. Only ``Tier`` primitives are used, so this runs on every kind
of tier, and no whole file is held in memory.

Checksums are the manifest's (``xxh3_128`` of the stored bytes, see :mod:`tiered_ckpt.checksum`); the
entries returned are the manifest's :class:`~tiered_ckpt.manifest.FileEntry`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zstandard

from ..checksum import ALGORITHM, HashingStream, new_hasher
from ..config import RetryConfig
from ..errors import CorruptionError
from ..manifest import FileEntry
from ..retry import call_with_retry
from ..tiers.base import Chunk, Tier

PIECE = 16 << 20  # bytes per read_range when streaming a file (the writer may hold two)
TORCH_CODEC = "torch"


def where(tier: Tier, key: str) -> str:
    """``key`` and the tier it is on, for messages."""
    return f"{key} on tier {tier.name!r} ({tier.describe()})"


def iter_pieces(tier: Tier, key: str, size: int | None = None, piece: int = PIECE) -> Iterator[bytes]:
    """The bytes of a blob in pieces of at most ``piece`` bytes (``read_range``)."""
    size = tier.size(key) if size is None else size
    for start in range(0, size, piece):
        yield tier.read_range(key, start, min(piece, size - start))


def write_file(tier: Tier, key: str, make_chunks: Callable[[], Iterable[Chunk]], *, item: str, rank: int,
               meta: dict[str, Any] | None = None, retry: RetryConfig | None = None) -> FileEntry:
    """Write a file from a chunk stream, hashing it on the way out; returns its manifest entry.

    ``make_chunks`` is called once per attempt (a producer of a stream cannot be rewound); with ``retry``,
    transient tier errors are retried with the tier's policy.
    """
    def attempt() -> FileEntry:
        stream = HashingStream(make_chunks())
        tier.write_blob(key, stream)
        return FileEntry(key=key, item=item, rank=rank, codec=TORCH_CODEC, size=stream.nbytes,
                         checksum=f"{ALGORITHM}:{stream.hexdigest}", compression=None, raw_size=stream.nbytes,
                         meta=dict(meta or {}))

    return call_with_retry(attempt, retry) if retry is not None else attempt()


def check_digest(entry: FileEntry, size: int, hexdigest: str, where_: str) -> None:
    """Raise :class:`CorruptionError` unless ``size``/``hexdigest`` of the stored bytes match ``entry``."""
    if size != entry.size:
        raise CorruptionError(f"{where_}: size is {size} bytes, the manifest says {entry.size}")
    algorithm = entry.checksum.split(":", 1)[0]
    if algorithm != ALGORITHM:
        raise CorruptionError(f"{where_}: unknown checksum algorithm {algorithm!r}")
    if f"{ALGORITHM}:{hexdigest}" != entry.checksum:
        raise CorruptionError(f"{where_}: checksum mismatch: the file's bytes differ from what was written")


def verify_file(tier: Tier, entry: FileEntry) -> int:
    """Re-hash a file against its manifest entry, piece by piece; returns the bytes read."""
    h, n = new_hasher(), 0
    for piece in iter_pieces(tier, entry.key):
        h.update(piece)
        n += len(piece)
    check_digest(entry, n, h.hexdigest(), where(tier, entry.key))
    return n


class CopyStats:
    def __init__(self) -> None:
        self.bytes_read = 0


def copy_file(src: Tier, src_key: str, dst: Tier, dst_key: str, *, item: str, rank: int,
              entry: FileEntry | None = None, meta: dict[str, Any] | None = None,
              retry: RetryConfig | None = None, stats: CopyStats | None = None,
              progress: Callable[[int], None] | None = None) -> FileEntry:
    """Copy one file between tiers piece by piece; with ``entry`` (the source's manifest entry) the source is
    verified while it is read (and decompressed if it was stored compressed), and a mismatch removes the
    copy and raises :class:`CorruptionError`."""
    where_src = where(src, src_key)

    def chunks() -> Iterator[Chunk]:
        h, n = new_hasher(), 0
        pieces = iter_pieces(src, src_key, entry.size if entry is not None else None)
        for piece in pieces:
            h.update(piece)
            n += len(piece)
            if stats is not None:
                stats.bytes_read += len(piece)
            if progress is not None:
                progress(len(piece))
            yield piece
        if entry is not None:
            check_digest(entry, n, h.hexdigest(), where_src)

    def make() -> Iterable[Chunk]:
        if entry is not None and entry.compression is not None:
            return _decompressing(chunks(), entry, where_src)
        return chunks()

    try:
        return write_file(dst, dst_key, make, item=item, rank=rank, meta=meta, retry=retry)
    except CorruptionError:
        dst.delete(dst_key)
        raise


def _decompressing(pieces: Iterable[bytes], entry: FileEntry, where_: str) -> Iterator[bytes]:
    if entry.compression != "zstd":
        raise CorruptionError(f"{where_}: unknown compression {entry.compression!r}")
    dobj = zstandard.ZstdDecompressor().decompressobj()
    n = 0
    try:
        for piece in pieces:
            out = dobj.decompress(piece)
            n += len(out)
            if out:
                yield out
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"{where_}: zstd stream is corrupt: {exc}") from None
    if entry.raw_size is not None and n != entry.raw_size:
        raise CorruptionError(f"{where_}: decompressed to {n} bytes, the manifest says {entry.raw_size}")


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

    Without ``entry`` (no manifest): the tier itself, unverified. With it: the file is verified first when
    ``verify``; a compressed file is decompressed into a :class:`SpooledFile` (verified on the way).
    """
    if entry is None:
        return tier, 0
    if entry.compression is None:
        return tier, (verify_file(tier, entry) if verify else 0)
    spool = SpooledFile(where(tier, key))
    read = 0

    def counted() -> Iterator[bytes]:
        nonlocal read
        h = new_hasher()
        for piece in iter_pieces(tier, key, entry.size):
            h.update(piece)
            read += len(piece)
            yield piece
        if verify:
            check_digest(entry, read, h.hexdigest(), where(tier, key))

    for out in _decompressing(counted(), entry, where(tier, key)):
        spool.append(out)
    return spool, read


def commit_step(store: Any, step: int, topology: Any, entries: list[FileEntry]) -> None:
    """The commit protocol's last two acts for files already written: every rank's manifest (empty for ranks
    that own no file), then ``FileStore.try_commit`` (the checkpoint manifest, then the tracker)."""
    from ..manifest import RankManifest, dump_rank
    from ..parallel import ParallelLayout

    layout = ParallelLayout(tp=topology.tp, pp=topology.pp, dp=topology.dp, ep=topology.ep, cp=topology.cp,
                            order=topology.order)
    by_rank: dict[int, list[FileEntry]] = {r: [] for r in range(layout.world_size)}
    for e in entries:
        by_rank[e.rank].append(e)
    for r, files in by_rank.items():
        manifest = RankManifest(step=step, rank=r, layout=store.layout.name, coords=layout.coords(r).to_dict(),
                                parallel=layout.to_dict(), files=tuple(files), run_id=store.run_id)
        store.tier.publish(store.layout.rank_manifest_key(step, r), dump_rank(manifest))
    if store.try_commit(step, layout.coords(0)) is None:
        raise CorruptionError(f"step {step}: not committed on {store.tier.describe()}: rank manifests missing")
