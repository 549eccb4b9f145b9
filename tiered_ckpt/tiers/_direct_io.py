"""Writing a file with ``O_DIRECT``: bytes go from the caller's buffers to the device, past the page cache.

Why: a buffered write of gigabytes is paced by the kernel's dirty-page throttling (``balance_dirty_pages``) at a
rate that changes from one save to the next, and ``fsync`` then flushes all of it. On the development VM a 2 GiB
write + fsync took 0.8-5.8 s buffered and 1.1-1.2 s with ``O_DIRECT`` (``benchmarks/README.md``). Direct writes
also keep checkpoints out of the page cache, where they would evict the training job's own data.

``O_DIRECT`` needs the file offset, the length and the memory address of every write aligned to the device's
logical block size (``BLOCK`` covers every device we meet). A large piece whose memory address is congruent to
its file offset modulo the block is written from its own memory, no copy (the flat and torch codecs lay their
files out so that tensors are); everything else is copied into one of two page-aligned bounce buffers, and a
helper thread writes one while the other fills. When the caller promises that its memory stays as it is until
the file is finished (a stream of a snapshot's views, ``stable``), a piece written from its own memory is left
running while the caller makes the next one, on threads of its own: the disk is not idle between pieces (on
the development VM, the drain of a 2 GiB Megatron rank to ``local``, saves alternating between the two ways:
median 0.711 s with each piece waited for, 0.678 s with one left running, against a 0.60 s ``O_DIRECT`` write
+ fsync of the same bytes; ``benchmarks/README.md``). The last partial block is written after ``O_DIRECT`` is
switched off on the descriptor, so files keep their exact size. A filesystem that refuses direct I/O (tmpfs,
some FUSE mounts) is handled by the caller at ``open``; one that refuses it only at write time (``EINVAL``) gets
the rest of the file written buffered.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..hostmem import buffered_io
from .base import IO_BLOCK

BLOCK = IO_BLOCK
BOUNCE = 4 << 20  # bytes per bounce buffer: two of them, so 8 MiB of host memory while a file is written
DIRECT_MIN = 1 << 20  # a list of chunks smaller than this (a manifest, a tracker) is written the ordinary way
_ZERO_COPY_MIN = 1 << 20  # a smaller aligned piece goes through the bounce buffer: not worth a separate write
_WRITE_MAX = 1 << 30  # Linux caps one write at 2 GiB - 4 KiB
#: Writes from the caller's own (stable) memory left running when :meth:`DirectWriter.write` returns: one keeps
#: the disk busy while the caller makes the next piece; more only add requests that wait in the device's queue.
AHEAD = 1


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


class DirectWriter:
    """Writes a stream of memoryviews to ``fd`` (opened with ``O_DIRECT``) from offset ``start`` (0, or a
    multiple of ``BLOCK``); call :meth:`finish`. ``stable``: the memory of every view given stays valid and
    unchanged until :meth:`finish` or :meth:`close` returns (:class:`~.base.StableChunks`), so a write from it
    may still run when :meth:`write` returns."""

    def __init__(self, fd: int, start: int = 0, *, stable: bool = False):
        if start % BLOCK:
            raise ValueError(f"a direct write starts at a multiple of {BLOCK}, not at {start}")
        self.fd = fd
        self.pos = start  # file offset of the next block-aligned write
        self.direct = True
        self._switch = threading.Lock()
        self._maps = [mmap.mmap(-1, BOUNCE) for _ in range(2)]
        self._views = [memoryview(m) for m in self._maps]
        self._pending: list[Future | None] = [None, None]
        self._cur, self._fill = 0, 0
        self._pool: ThreadPoolExecutor | None = None  # writes the bounce buffers
        self._in_place_pool: ThreadPoolExecutor | None = None  # writes from the caller's memory, when stable
        self._stable = stable
        self._running: collections.deque[Future] = collections.deque()  # writes from the caller's memory

    # ----- writing -----------------------------------------------------------------------------------------
    def write(self, mv: memoryview) -> None:
        if self._running and self._running[0].done():
            self._running.popleft().result()  # a write left running failed: say so now, not at finish()
        while len(mv):
            if self.direct and len(mv) >= _ZERO_COPY_MIN:
                address = _address(mv)
                if (self._fill - address) % BLOCK == 0:  # file offset and memory congruent: self.pos is aligned
                    head = (-address) % BLOCK
                    self._copy(mv[:head])  # completes the bounce buffer's last block
                    self._submit()  # what the bounce buffer holds goes first, at its own offset
                    mv = mv[head:]
                    n = min(len(mv) // BLOCK * BLOCK, _WRITE_MAX)
                    self._write_in_place(mv[:n])
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
            while self._running:
                self._running.popleft().result()
            if tail:
                self._buffered()
                self._pwrite_all(memoryview(tail), self.pos)
                self.pos += len(tail)
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the helper (its errors are dropped: this is the error path) and free the buffers."""
        for pool in (self._pool, self._in_place_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._in_place_pool = None
        self._pending = [None, None]
        self._running.clear()
        views, maps, self._views, self._maps = self._views, self._maps, [], []
        for v in views:
            with contextlib.suppress(BufferError):
                v.release()
        for m in maps:
            # An error's traceback may still hold a slice of a buffer: then the mapping goes with the traceback.
            with contextlib.suppress(BufferError):
                m.close()

    # ----- internals ---------------------------------------------------------------------------------------
    def _helper(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-direct")
        return self._pool

    def _write_in_place(self, mv: memoryview) -> None:
        """Write ``mv`` (whole blocks, congruent) at ``self.pos`` from its own memory: at once, or, when the
        caller's memory is stable, on the helper, waiting only for the writes beyond :data:`AHEAD`."""
        if not self._stable:
            self._pwrite_all(mv, self.pos)
            return
        if self._in_place_pool is None:
            # Threads of their own: a small bounce-buffer write waiting in the device's queue behind a large one
            # must not hold back the next large one.
            self._in_place_pool = ThreadPoolExecutor(AHEAD + 1, thread_name_prefix="tiered_ckpt-direct-in-place")
        self._running.append(self._in_place_pool.submit(self._pwrite_all, mv, self.pos))
        while len(self._running) > AHEAD:
            self._running.popleft().result()  # re-raises the helper's OSError here

    def _submit(self) -> None:
        """Hand the current bounce buffer (a whole number of blocks) to the helper; switch to the other one."""
        if not self._fill:
            return
        i, n, pos = self._cur, self._fill, self.pos
        self._pending[i] = self._helper().submit(self._pwrite_all, self._views[i][:n], pos)
        self.pos += n
        self._cur, self._fill = 1 - i, 0

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()  # re-raises the helper's OSError here, in the writer's thread

    def _pwrite_all(self, mv: memoryview, pos: int) -> None:
        while len(mv):
            direct = self.direct  # (another write running on the helper may switch it meanwhile)
            try:
                n = os.pwrite(self.fd, mv[:_WRITE_MAX], pos)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not direct:
                    raise
                self._buffered()  # the filesystem took the open but not the I/O: write the rest through the cache
                continue
            if n <= 0:  # pragma: no cover - a regular file never returns 0 for a non-empty write
                raise OSError(errno.EIO, "write returned 0")
            mv, pos = mv[n:], pos + n

    def _buffered(self) -> None:
        with self._switch:
            if self.direct:
                buffered_io(self.fd)
                self.direct = False


