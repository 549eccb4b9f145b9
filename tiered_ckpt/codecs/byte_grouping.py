"""Byte grouping: store the bytes of floating-point tensors plane by plane before zstd.

The high bytes of neighbouring floats (sign, exponent) repeat far more than the low mantissa bytes; laid out
together they compress better. Measured on AdamW state after 30 steps of a small MLP (zstd level 3):
fp32 params 1.08 → 1.17, exp_avg 1.08 → 1.17, exp_avg_sq 1.11 → 1.24, bf16 params 1.29 → 1.41.

The transform works block by block (``BLOCK`` bytes of one tensor at a time), so memory stays bounded and the
data region keeps its length and offsets: only bytes *within* a block move. Tensors of 1-byte or non-float
dtypes, numpy arrays, byte blobs and the alignment gaps are stored as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .flat import HeaderInfo, TensorEntry

BLOCK = 4 << 20  # bytes per block; a multiple of every element size


def _groupable(entry: TensorEntry) -> bool:
    return entry.kind in ("tensor", "parameter") and entry.dtype.is_floating_point and entry.nbytes > 0 and (
        torch.empty((), dtype=entry.dtype).element_size() > 1)


def _element_size(entry: TensorEntry) -> int:
    return torch.empty((), dtype=entry.dtype).element_size()


def grouped_chunks(info: HeaderInfo, data: torch.Tensor) -> Iterator[torch.Tensor]:
    """The data region, with every float tensor's blocks regrouped by byte plane (same total length)."""
    pos = 0
    total = info.total_bytes
    for entry in sorted((e for e in info.tensors if _groupable(e)), key=lambda e: e.offset):
        if entry.offset < pos:
            continue  # a tensor stored once but listed twice (tied weights)
        if entry.offset > pos:
            yield data[pos:entry.offset]
        es = _element_size(entry)
        end = entry.offset + entry.nbytes
        for start in range(entry.offset, end, BLOCK):
            block = data[start:min(start + BLOCK, end)]
            yield block.view(-1, es).t().contiguous().view(-1)
        pos = end
    if pos < total:
        yield data[pos:total]


def ungroup_(info: HeaderInfo, data: torch.Tensor) -> None:
    """Undo :func:`grouped_chunks` in place on a decompressed data region."""
    done = set()
    for entry in info.tensors:
        if not _groupable(entry) or entry.offset in done:
            continue
        done.add(entry.offset)
        es = _element_size(entry)
        end = entry.offset + entry.nbytes
        for start in range(entry.offset, end, BLOCK):
            block = data[start:min(start + BLOCK, end)]
            block.copy_(block.clone().view(es, -1).t().contiguous().view(-1))
