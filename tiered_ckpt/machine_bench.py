"""``tiered-ckpt bench``: this machine's ceilings and each configured tier's throughput against them.

Ceilings: a copy into pre-faulted memory (what a snapshot can reach), a write into a fresh ``/dev/shm`` file (what
a save costs without pre-faulted slots), a write+fsync on each local tier's disk. Each tier then writes and
reads one blob of the same size through its own primitives.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
import uuid
from dataclasses import dataclass

import torch

from .hostmem import populated_empty
from .tiers.base import Tier


@dataclass
class Measure:
    what: str
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"what": self.what, "seconds": round(self.seconds, 4), "bytes": self.nbytes,
                "gb_per_s": round(self.gbps, 3)}


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the ceiling: the least disturbed run


def copy_prefaulted(nbytes: int, repeats: int = 3) -> Measure:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = populated_empty(nbytes)
    return Measure("copy into pre-faulted memory", _best(lambda: dst.copy_(src), repeats), nbytes)


def fresh_shm_write(nbytes: int, directory: str = "/dev/shm") -> Measure:
    import mmap

    # A page fault with no room left on the tmpfs is a SIGBUS that kills the process without a word (Docker's
    # default /dev/shm is 64 MiB): look first.
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"{directory} has {free >> 20} MiB free and the fresh-file write needs "
                                    f"{nbytes >> 20} MiB")
    src = torch.ones(nbytes, dtype=torch.uint8)
    path = os.path.join(directory, f".tiered_ckpt-bench-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        t0 = time.perf_counter()
        dst.copy_(src)  # every page faulted in by the copy itself
        seconds = time.perf_counter() - t0
        del dst
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return Measure(f"first write into a fresh file in {directory}", seconds, nbytes)


def write_fsync(nbytes: int, directory: str) -> Measure:
    data = memoryview(bytes(nbytes))
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".tiered_ckpt-bench-", dir=directory)
    try:
        t0 = time.perf_counter()
        view = data
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return Measure(f"write+fsync in {directory}", seconds, nbytes)


def tier_round_trip(tier: Tier, nbytes: int) -> list[Measure]:
    key = f"tiered_ckpt-bench/{uuid.uuid4().hex}.bin"
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    try:
        t0 = time.perf_counter()
        tier.write_blob(key, [data])
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        tier.read_blob(key)
        read = time.perf_counter() - t0
    finally:
        tier.delete_prefix("tiered_ckpt-bench")
    return [Measure(f"tier {tier.name!r} ({tier.kind}) write", write, nbytes),
            Measure(f"tier {tier.name!r} ({tier.kind}) read", read, nbytes)]
