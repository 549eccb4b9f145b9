"""How much more memory this process's control group lets it use: what a container's memory limit leaves.

Pages of a tmpfs (``/dev/shm``) are charged to the memory cgroup of the process that touches them first. In a
container with a memory limit, shared-memory slots larger than what the limit leaves are not refused by the
filesystem (its free space is the host's): the kernel's OOM killer ends the training process while the slot is
pre-faulted, with nothing said. The ``shm`` tier checks this headroom before allocating instead and raises a
:class:`~tiered_ckpt.errors.CapacityError` naming the limit.

Both cgroup versions are read: v2 (``memory.max``, ``memory.current``, ``memory.stat``) and v1
(``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.stat``), for this cgroup and each ancestor
visible in the container, the tightest one counting. Page cache of files is reclaimable, so it is not counted as
used (tmpfs pages are, being in ``shmem``). A cgroup that may swap (the machine has swap and the cgroup's swap
limit allows it) does not count: tmpfs pages can be swapped out there, so its memory limit is not where the OOM
killer strikes. Anything that cannot be read means no limit is known: nothing is refused on a guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class Headroom:
    """Bytes this process may still charge to its memory cgroups, and which cgroup allows the least."""

    available: int
    limit: int
    used: int
    where: str  # the limiting cgroup's directory


def memory_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup",
                    meminfo: str = "/proc/meminfo") -> Headroom | None:
    """The tightest limit over this process's memory cgroup and its ancestors; None when none is set (or the
    files cannot be read)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    swap = _has_swap(meminfo)
    found: list[Headroom] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2: one unified hierarchy
            found += _walk(root, path, "memory.max", "memory.current", "memory.swap.max" if swap else None)
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            found += _walk(os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                           "memory.memsw.limit_in_bytes" if swap else None)
    return min(found, key=lambda h: h.available) if found else None


def _has_swap(meminfo: str) -> bool:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) > 0
    except (OSError, ValueError, IndexError):
        pass
    return False


def _walk(mount: str, path: str, limit_file: str, usage_file: str, swap_file: str | None) -> list[Headroom]:
    """Each cgroup from ``path`` up to the mount's root (a container sees its own cgroup as the root) that has a
    limit and may not swap (``swap_file``: its swap limit, where the machine has swap)."""
    out = []
    rel = path.strip("/")
    while True:
        directory = os.path.join(mount, rel) if rel else mount
        limit, usage = _read_int(directory, limit_file), _read_int(directory, usage_file)
        may_swap = False
        if swap_file is not None and limit is not None:
            swap_limit = _read_int(directory, swap_file)
            # v2: memory.swap.max is swap alone; v1: memsw is memory and swap together
            may_swap = swap_limit is not None and (swap_limit > 0 if swap_file == "memory.swap.max"
                                                   else swap_limit > limit)
        if limit is not None and usage is not None and limit < _UNLIMITED and not may_swap:
            used = max(0, usage - _reclaimable(directory))
            out.append(Headroom(max(0, limit - used), limit, used, directory))
        if not rel:
            return out
        rel = os.path.dirname(rel)


def _read_int(directory: str, name: str) -> int | None:
    try:
        with open(os.path.join(directory, name)) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    return int(text) if text.isdigit() else None


def _reclaimable(directory: str) -> int:
    """Page cache of files, less tmpfs's (``shmem`` is in ``file`` but cannot be dropped)."""
    stat: dict[str, int] = {}
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    stat[key] = int(value)
    except OSError:
        return 0
    if "file" in stat:  # v2
        return max(0, stat["file"] - stat.get("shmem", 0))
    # v1: cache includes shmem; total_* are hierarchical, the plain ones this cgroup's own
    cache, shmem = stat.get("total_cache", stat.get("cache", 0)), stat.get("total_shmem", stat.get("shmem", 0))
    return max(0, cache - shmem)
