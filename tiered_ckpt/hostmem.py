"""Fresh host memory, fast, and files read into it.

* :func:`populated_empty`: the kernel populates an anonymous mapping in one pass (MAP_POPULATE). Faulting fresh
  pages one by one from a copy runs at a fraction of memory bandwidth (measured here: a ``clone()`` of 1 GiB took
  1.1-3.5 s; MAP_POPULATE 0.35 s, then the copy at full speed).
* :func:`populating_empty`: the same, populated by a background thread while the caller already fills it from the
  start (an object store's event loop, which would otherwise fault every page in itself).
* :func:`read_file`: a whole file into fresh private memory with parallel ``preadv`` calls, hashed on the way.
  Populating first and reading after runs the two one after the other; letting the reads fault the pages in,
  on several threads, overlaps the faults with the disk and with each other (2 GiB from a cold page cache here:
  1.85 s populated + one ``readinto``, 1.3 s with 4 threads; ``torch.load`` of the same files 1.5-2.1 s). On a
  descriptor in ``O_DIRECT`` mode (``direct_block``) the disk reads straight into that memory, past the page
  cache: no copy out of the cache, no cache filled with a checkpoint read once (1 GiB from the development VM's
  disk, 7 runs alternating: buffered median 1.35 s and 1.25 s of CPU, direct 1.04-1.11 s and 0.55 s of CPU,
  the CPU left being the new memory's page faults).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
READ_PIECE = 32 << 20  # bytes per preadv call of read_file (a multiple of the page size)
READ_THREADS = 4  # preadv calls in flight: queue depth for the disk, page faults on more than one core
POPULATE_CHUNK = 32 << 20  # bytes per madvise of populating_empty's thread
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (madvise returns -1)
#: madvise(addr, length, advice) through ctypes (releases the GIL): this module's and memcopy.py's
madvise = ctypes.CDLL(None, use_errno=True).madvise
madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
madvise.restype = ctypes.c_int


class FileShrankError(Exception):
    """The file ended before the size it had when it was opened (it was truncated while being read)."""

    def __init__(self, got: int, size: int):
        super().__init__(f"the file ended at byte {got} of {size}")
        self.got, self.size = got, size


def populated_empty(nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor of ``nbytes`` whose pages are already present (contents: zeros)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive


def lazy_empty(nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor of ``nbytes`` in a fresh anonymous mapping whose pages appear on first touch (for a
    buffer that parallel reads fill: the faults then spread over the reading threads)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8)


def populating_empty(nbytes: int, chunk: int = POPULATE_CHUNK) -> torch.Tensor:
    """A writable uint8 tensor of ``nbytes`` in a fresh anonymous mapping that a background thread populates from
    its start, ``chunk`` bytes per ``madvise(MADV_POPULATE_WRITE)``, while the caller already fills it.

    For a buffer one thread fills as answers arrive (an object store's event loop): faulting each page in from
    that thread stalls every transfer in flight behind it. Measured on the development VM, 1 GiB of S3 split
    pieces from moto: 2.35-2.96 s into a plain fresh buffer, 1.62-1.82 s into one populated beforehand, and the
    population itself (0.5-0.6 s per GiB here) runs on another core, ahead of the transfers. Populating a page the
    caller already wrote leaves it as it is; where the kernel lacks ``MADV_POPULATE_WRITE`` (before 5.14) the
    thread stops and the pages fault in on first touch, as with :func:`lazy_empty`. Once the tensor is dropped (a
    read that failed) the thread stops at its next chunk."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive
    if nbytes > chunk:
        start, alive = out.data_ptr(), weakref.ref(out)

        def populate(mapping: mmap.mmap = mm) -> None:  # holds the mapping until done, whatever the caller drops
            for off in range(0, nbytes, chunk):
                if alive() is None:  # the reader failed and dropped the buffer: no more memory for it
                    return
                n = min(chunk, nbytes - off)
                if madvise(start + off, n + (-n) % mmap.PAGESIZE, MADV_POPULATE_WRITE) != 0:
                    return

        threading.Thread(target=populate, name="tiered_ckpt-populate", daemon=True).start()
    return out


def private_copy(data: torch.Tensor) -> torch.Tensor:
    """A copy of a 1-D uint8 host tensor in freshly populated memory."""
    out = populated_empty(data.numel())
    out.copy_(data)
    return out


def direct_mode(fd: int) -> bool:
    """Switch ``fd`` to ``O_DIRECT``; False where the filesystem refuses it (the descriptor stays as it was)."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return False
    return True


def buffered_io(fd: int) -> None:
    """Switch ``fd`` from direct to ordinary (page cache) I/O."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def read_file(fd: int, size: int, *, hasher: Any = None, piece: int = READ_PIECE,
              threads: int = READ_THREADS, direct_block: int | None = None) -> torch.Tensor:
    """The first ``size`` bytes of the open file ``fd`` in fresh private memory (a 1-D uint8 tensor).

    Pieces of ``piece`` bytes are read with ``preadv`` on up to ``threads`` threads (``preadv`` releases the GIL);
    ``hasher.update`` (if given) sees them in file order as they arrive, so the hash is ready with the last piece.
    ``direct_block``: ``fd`` is in ``O_DIRECT`` mode, whose reads must be aligned to this many bytes (``piece``
    is a multiple of it): the last read asks for the whole last block, into memory allocated for it. A read the
    filesystem refuses in that mode (``EINVAL``) switches ``fd`` back to the page cache and is made again.
    Raises ``OSError`` for a failed read and :class:`FileShrankError` if the file ends before ``size``.
    """
    room = size + (-size) % direct_block if direct_block else size
    whole = lazy_empty(room)  # page-aligned: O_DIRECT reads go straight into it
    out = whole[:size]
    if size == 0:
        return out
    view = memoryview(whole.numpy())
    switch = threading.Lock()

    def read_piece(start: int) -> None:
        end = min(size, start + piece)
        retried = False
        while start < end:
            stop = min(room, end + (-end) % direct_block) if direct_block else end  # whole blocks
            try:
                n = os.preadv(fd, [view[start:stop]], start)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not direct_block or retried:
                    raise
                retried = True  # the filesystem took the open but not the read: again, through the page cache
                with switch:
                    buffered_io(fd)
                continue
            if n == 0:
                raise FileShrankError(start, size)
            start += n

    starts = range(0, size, piece)
    if len(starts) == 1 or threads <= 1:
        for start in starts:
            read_piece(start)
            if hasher is not None:
                hasher.update(view[start:min(size, start + piece)])
        return out
    with ThreadPoolExecutor(min(threads, len(starts)), thread_name_prefix="tiered_ckpt-read") as pool:
        futures = [pool.submit(read_piece, s) for s in starts]
        try:
            for start, fut in zip(starts, futures, strict=True):
                fut.result()
                if hasher is not None:
                    hasher.update(view[start:min(size, start + piece)])
        except BaseException:
            for fut in futures:
                fut.cancel()  # the pool's exit still waits for the reads already running
            raise
    return out
