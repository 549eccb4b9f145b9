"""This machine's limits, measured on the same bytes the benchmarks move: the ceilings every ratio is taken against.

* ``copy``: ``Tensor.copy_`` into pre-faulted memory (a /dev/shm mapping written once before timing);
  ``ParallelCopy`` adds the all-core variants (the bytes split over ``torch.get_num_threads()`` threads, each a
  plain ``memmove`` with the GIL released, or the same with streaming stores); the physical ceiling is whichever
  way is fastest;
* ``write_fsync``: ``os.write`` of the bytes to a new file on the benchmark's disk directory, then ``fsync``
  (through the page cache); ``direct_write_fsync``: the same with ``O_DIRECT`` from one aligned buffer, the
  physical ceiling of a durable write;
* ``read``: reading that file back after dropping it from the page cache where possible (``posix_fadvise``);
  ``direct_read``: the same with ``O_DIRECT`` into one aligned buffer, the physical ceiling of a cold read.

The direct I/O functions take ``threads``: how many requests are in flight at once (each thread moves its own
contiguous range in 64 MiB requests). A disk may need more than one to reach its bandwidth; ``best_io_threads``
measures which count is faster.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

try:  # tiered_ckpt's streaming-store copy (built with the package where a C compiler is found; a peer's process
    # imports it from the checkout: peers/_common.py puts the repository first on its path)
    from tiered_ckpt._streamcopy import STREAMING as _STREAMING
    from tiered_ckpt._streamcopy import copy as _stream_copy
except ImportError:
    _STREAMING, _stream_copy = False, None

#: The ways a copy ceiling is measured (``ParallelCopy``): every one the machine has.
COPY_WAYS = ("single", "threaded", "streaming") if _STREAMING else ("single", "threaded")

IO_CHUNK = 64 << 20  # bytes per direct I/O request
ALIGN = 4096  # O_DIRECT: offsets, lengths and addresses aligned to the logical block (4 KiB covers every disk)
RING = 256 << 20  # the most memory a direct I/O ceiling takes: larger files cycle through this buffer


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def prefaulted_shm(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A shared-memory buffer of ``nbytes``, every page touched. Its file is removed at once (the mapping keeps
    the memory until the last tensor over it goes), so a run that fails leaves nothing in /dev/shm."""
    root = tempfile.mkdtemp(prefix="tiered_ckpt_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(root, "buf")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
        os.rmdir(root)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.fill_(0)
    return mm, buf


def copy_seconds(tensors: list[torch.Tensor], repeats: int = 5) -> float:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    mm, buf = prefaulted_shm(nbytes)
    try:
        views, off = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            views.append(buf[off:off + n].view(t.dtype).view(t.shape))
            off += n
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for v, t in zip(views, tensors, strict=True):
                v.copy_(t)
            times.append(time.perf_counter() - t0)
        return _median(times)
    finally:
        del views, buf
        mm.close()


def write_fsync_seconds(tensors: list[torch.Tensor], directory: str, repeats: int = 3) -> float:
    times = []
    for i in range(repeats):
        path = os.path.join(directory, f"raw_{i}.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for t in tensors:
                mv = memoryview(t.contiguous().view(torch.uint8).numpy())
                while mv:
                    mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t0)
        os.unlink(path)
    return _median(times)


def aligned_copy(tensors: list[torch.Tensor], ring: int = RING) -> tuple[mmap.mmap, int, int]:
    """The tensors' first ``ring`` bytes in one page-aligned anonymous mapping: (mapping, file size rounded up
    to ``ALIGN``, payload bytes). Filled before any clock starts, so direct I/O moves it with no copy; a larger
    file is written by cycling through it (the disk sees the same number of bytes; the tensors' values are
    incompressible anyway, and memory stays bounded on a shared machine)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    size = max(ALIGN, nbytes + (-nbytes) % ALIGN)
    buf = mmap.mmap(-1, min(size, ring))
    view, pos = memoryview(buf), 0
    for t in tensors:
        if pos >= len(view):
            break
        mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())[:len(view) - pos]
        view[pos:pos + len(mv)] = mv
        pos += len(mv)
    view.release()
    return buf, size, nbytes


def _ranges(size: int, threads: int) -> list[tuple[int, int]]:
    """``size`` bytes split into ``threads`` contiguous, ``ALIGN``-aligned ranges (start, end)."""
    per = -(-size // threads)
    per += (-per) % ALIGN
    return [(a, min(size, a + per)) for a in range(0, size, per)]


def _direct_open(path: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        raise OSError(exc.errno, f"{path}: O_DIRECT refused ({exc.strerror}); run the benchmark with --dir on a "
                                 "disk filesystem (ext4, xfs), not tmpfs or an overlay that lacks direct I/O") from exc


def _pio(fd: int, view: memoryview, start: int, end: int, write: bool) -> None:
    """File bytes [start, end) from / into ``view`` (a ring: file offset ``off`` is ``view[off % len]``)."""
    off = start
    while off < end:
        at = off % len(view)
        piece = view[at:at + min(end - off, IO_CHUNK, len(view) - at)]
        n = os.pwrite(fd, piece, off) if write else os.preadv(fd, [piece], off)
        if n <= 0:
            raise OSError(f"short direct {'write' if write else 'read'} at offset {off}")
        off += n


def _parallel_io(fd: int, view: memoryview, size: int, threads: int, write: bool) -> None:
    if threads <= 1:
        _pio(fd, view, 0, size, write)
        return
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(_pio, fd, view, a, b, write) for a, b in _ranges(size, threads)]:
            f.result()


class DirectIO:
    """The ``O_DIRECT`` ceilings for the tensors' bytes, with the aligned buffer (``aligned_copy``) made once, so
    that timing them many times, next to a candidate, allocates nothing more (its memory is the candidate's
    baseline, not the candidate's)."""

    def __init__(self, tensors: list[torch.Tensor], directory: str, ring: int = RING):
        self.buf, self.size, self.nbytes = aligned_copy(tensors, ring)
        self.view = memoryview(self.buf)
        self.directory = directory
        self._read_path: str | None = None

    def write_fsync(self, threads: int = 1) -> float:
        """Seconds to write + fsync a new file of the tensors' size, ``threads`` requests in flight."""
        path = os.path.join(self.directory, "raw_direct.bin")
        t0 = time.perf_counter()
        fd = _direct_open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            _parallel_io(fd, self.view, self.size, threads, write=True)
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - t0
        os.unlink(path)
        return seconds

    def read(self, threads: int = 1) -> float:
        """Seconds to read a file of the tensors' size (written once, untimed), ``threads`` requests in flight.
        It is read into the buffer it was written from, at the same ring offsets: the bytes do not change."""
        if self._read_path is None:
            self._read_path = os.path.join(self.directory, "raw_direct_read.bin")
            fd = _direct_open(self._read_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                _parallel_io(fd, self.view, self.size, 1, write=True)
                os.fsync(fd)
            finally:
                os.close(fd)
        t0 = time.perf_counter()
        fd = _direct_open(self._read_path, os.O_RDONLY)
        try:
            _parallel_io(fd, self.view, self.size, threads, write=False)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def best_threads(self, choices: tuple[int, ...] = (1, 4), repeats: int = 3) -> dict[str, object]:
        """Which count of requests in flight is faster on this disk, for writes and for reads (median of
        ``repeats`` each, alternating): {"write": n, "read": n, "write_s": {n: s}, "read_s": {n: s}}."""
        w: dict[int, list[float]] = {n: [] for n in choices}
        r: dict[int, list[float]] = {n: [] for n in choices}
        for _ in range(repeats):
            for n in choices:
                w[n].append(self.write_fsync(n))
                r[n].append(self.read(n))
        write_s, read_s = {n: _median(v) for n, v in w.items()}, {n: _median(v) for n, v in r.items()}
        return {"write": min(write_s, key=write_s.__getitem__), "read": min(read_s, key=read_s.__getitem__),
                "write_s": write_s, "read_s": read_s}

    def close(self) -> None:
        if self._read_path is not None and os.path.exists(self._read_path):
            os.unlink(self._read_path)
        self.view.release()
        self.buf.close()


def direct_write_fsync_seconds(tensors: list[torch.Tensor], directory: str, repeats: int = 3,
                               threads: int = 1) -> float:
    """Write + fsync of the tensors' bytes with ``O_DIRECT`` (``DirectIO.write_fsync``), median of ``repeats``:
    from one page-aligned buffer in 64 MiB writes (the best case for direct I/O: no copies, no bounce buffers),
    ``threads`` writes in flight, a new file each time (as a checkpoint's is)."""
    d = DirectIO(tensors, directory)
    try:
        return _median([d.write_fsync(threads) for _ in range(repeats)])
    finally:
        d.close()


def direct_read_seconds(nbytes: int, directory: str, repeats: int = 3, threads: int = 1) -> float:
    """Read of ``nbytes`` with ``O_DIRECT`` (``DirectIO.read``), median of ``repeats``: the disk's cold-read
    ceiling (no page cache on either side, so nothing needs dropping)."""
    d = DirectIO([torch.empty(nbytes, dtype=torch.uint8)], directory)
    try:
        return _median([d.read(threads) for _ in range(repeats)])
    finally:
        d.close()


def best_io_threads(tensors: list[torch.Tensor], directory: str, choices: tuple[int, ...] = (1, 4),
                    repeats: int = 3) -> dict[str, object]:
    """``DirectIO.best_threads`` for the tensors' bytes."""
    d = DirectIO(tensors, directory)
    try:
        return d.best_threads(choices, repeats)
    finally:
        d.close()


def read_seconds(nbytes: int, directory: str, repeats: int = 3) -> float:
    path = os.path.join(directory, "raw_read.bin")
    with open(path, "wb") as f:
        chunk = b"\x01" * (64 << 20)
        left = nbytes
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    times = []
    buf = bytearray(nbytes)
    for _ in range(repeats):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            mv, got = memoryview(buf), 0
            while got < nbytes:
                n = os.readv(fd, [mv[got:]])
                if n == 0:
                    break
                got += n
            times.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    os.unlink(path)
    return _median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ----- the all-core copy ------------------------------------------------------------------------------------------
class ParallelCopy:
    """Copies a list of (source, destination) byte tensors every way of :data:`COPY_WAYS`, to find the copy ceiling:

    * ``single()``: one ``Tensor.copy_`` per pair, as a plain loop would (torch may already spread a large copy
      over its intra-op threads);
    * ``threaded()``: the same bytes split into ``threads`` equal contiguous ranges (default
      ``torch.get_num_threads()``), each moved by ``ctypes.memmove`` on a thread of its own (ctypes releases the
      GIL), so every core torch uses copies at once whatever torch does inside ``copy_``;
    * ``streaming()``: the same ranges on the same threads moved with streaming (non-temporal) stores, which write
      around the caches and so skip the read of every destination line an ordinary store makes first (x86-64;
      glibc's memmove streams only above a threshold it derives from the cache size, 192 MiB on the development
      VM, larger than the pieces here). It is tiered_ckpt's own ``_streamcopy.copy``, the routine its snapshots
      use: as a ceiling it is that store instruction at full width on every core, with no planning around it.

    The ceiling is the fastest way (``faster()``, by medians). Sources and destinations must be
    contiguous uint8 views of the same lengths; they are kept, not copied."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int | None = None,
                 groups: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None):
        """``groups``: the threaded split given explicitly (one list of pairs per thread) instead of equal
        ranges of ``pairs``' bytes; ``single()`` still copies ``pairs``."""
        self.pairs = pairs
        self.threads = max(1, threads or torch.get_num_threads())
        if groups is not None:
            self.jobs = [[(d.data_ptr(), s.data_ptr(), s.numel()) for s, d in g] for g in groups]
        else:
            self.jobs = self._split(pairs, self.threads)
        self.jobs = [j for j in self.jobs if j]
        self._pool = ThreadPoolExecutor(len(self.jobs)) if len(self.jobs) > 1 else None

    @staticmethod
    def _split(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> list[list[tuple[int, int, int]]]:
        total = sum(s.numel() for s, _ in pairs)
        per = max(1, -(-total // threads))
        jobs: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]  # (dst, src, n) per thread
        k = used = 0
        for src, dst in pairs:
            if src.numel() != dst.numel():
                raise ValueError(f"copy pair of {src.numel()} and {dst.numel()} bytes")
            sp, dp, left = src.data_ptr(), dst.data_ptr(), src.numel()
            while left:
                n = min(left, per - used)
                jobs[k].append((dp, sp, n))
                sp, dp, left, used = sp + n, dp + n, left - n, used + n
                if used == per and k < threads - 1:
                    k, used = k + 1, 0
        return jobs

    @staticmethod
    def _run(job: list[tuple[int, int, int]]) -> None:
        for dst, src, n in job:
            ctypes.memmove(dst, src, n)

    @staticmethod
    def _run_streaming(job: list[tuple[int, int, int]]) -> None:
        for dst, src, n in job:
            _stream_copy(dst, src, n)

    def single(self) -> float:
        t0 = time.perf_counter()
        for src, dst in self.pairs:
            dst.copy_(src)
        return time.perf_counter() - t0

    def threaded(self) -> float:
        return self._on_threads(self._run)

    def streaming(self) -> float:
        if not _STREAMING:
            raise RuntimeError("no streaming copy here: tiered_ckpt._streamcopy is not built (or not x86-64)")
        return self._on_threads(self._run_streaming)

    def _on_threads(self, run: Callable[[list[tuple[int, int, int]]], None]) -> float:
        t0 = time.perf_counter()
        if self._pool is None:
            for job in self.jobs:
                run(job)
        else:
            for f in [self._pool.submit(run, j) for j in self.jobs]:
                f.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self.pairs, self.jobs = [], []


def faster(samples: dict[str, list[float]]) -> tuple[str, float]:
    """The method with the lowest median among {method: seconds}, and that median: the ceiling."""
    meds = {k: _median(v) for k, v in samples.items() if v}
    best = min(meds, key=meds.__getitem__)
    return best, meds[best]


def copy_ceiling(tensors: list[torch.Tensor], repeats: int = 5) -> dict[str, object]:
    """The copy ceiling into pre-faulted shared memory of the full size: medians of ``repeats`` of each of
    :data:`COPY_WAYS` (rotating), and the fastest: {"<way>_s" for each way, "method", "seconds", "threads"}."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    mm, buf = prefaulted_shm(max(1, nbytes))
    try:
        pairs, off = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                pairs.append((t.contiguous().reshape(-1).view(torch.uint8), buf[off:off + n]))
            off += n
        pc = ParallelCopy(pairs)
        samples: dict[str, list[float]] = {w: [] for w in COPY_WAYS}
        for i in range(repeats):
            for how in COPY_WAYS[i % len(COPY_WAYS):] + COPY_WAYS[:i % len(COPY_WAYS)]:
                samples[how].append(getattr(pc, how)())
        threads = pc.threads
        pc.close()
        method, seconds = faster(samples)
        return {**{f"{w}_s": v for w, v in samples.items()}, "method": method, "seconds": seconds,
                "threads": threads}
    finally:
        del pairs, buf
        try:
            mm.close()
        except BufferError:
            pass


class RawPut:
    """The raw parallel PUT ceiling of one process's bytes on an S3 endpoint: the tensors' bytes (one contiguous
    copy, made once) put as ``part``-byte objects on ``concurrency`` connections of a plain boto3 client, request
    checksums off; nothing but the transfer. ``s3``: ``{"bucket", "options" (endpoint_url, key, secret,
    client_kwargs.region_name), "part", "concurrency"}``."""

    def __init__(self, tensors: list[torch.Tensor], s3: dict, name: str):
        import boto3
        from botocore.config import Config

        self.flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
        self.s3, self.name = s3, name
        o = s3["options"]
        cfg = Config(max_pool_connections=s3["concurrency"], request_checksum_calculation="when_required",
                     response_checksum_validation="when_required", retries={"max_attempts": 3},
                     s3={"payload_signing_enabled": False})  # no SHA-256 of the bodies over HTTP, as the tier
        self.client = boto3.client("s3", endpoint_url=o["endpoint_url"], aws_access_key_id=o["key"],
                                   aws_secret_access_key=o["secret"],
                                   region_name=o["client_kwargs"]["region_name"], config=cfg)

    def put(self) -> float:
        """Seconds to put every part (the objects are deleted after, untimed)."""
        from concurrent.futures import ThreadPoolExecutor

        mv, part = memoryview(self.flat.numpy()), self.s3["part"]
        keys = [(f"raw/{self.name}/{i:05d}", i) for i in range(0, len(mv), part)]

        def one(key_off: tuple[str, int]) -> None:
            key, off = key_off
            self.client.put_object(Bucket=self.s3["bucket"], Key=key, Body=bytes(mv[off:off + part]))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.s3["concurrency"]) as pool:
            list(pool.map(one, keys))
        seconds = time.perf_counter() - t0
        for key, _ in keys:
            self.client.delete_object(Bucket=self.s3["bucket"], Key=key)
        return seconds

    def close(self) -> None:
        self.flat = torch.empty(0, dtype=torch.uint8)
