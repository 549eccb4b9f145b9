"""Host-memory copies on every core torch uses, and fresh memory that is fast to fill.

A single ``Tensor.copy_`` may or may not spread over torch's intra-op threads; on the 2-core development VM it
often did not, and a snapshot copy ran at half the machine's bandwidth. :func:`copy_spans` takes the byte
ranges to move, cuts them into pieces (about eight per thread, at least :data:`PIECE_MIN`) and moves them with
:func:`move` (streaming stores where the C helper ``_streamcopy`` is built, else glibc's ``memmove`` through
ctypes; both release the GIL) on ``torch.get_num_threads()`` threads of a small persistent pool, the calling
thread among them, each taking the next piece as it finishes one: a core that another process holds for a while
then costs the copy a piece's time, not a whole share's (the save's tail latency on a busy
machine). Spans that are neighbours in both memories (parameters that are views of one flat buffer) are moved
as one (:func:`coalesce`). The pool is made on first use and made again in a forked child.

:func:`fresh_buffer`: anonymous memory for a restore's copy, populated before the copy in one call (a copy
into untouched pages faults each of them in turn, slower than populating them at once); huge pages only on
request (:data:`HUGE_PAGES`).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from .checksum import LazyPool
from .hostmem import MADV_POPULATE_WRITE, madvise

try:  # built by the package's install where a C compiler is found (setup.py: optional)
    from ._streamcopy import STREAMING as _HAS_STREAMING
    from ._streamcopy import copy as _stream_copy
    from ._streamcopy import copy_many as _copy_many
except ImportError:  # pragma: no cover - an install without a compiler
    _HAS_STREAMING, _stream_copy, _copy_many = False, None, None

Span = tuple[int, int, int]  # (destination address, source address, bytes)
T = TypeVar("T")
R = TypeVar("R")

#: Ask for transparent huge pages in :func:`fresh_buffer`. Off: on the development VM (a Firecracker guest) the
#: first huge-page allocation of 1 GiB in a process took 2.4-4.8 s against 0.7-0.9 s for 4 KiB pages (later ones
#: 0.1-0.17 s against 0.7-0.9 s), and a restore is usually a process's first and only one. Worth measuring again
#: on bare metal.
HUGE_PAGES = False
SPLIT_MIN = 4 << 20  # bytes below which a copy stays on the calling thread (a hand-off costs more than it saves)
PIECE_MIN = 8 << 20  # the smallest piece a thread takes at a time
PIECES_PER_THREAD = 8
#: Copies of at least this many bytes go with streaming stores (:func:`move`). A smaller one is left to memmove:
#: its fence and call cost more than the cache lines it keeps out of the cache.
STREAM_MIN = 64 << 10
#: Whether :func:`move` streams (x86-64 with the C helper built). Tests and benchmarks turn it off to compare.
STREAMING = bool(_HAS_STREAMING)
HUGE = 2 << 20  # the transparent huge page size fresh buffers are aligned to
_MADV_HUGEPAGE = 14

_POOL = LazyPool(max(1, (os.cpu_count() or 1) - 1), "tiered_ckpt-copy")


def threads() -> int:
    """How many threads a copy uses: torch's intra-op thread count (a drain worker sets it to 1)."""
    return max(1, torch.get_num_threads())


def move(dst: int, src: int, n: int) -> None:
    """Move ``n`` bytes from address ``src`` to ``dst`` (host memory; overlapping ranges as ``memmove`` would),
    without holding the GIL.

    A copy of :data:`STREAM_MIN` bytes or more writes with streaming (non-temporal) stores: a snapshot's bytes
    are not read back soon, and an ordinary store first reads every destination line into the cache (measured on
    the 2-core development VM, 1 GiB on two threads in 1 MiB pieces: 0.064-0.067 s streamed against 0.10-0.15 s
    with memmove, whose own streaming starts only at 192 MiB there). The C helper streams four destination pages
    side by side, a cache line of each in turn (in one process, alternating: 0.070 s against 0.088 s for a 1 GiB
    warm save into shm, line after line). docs/architecture.md, "The data path of a save"."""
    if STREAMING and n >= STREAM_MIN:
        _stream_copy(dst, src, n)
    else:
        ctypes.memmove(dst, src, n)


def move_all(spans: Sequence[Span]) -> None:
    """:func:`move` of each span, in one call to the C helper where it is built: thousands of small tensors
    (a model without the distributed optimizer) cost one hand-off of the GIL, not one each."""
    if _copy_many is not None and len(spans) > 1:
        _copy_many(array.array("Q", itertools.chain.from_iterable(spans)), STREAM_MIN if STREAMING else -1)
    else:
        for dst, src, n in spans:
            move(dst, src, n)



def run_shares(fn: Callable[[T], object], shares: Sequence[T]) -> list[object]:
    """``fn`` of each share, the first on the calling thread and the others on the pool; their results in order.
    Every share has finished when this returns or raises (the first error is raised)."""
    if len(shares) <= 1:
        return [fn(s) for s in shares]
    pool = _POOL.get()
    futures: list[Future] = [pool.submit(fn, s) for s in shares[1:]]
    try:
        first = fn(shares[0])
    finally:
        errors = [f.exception() for f in futures]  # waits for each: no share outlives the call
    for exc in errors:
        if exc is not None:
            raise exc
    return [first, *(f.result() for f in futures)]


def parallel_map(fn: Callable[[T], R], items: Sequence[T], nthreads: int | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on ``nthreads`` threads (default :func:`threads`; the calling thread is one),
    each taking the next item as it finishes one, so uneven items still spread evenly."""
    n = min(len(items), threads() if nthreads is None else max(1, nthreads))
    if n <= 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    lock = threading.Lock()
    nxt = iter(range(len(items)))

    def worker(_: int) -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            results[i] = fn(items[i])

    run_shares(worker, range(n))
    return results


def pieces(spans: Iterable[Span], size: int) -> list[list[Span]]:
    """``spans`` in order, gathered into pieces of ``size`` bytes (the last one shorter): a span longer than what
    is left of a piece is cut at its edge, many short ones share one piece (one hand-off for all of them)."""
    out: list[list[Span]] = [[]]
    used = 0
    for dst, src, n in spans:
        while n:
            if used == size:
                out.append([])
                used = 0
            k = min(n, size - used)
            out[-1].append((dst, src, k))
            dst, src, n, used = dst + k, src + k, n - k, used + k
    return [p for p in out if p]


def coalesce(spans: Iterable[Span]) -> list[Span]:
    """``spans`` with each run of neighbours in both memories (a tensor starting where the previous one ended,
    in the source and in the destination: parameters that are views of one flat buffer) merged into one."""
    out: list[Span] = []
    for dst, src, n in spans:
        if out:
            d0, s0, n0 = out[-1]
            if d0 + n0 == dst and s0 + n0 == src:
                out[-1] = (d0, s0, n0 + n)
                continue
        out.append((dst, src, n))
    return out


def split_spans(spans: Iterable[Span], nthreads: int) -> list[list[Span]]:
    """The pieces :func:`copy_pieces` hands ``nthreads`` threads for ``spans`` (one piece: stay on the caller).
    A caller that copies the same spans again keeps them (a snapshot of thousands of tensors, every save)."""
    spans = coalesce(spans)
    total = sum(n for _, _, n in spans)
    if total < SPLIT_MIN or nthreads <= 1:
        return [spans]
    return pieces(spans, max(PIECE_MIN, -(-total // (nthreads * PIECES_PER_THREAD))))


def copy_pieces(parts: Sequence[Sequence[Span]], nthreads: int | None = None) -> None:
    """Move the spans of every piece (:func:`split_spans`), each thread taking the next piece as it finishes one."""
    if len(parts) == 1:
        move_all(parts[0])
    else:
        parallel_map(move_all, parts, threads() if nthreads is None else max(1, nthreads))


def copy_spans(spans: Iterable[Span], nthreads: int | None = None) -> None:
    """Move every span's bytes (non-overlapping host memory that stays alive for the call) on ``nthreads``
    threads (default :func:`threads`), each taking the next piece as it finishes one (module docstring)."""
    n = threads() if nthreads is None else max(1, nthreads)
    copy_pieces(split_spans(spans, n), n)


def copy_tensors(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], nthreads: int | None = None) -> None:
    """``dst.copy_(src)`` for each (src, dst) pair: bytewise on every core where both are contiguous CPU tensors
    of the same dtype and shape whose bytes are their values (no conjugate or negative bit), ``copy_`` for the
    rest (after the others)."""
    spans: list[Span] = []
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    for src, dst in pairs:
        if bytewise(src, dst):
            if src.numel():
                spans.append((dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()))
        else:
            rest.append((src, dst))
    copy_spans(spans, nthreads)
    if rest:
        with torch.no_grad():
            for src, dst in rest:
                dst.copy_(src)


def plain_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are exactly its bytes in host memory, one run of them (contiguous, strided, CPU,
    no conjugate or negative bit, not quantized)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and not t.is_quantized)


def bytewise(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` is a plain move of ``src``'s bytes into ``dst``'s."""
    return src.dtype == dst.dtype and src.shape == dst.shape and plain_bytes(src) and plain_bytes(dst)


def fresh_buffer(nbytes: int) -> torch.Tensor:
    """A writable 1-D uint8 tensor of ``nbytes`` in fresh private memory whose pages are already present (zeros).

    The mapping is aligned to :data:`HUGE` and, with :data:`HUGE_PAGES`, asks for transparent huge pages (a no-op
    where the kernel's policy is ``never``); it is populated in one ``madvise`` (where the kernel lacks
    ``MADV_POPULATE_WRITE``: every page touched once). The tensor keeps the mapping alive.

    Raises :class:`MemoryError` when the host cannot give the memory: the mapping refused, or the population
    failing for lack of memory. Only a kernel without the advice (``EINVAL``) falls back to touching the pages,
    since touching them when memory is short would wake the OOM killer instead of raising."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    try:
        mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise MemoryError(f"the host refused {_gib(nbytes)} of fresh memory ({exc.strerror})") from exc
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    skip = (-whole.data_ptr()) % HUGE
    out = whole[skip:skip + nbytes]
    start = out.data_ptr()
    length = nbytes + (-nbytes) % mmap.PAGESIZE
    if HUGE_PAGES and nbytes >= HUGE:
        madvise(start, length - length % HUGE, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    if madvise(start, length, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # ENOMEM, EFAULT, EINTR: the memory is not there; say so, do not touch it
            del out, whole
            with contextlib.suppress(BufferError):  # unmapped now, not when the traceback lets go of this frame
                mm.close()
            raise MemoryError(f"could not populate {_gib(nbytes)} of fresh host memory: {os.strerror(err)}")
        out[::mmap.PAGESIZE].zero_()  # a kernel before 5.14: a write per page faults each in
    return out


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"
