"""This machine's limits, measured on the same bytes the benchmarks move: the ceilings every ratio is taken against.

* ``copy``: ``Tensor.copy_`` into pre-faulted memory (a /dev/shm mapping written once before timing);
* ``write_fsync``: ``os.write`` of the bytes to a new file on the benchmark's disk directory, then ``fsync``;
* ``read``: reading that file back after dropping it from the page cache where possible (``posix_fadvise``).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time

import torch


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def prefaulted_shm(nbytes: int) -> tuple[str, mmap.mmap, torch.Tensor]:
    root = tempfile.mkdtemp(prefix="tiered_ckpt_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(root, "buf")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.fill_(0)
    return root, mm, buf


def copy_seconds(tensors: list[torch.Tensor], repeats: int = 5) -> float:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root, mm, buf = prefaulted_shm(nbytes)
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
        shutil.rmtree(root, ignore_errors=True)


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


def direct_write_fsync_seconds(tensors: list[torch.Tensor], directory: str, repeats: int = 3) -> float:
    """Write + fsync of the tensors' bytes with ``O_DIRECT``, from one page-aligned buffer in 64 MiB writes (the
    best case for direct I/O: no copies, no bounce buffers). The buffer is filled before the clock starts."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    size = nbytes + (-nbytes) % 4096
    buf = mmap.mmap(-1, size)
    view, pos = memoryview(buf), 0
    for t in tensors:
        mv = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        view[pos:pos + len(mv)] = mv
        pos += len(mv)
    times = []
    for i in range(repeats):
        path = os.path.join(directory, f"raw_direct_{i}.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            off = 0
            while off < size:
                off += os.pwrite(fd, view[off:off + (64 << 20)], off)
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t0)
        os.unlink(path)
    view.release()
    buf.close()
    return _median(times)


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
