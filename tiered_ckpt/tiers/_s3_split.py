"""Split blobs on S3 (the ``split_blobs`` option): a blob only tiered_ckpt reads, stored as separate objects.

A multipart upload must be assembled by the server when it completes, and some servers (moto, some
S3-compatible stores) copy every part to do so, then read the whole object again for each ranged GET. Plain
objects cost neither. A blob larger than ``part_size`` is stored as:

* pieces ``<key>.tcsplit-<token>-<n>`` (``n`` from 1): every full part but the last, PUT in parallel;
* the last part under ``<key>`` itself, PUT only after every piece landed, its user metadata naming the token,
  the piece size, the number of parts and the blob's size (:class:`Split`).

The key's object appears last, so the blob is visible whole or not at all, as with a multipart completion. A
new write of the key draws a new token, so pieces are never overwritten; the pieces of earlier writes are
removed after the new key object is in place, and a reader that finds a piece gone reads the blob again (the
key was replaced; ``read_range`` says so as a transient error instead). Pieces are hidden from ``list()`` and go
with their key in ``delete()`` (with the option on) and ``delete_prefix()``. Other programs would see only the
last part under the key: the tier splits only blobs the engine writes with
:meth:`~tiered_ckpt.tiers.base.Tier.write_private_blob` (files of the ``flat`` codec), never Megatron's or DCP's
files. docs/object-stores.md has the trade-off (more objects to list, no assembly).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._s3 import RequestBody, Upload

if TYPE_CHECKING:
    from .s3 import S3Tier

log = logging.getLogger(__package__ + ".s3")

METADATA_KEY = "tiered-ckpt-split"  # S3 user metadata (x-amz-meta-tiered-ckpt-split) on the key's object
PIECE_MARK = ".tcsplit-"
ABORT_PAUSES_S = (0.2, 0.5, 1.0)  # between looks for an aborted write's pieces (at least two looks)
_PIECE = re.compile(re.escape(PIECE_MARK) + r"[0-9a-f]{12}-\d{5,}$")


class PieceMissing(Exception):
    """Raised on the event loop when a piece of a split blob is not found; the tier then looks at the key again
    (written anew: read again; else the piece was lost)."""

    def __init__(self, split: Split, number: int):
        super().__init__(f"piece {number} of {split.parts} is missing")
        self.split = split
        self.number = number


def piece_name(name: str, token: str, number: int) -> str:
    """The object (or key) of piece ``number`` of the blob ``name`` written with ``token``."""
    return f"{name}{PIECE_MARK}{token}-{number:05d}"


def is_piece_name(name: str) -> bool:
    return bool(_PIECE.search(name))


@dataclass(frozen=True)
class Split:
    """How a split blob is stored: ``parts`` parts of ``piece_size`` bytes (the last one shorter or equal)."""

    token: str
    piece_size: int
    parts: int
    total: int

    def encode(self) -> dict[str, str]:
        return {METADATA_KEY: f"1 {self.token} {self.piece_size} {self.parts} {self.total}"}

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any] | None) -> Split | None:
        """The split an object's metadata describes; None for a whole object. A description this version cannot
        read raises ValueError (the caller names the tier and key)."""
        # some servers send header names capitalised, and botocore keeps the case it was sent
        text = next((v for k, v in (metadata or {}).items() if str(k).lower() == METADATA_KEY), None)
        if text is None:
            return None
        fields = str(text).split()
        if len(fields) != 5 or fields[0] != "1":
            raise ValueError(f"unknown split description {text!r} in the object's metadata")
        split = cls(fields[1], int(fields[2]), int(fields[3]), int(fields[4]))
        if split.piece_size <= 0 or split.parts < 2 or not (
                (split.parts - 1) * split.piece_size < split.total <= split.parts * split.piece_size):
            raise ValueError(f"inconsistent split description {text!r} in the object's metadata")
        return split

    @property
    def last_offset(self) -> int:
        """Where the last part (the key's own object) starts in the blob."""
        return (self.parts - 1) * self.piece_size

    def spans(self, offset: int, length: int) -> list[tuple[int, int, int, int]]:
        """The parts ``[offset, offset + length)`` touches: ``(part number, offset in the part, length, offset in
        the range)``; part ``parts`` is the key's own object."""
        out, pos, end = [], offset, offset + length
        while pos < end:
            number = min(pos // self.piece_size + 1, self.parts)
            start = (number - 1) * self.piece_size
            n = min(end, start + self.piece_size if number < self.parts else self.total) - pos
            out.append((number, pos - start, n, pos - offset))
            pos += n
        return out


class SplitUpload(Upload):
    """:class:`~._s3.Upload` storing full parts as piece objects and the last part under the key (module doc).
    A blob that fits in one part is one plain PUT, as without the option."""

    def __init__(self, tier: S3Tier, key: str, path: str):
        super().__init__(tier, key, path)
        self.token = uuid.uuid4().hex[:12]
        self.publishing = False  # the key's own object was sent (its answer may have been lost)

    def _whole_parts(self, available: int) -> int:
        # the blob's last part must be held back for the key's object: never lend the final byte
        return max(0, available - 1) // self.part_size

    def _create(self) -> None:
        self.upload_id = self.token  # nothing to ask the store: pieces are plain objects

    async def _send_part(self, number: int, views: list[memoryview], checksum: dict[str, str]) -> dict[str, Any]:
        self.tasks.add(asyncio.current_task())  # first, before any await: _cancel_parts finds every part
        obj = piece_name(self.obj, self.token, number)

        def call() -> Awaitable[Any]:
            return self.tier.fs._call_s3("put_object", Bucket=self.bucket, Key=obj, Body=RequestBody(*views),
                                         **checksum)

        await self.tier.arequest(f"upload piece {number} of", self.key, self.path, call,
                                 nbytes=sum(map(len, views)), stop=self.stop)
        return {"PartNumber": number}

    def finish(self) -> int:
        if self.upload_id is None:  # one part: a plain object
            total = super().finish()
            self._drop_pieces(keep=None)
            return total
        last = self._take_gathered()[0] if self.fill else self.ready[0]
        while self.inflight:
            self._reap(block=True)
        split = Split(self.token, self.part_size, self.next_part, self.total)
        self.publishing = True
        self._put(last, metadata=split.encode())
        self.upload_id = None  # published: nothing left to abort
        self._drop_pieces(keep=self.token)
        return self.total

    def _abort(self, upload_id: str) -> None:
        """Remove this write's pieces, unless the key's object naming them landed after all (its PUT's answer was
        lost): the blob is then whole and stays. A piece whose request was cancelled may land after the first
        removal: looked for again after a pause, until a look finds none."""
        if self.publishing and self._published_as(upload_id):
            log.warning("tier %r: %s was stored whole although its last request failed; it stays",
                        self.tier.name, self.tier.redacted(self.path))
            return
        for look, pause in enumerate(ABORT_PAUSES_S):
            if not self._drop_pieces(only=upload_id) and look:
                return
            time.sleep(pause)

    def _published_as(self, token: str) -> bool:
        try:
            split = self.tier._split_of(self.tier._head(self.key, self.path), self.key)
        except Exception:  # noqa: BLE001 - gone, unreadable, or no answer: not ours
            return False
        return split is not None and split.token == token

    def _drop_pieces(self, keep: str | None = None, only: str | None = None) -> int:
        """Delete the key's pieces: all but those of token ``keep``, or only those of token ``only``; how many
        were found. Best effort: a piece left behind is hidden from listings and removed with its step directory."""
        try:
            return self.tier.run_sync(drop_pieces, self.tier, self.bucket, self.obj, keep, only)
        except Exception as exc:  # noqa: BLE001 - the blob itself is fine; say what stays
            log.warning("tier %r: could not remove pieces of %s: %s", self.tier.name,
                        self.tier.redacted(self.path), self.tier.redacted(str(exc)))
            return 0


async def piece_objects(tier: S3Tier, bucket: str, obj: str) -> list[str]:
    """Every piece object of the blob ``obj`` (of any write)."""
    return [o["Key"] for o in await tier.aobjects(f"list the pieces of {obj} in", bucket, obj + PIECE_MARK)
            if is_piece_name(o["Key"])]


async def drop_pieces(tier: S3Tier, bucket: str, obj: str, keep: str | None = None, only: str | None = None
                      ) -> int:
    """Delete the pieces of ``obj`` but those of token ``keep`` (or only those of token ``only``); how many."""
    doomed = []
    for name in await piece_objects(tier, bucket, obj):
        token = name[len(obj) + len(PIECE_MARK):].split("-", 1)[0]
        if (only is None and token != keep) or token == only:
            doomed.append(name)
    await tier.adelete_objects("delete the pieces of", f"{bucket}/{obj}", bucket, doomed)
    return len(doomed)
