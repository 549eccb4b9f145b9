"""A snapshot's piecewise checksums taken, and checked, off the save's path: yielding to a save's copy.

The same values as :func:`~tiered_ckpt.checksum.snapshot_checksum` and
:func:`~tiered_ckpt.checksum.snapshot_matches` (xxh3-128 of each 64 MiB piece, the pieces on the hash pool's
threads), fed to the hasher in sub-pieces of :data:`STEP` bytes with :func:`~tiered_ckpt.copy_gate.wait_clear`
between them: the checksums taken after a save, and the drain's check of the slot while it writes, sleep while
a later save copies (docs/architecture.md, "The data path of a save").
"""

from __future__ import annotations

import functools
import threading

import xxhash

from . import copy_gate
from .checksum import _SNAPSHOT_TAG, SNAPSHOT_PIECE, hash_pool, snapshot_matches
from .tiers.base import Chunk, as_memoryview

STEP = 8 << 20  # bytes hashed between two looks at the gate (a few ms of one core)


class Stopped(Exception):
    """The hashing was called off (``stop``): the bytes are being overwritten, their checksum is of no use."""


def _piece_digest(mv: memoryview, stop: threading.Event | None = None) -> str:
    h = xxhash.xxh3_128()
    for start in range(0, len(mv), STEP):
        if stop is not None and stop.is_set():
            raise Stopped
        if copy_gate.wait_clear() and stop is not None and stop.is_set():  # called off while it waited
            raise Stopped
        h.update(mv[start:start + STEP])
    return h.hexdigest()


def _digests(data: Chunk, stop: threading.Event | None = None) -> list[str]:
    mv = as_memoryview(data)
    pieces = [mv[i:i + SNAPSHOT_PIECE] for i in range(0, len(mv), SNAPSHOT_PIECE)] or [mv]
    if len(pieces) == 1:
        return [_piece_digest(pieces[0], stop)]
    return list(hash_pool().map(functools.partial(_piece_digest, stop=stop), pieces))


def checksum(data: Chunk, stop: threading.Event | None = None) -> str:
    """:func:`~tiered_ckpt.checksum.snapshot_checksum` of ``data``, yielding to a save's copy; :class:`Stopped`
    within a few MiB once ``stop`` is set."""
    return f"{_SNAPSHOT_TAG}:" + ",".join(_digests(data, stop))


def matches(data: Chunk, expected: str) -> bool:
    """:func:`~tiered_ckpt.checksum.snapshot_matches`, yielding to a save's copy where ``expected`` is piecewise."""
    tag, _, value = expected.partition(":")
    if tag != _SNAPSHOT_TAG:
        return snapshot_matches(data, expected)
    return ",".join(_digests(data)) == value
