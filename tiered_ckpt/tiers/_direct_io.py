"""Writing a file with ``O_DIRECT``: bytes go from the caller's buffers to the device, past the page cache.

Why: a buffered write of gigabytes is paced by the kernel's dirty-page throttling (``balance_dirty_pages``) at a
rate that changes from one save to the next, and ``fsync`` then flushes all of it. On the development VM a 2 GiB
write + fsync took 0.8-5.8 s buffered and 1.1-1.2 s with ``O_DIRECT`` (``benchmarks/README.md``). Direct writes
also keep checkpoints out of the page cache, where they would evict the training job's own data.

``O_DIRECT`` needs the file offset, the length and the memory address of every write aligned to the device's
logical block size (``BLOCK`` covers every device we meet). A large piece whose memory address is congruent to
its file offset modulo the block is written from its own memory, no copy (the flat and torch codecs lay their
files out so that tensors are); everything else is copied into one of two page-aligned bounce buffers, and a
helper thread writes one while the other fills. The last partial block is written after ``O_DIRECT`` is
switched off on the descriptor, so files keep their exact size. A filesystem that refuses direct I/O (tmpfs,
some FUSE mounts) is handled by the caller at ``open``; one that refuses it only at write time (``EINVAL``) gets
the rest of the file written buffered.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .base import IO_BLOCK

BLOCK = IO_BLOCK
BOUNCE = 4 << 20  # bytes per bounce buffer: two of them, so 8 MiB of host memory while a file is written
DIRECT_MIN = 1 << 20  # a list of chunks smaller than this (a manifest, a tracker) is written the ordinary way
_ZERO_COPY_MIN = 1 << 20  # a smaller aligned piece goes through the bounce buffer: not worth a separate write
_WRITE_MAX = 1 << 30  # Linux caps one write at 2 GiB - 4 KiB


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


class DirectWriter:
    """Writes a stream of memoryviews to ``fd`` (opened with ``O_DIRECT``) from offset ``start`` (0, or a
    multiple of ``BLOCK``); call :meth:`finish`."""

    def __init__(self, fd: int, start: int = 0):
        if start % BLOCK:
            raise ValueError(f"a direct write starts at a multiple of {BLOCK}, not at {start}")
        self.fd = fd
        self.pos = start  # file offset of the next block-aligned write
        self.direct = True
        self._maps = [mmap.mmap(-1, BOUNCE) for _ in range(2)]
        self._views = [memoryview(m) for m in self._maps]
        self._pending: list[Future | None] = [None, None]
        self._cur, self._fill = 0, 0
        self._pool: ThreadPoolExecutor | None = None

    # ----- writing -----------------------------------------------------------------------------------------
    def write(self, mv: memoryview) -> None:
        while len(mv):
            if self.direct and len(mv) >= _ZERO_COPY_MIN:
                address = _address(mv)
                if (self._fill - address) % BLOCK == 0:  # file offset and memory congruent: self.pos is aligned
                    head = (-address) % BLOCK
                    self._copy(mv[:head])  # completes the bounce buffer's last block
                    self._submit()  # what the bounce buffer holds goes first, at its own offset
                    mv = mv[head:]
                    n = min(len(mv) // BLOCK * BLOCK, _WRITE_MAX)
                    self._pwrite_all(mv[:n], self.pos)
                    self.pos += n
                    mv = mv[n:]
                    continue
            self._copy(mv[:BOUNCE])
            mv = mv[BOUNCE:]

    def _copy(self, mv: memoryview) -> None:
        """Append ``mv`` to the bounce buffers, handing each full one to the helper."""
        while len(mv):
            if self._fill == 0:
                self._wait(self._cur)  # the helper may still be writing this buffer
            take = min(BOUNCE - self._fill, len(mv))
            self._views[self._cur][self._fill:self._fill + take] = mv[:take]
            self._fill += take
            mv = mv[take:]
            if self._fill == BOUNCE:
                self._submit()

    def finish(self) -> None:
        """Write what is buffered (the tail without ``O_DIRECT``) and wait for every write; frees the buffers."""
        try:
            full = self._fill // BLOCK * BLOCK
            tail = bytes(self._views[self._cur][full:self._fill])
            self._fill = full
            self._submit()
            for i in (0, 1):
                self._wait(i)
            if tail:
                self._buffered()
                self._pwrite_all(memoryview(tail), self.pos)
                self.pos += len(tail)
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the helper (its errors are dropped: this is the error path) and free the buffers."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending = [None, None]
        views, maps, self._views, self._maps = self._views, self._maps, [], []
        for v in views:
            with contextlib.suppress(BufferError):
                v.release()
        for m in maps:
            # An error's traceback may still hold a slice of a buffer: then the mapping goes with the traceback.
            with contextlib.suppress(BufferError):
                m.close()

    # ----- internals ---------------------------------------------------------------------------------------
    def _submit(self) -> None:
        """Hand the current bounce buffer (a whole number of blocks) to the helper; switch to the other one."""
        if not self._fill:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-direct")
        i, n, pos = self._cur, self._fill, self.pos
        self._pending[i] = self._pool.submit(self._pwrite_all, self._views[i][:n], pos)
        self.pos += n
        self._cur, self._fill = 1 - i, 0

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()  # re-raises the helper's OSError here, in the writer's thread

    def _pwrite_all(self, mv: memoryview, pos: int) -> None:
        while len(mv):
            try:
                n = os.pwrite(self.fd, mv[:_WRITE_MAX], pos)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                self._buffered()  # the filesystem took the open but not the I/O: write the rest through the cache
                continue
            if n <= 0:  # pragma: no cover - a regular file never returns 0 for a non-empty write
                raise OSError(errno.EIO, "write returned 0")
            mv, pos = mv[n:], pos + n

    def _buffered(self) -> None:
        if self.direct:
            self.direct = False
            buffered_io(self.fd)


def buffered_io(fd: int) -> None:
    """Switch ``fd`` from direct to ordinary (page cache) I/O."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
