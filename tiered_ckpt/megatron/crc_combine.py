"""CRC-32 of a concatenation from the CRC-32s of its parts, without their bytes.

A zip record's CRC-32 covers its whole data; in the gather-free commit of the ``megatron`` layout
(:mod:`.inplace`) each DP rank writes only its own byte ranges of a record, and reports their CRC-32s. CRC-32 is
linear over GF(2): for ``A`` followed by ``B``, ``crc(AB) = crc(A) * x^(8 |B|) + crc(B)`` modulo the CRC
polynomial (the pre- and post-conditioning of zlib's CRC cancel out in that sum). Polynomials are kept in
CRC-32's reflected bit order: bit 31 holds the coefficient of ``x^0``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

_POLY = 0xEDB88320  # x^32 + x^26 + ... + 1, reflected, without the x^32 term
_ONE = 1 << 31  # the polynomial 1


def _times(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial."""
    out = 0
    for i in range(32):
        if a & (_ONE >> i):  # a has the term x^i: add b * x^i
            out ^= b
        b = (b >> 1) ^ (_POLY if b & 1 else 0)  # b *= x
    return out


@cache
def _x_to_2_to_the(k: int) -> int:
    """``x^(2^k)`` modulo the polynomial."""
    if k == 0:
        return _ONE >> 1  # x
    half = _x_to_2_to_the(k - 1)
    return _times(half, half)


def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial."""
    out, bits, k = _ONE, 8 * nbytes, 0
    while bits:
        if bits & 1:
            out = _times(out, _x_to_2_to_the(k))
        bits >>= 1
        k += 1
    return out


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``."""
    if len_b <= 0:
        return crc_a
    return _times(crc_a, _shift(len_b)) ^ crc_b


def crc32_of_parts(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive parts given as ``(crc32, length)``, in order."""
    crc = 0
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc
