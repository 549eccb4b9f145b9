"""Writes at known offsets into one file several processes share: the ``megatron`` layout's gather-free commit
(:mod:`tiered_ckpt.megatron.inplace`), where every DP rank writes its own byte ranges of Megatron's
``distrib_optim.pt`` and the committing rank the rest.

The ranges are not block-aligned (their offsets follow from Megatron's zip layout), and two neighbouring ranks
share the page where one's range ends and the next one's begins. So :meth:`PositionalFiles.write_range` writes
a range's whole pages with ``O_DIRECT`` (from the caller's memory when it is congruent with the file offset, else
through :class:`~._direct_io.DirectWriter`'s bounce buffers) and only the partial pages at its two edges through
the page cache, where neighbours' writes to the same page merge. A buffered write of hundreds of MiB per rank is
paced by the kernel's dirty-page throttling, with every rank of the node copying into the page cache at once; a
direct one is not. Before its first direct write, a rank reserves its pages (``fallocate``): a direct write into
allocated (unwritten) extents lets ext4 and XFS run the ranks' writes side by side instead of one at a time.

Each writer makes its own bytes durable (:meth:`~PositionalFiles.sync`: ``fdatasync``, which covers its direct
writes' block allocation and its page-cache edges) before it reports them, so the committing rank's own sync
covers only its few KiB. The file keeps a temporary name (``.{base}.tmp-{16 hex}``, see :mod:`._files`: listings
skip it, ``gc`` knows it) until :meth:`~PositionalFiles.rename` moves it into place.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

from ..retry import repeat_on
from ._direct_io import BLOCK, BOUNCE, DIRECT_MIN, DirectWriter
from ._files import _WRITE_MAX, BlobFiles, fsync_dir, make_dirs
from ._nofollow import check_dirs

log = logging.getLogger(__name__)

EDGE = max(BLOCK, mmap.PAGESIZE)  # writes of two processes meet in a page: it is only ever written buffered
PIECE = BOUNCE  # bytes hashed at a time, then copied into a bounce buffer while still in cache


@dataclass
class PositionalFile:
    """One open file: a descriptor through the page cache, and one with ``O_DIRECT`` (None where the filesystem
    refuses it, or the tier does not use it)."""

    key: str
    fd: int
    direct_fd: int | None


class PositionalFiles:
    """Opens, writes at offsets, syncs and renames files of a :class:`~._files.BlobFiles` tier."""

    def __init__(self, files: BlobFiles):
        self.files = files

    def open(self, key: str, size: int | None = None) -> PositionalFile:
        """Open ``key`` for writing at offsets, created if missing and never truncated (other processes write it
        too); ``size``: the file's final size, to which a shorter file is extended (sparse), so that no write
        extends it (an extending direct write is serialized with every other write of the file)."""
        f = self.files
        rel_dir = os.path.dirname(key)
        check_dirs(f.root, rel_dir, tier=f.tier, key=key)
        path = f.path(key)
        flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW

        def create() -> int:
            make_dirs(f.root, rel_dir, f.dir_mode)
            return os.open(path, flags | os.O_CREAT, f.file_mode)

        try:
            fd = repeat_on(FileNotFoundError, 2)(create)
        except OSError as exc:
            raise f.error(exc, key, "open", path) from exc
        try:
            if size is not None and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every writer extends it to the same size: none can cut another's bytes
            direct_fd = self._open_direct(path, flags) if f.direct_io else None
        except OSError as exc:
            os.close(fd)
            raise f.error(exc, key, "open", path) from exc
        return PositionalFile(key, fd, direct_fd)

    def _open_direct(self, path: str, flags: int) -> int | None:
        try:
            return os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.info("tier %r: %s does not take O_DIRECT; writing through the page cache", self.files.tier,
                     self.files.root)
            self.files.direct_io = False
            return None

    def pwrite(self, f: PositionalFile, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` through the page cache (small pieces: headers, descriptors, edges)."""
        try:
            while len(data):
                n = os.pwrite(f.fd, data[:_WRITE_MAX], offset)
                data, offset = data[n:], offset + n
        except OSError as exc:
            raise self.files.error(exc, f.key, "write", self.files.path(f.key)) from exc

    def write_range(self, f: PositionalFile, data: memoryview, offset: int, hasher: Any = None) -> None:
        """Write ``data`` at ``offset``: its whole pages with ``O_DIRECT`` when the file has a direct descriptor
        and the range is large, the partial pages at its edges (shared with neighbouring writers) buffered.
        ``hasher`` (``update``): fed the bytes in order, each piece right before it is copied out, while it is in
        cache, so hashing overlaps the device's writes."""
        end = offset + len(data)
        lo, hi = -(-offset // EDGE) * EDGE, end // EDGE * EDGE
        if f.direct_fd is None or hi - lo < DIRECT_MIN:
            if hasher is not None:
                hasher.update(data)
            self.pwrite(f, data, offset)
            return
        head, body, tail = data[:lo - offset], data[lo - offset:hi - offset], data[hi - offset:]
        if hasher is not None:
            hasher.update(head)
        self.pwrite(f, head, offset)
        with contextlib.suppress(OSError):  # an optimization only: writes without it are as correct
            os.posix_fallocate(f.direct_fd, lo, hi - lo)
        writer = DirectWriter(f.direct_fd, start=lo)
        try:
            for i in range(0, len(body), PIECE):
                piece = body[i:i + PIECE]
                if hasher is not None:
                    hasher.update(piece)
                writer.write(piece)
            writer.finish()
        except OSError as exc:
            raise self.files.error(exc, f.key, "write", self.files.path(f.key)) from exc
        finally:
            writer.close()
        if hasher is not None:
            hasher.update(tail)
        self.pwrite(f, tail, hi)

    def truncate(self, f: PositionalFile, size: int) -> None:
        try:
            os.ftruncate(f.fd, size)
        except OSError as exc:
            raise self.files.error(exc, f.key, "truncate", self.files.path(f.key)) from exc

    def sync(self, f: PositionalFile, *, data_only: bool = False) -> None:
        """Make what this process wrote durable (when the tier fsyncs): ``fdatasync`` with ``data_only`` (a
        rank's ranges: data, block allocation and size), else ``fsync``."""
        if self.files.fsync:
            try:
                (os.fdatasync if data_only else os.fsync)(f.fd)
            except OSError as exc:
                raise self.files.error(exc, f.key, "fsync", self.files.path(f.key)) from exc

    def close(self, f: PositionalFile) -> None:
        for fd in (f.fd, f.direct_fd):
            if fd is not None:
                os.close(fd)

    def rename(self, tmp_key: str, key: str) -> None:
        """``tmp_key`` (written and synced) replaces ``key``; then the directories are fsynced."""
        f = self.files
        final = f.path(key)
        f.rename_temp(f.path(tmp_key), final, key)
        if f.fsync:
            directory = os.path.dirname(final)
            try:
                fsync_dir(directory)
                fsync_dir(os.path.dirname(directory))  # the mp_rank directory may be new in the step's
            except OSError as exc:
                raise f.error(exc, key, "fsync the directory of", final) from exc
