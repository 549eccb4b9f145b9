"""Per-tier compression: zstd, streaming, so no whole-file copy is ever held in memory."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import zstandard

from .config import CompressionConfig
from .errors import CorruptionError
from .tiers.base import Chunk, as_memoryview

# Feed zstd this much at a time: big enough for its worker threads, small enough to keep memory flat.
FEED = 16 << 20


def compress_chunks(chunks: Iterable[Chunk], cfg: CompressionConfig) -> Iterator[bytes]:
    """Compress a stream of chunks into a stream of zstd frames' bytes (one frame)."""
    cctx = zstandard.ZstdCompressor(level=cfg.level, threads=cfg.threads)
    cobj = cctx.compressobj()
    for chunk in chunks:
        mv = as_memoryview(chunk)
        for start in range(0, len(mv), FEED):
            out = cobj.compress(mv[start:start + FEED])
            if out:
                yield out
    tail = cobj.flush()
    if tail:
        yield tail


def decompress_to_tensor(blob: torch.Tensor, raw_size: int, *, where: str = "",
                         tier: str | None = None) -> torch.Tensor:
    """Decompress a whole stored blob into a fresh uint8 tensor of exactly ``raw_size`` bytes."""
    try:
        out = torch.empty(raw_size, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as exc:  # our zstd frames carry no content size to check it against first
        raise CorruptionError(f"cannot allocate the manifest's raw_size of {raw_size} bytes for the decompressed "
                              f"data ({type(exc).__name__}): a damaged manifest, or less memory than the data "
                              "needs", tier=tier, key=where) from None
    dest = as_memoryview(out) if raw_size else memoryview(bytearray(0))
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(as_memoryview(blob), read_across_frames=True)
        filled = 0
        while filled < raw_size:
            n = reader.readinto(dest[filled:])
            if not n:
                break
            filled += n
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptionError(f"zstd stream is corrupt: {exc}", tier=tier, key=where) from None
    if filled != raw_size or extra:
        raise CorruptionError(f"decompressed size differs from the manifest's {raw_size} bytes", tier=tier, key=where)
    return out
