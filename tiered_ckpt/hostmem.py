"""Fresh host memory, fast: the kernel populates an anonymous mapping in one pass (MAP_POPULATE).

Faulting fresh pages one by one from a copy runs at a fraction of memory bandwidth (measured here: a
``clone()`` of 1 GiB took 1.1-3.5 s; MAP_POPULATE 0.35 s, then the copy at full speed).
"""

from __future__ import annotations

import mmap

import torch

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def populated_empty(nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor of ``nbytes`` whose pages are already present (contents: zeros)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive


def private_copy(data: torch.Tensor) -> torch.Tensor:
    """A copy of a 1-D uint8 host tensor in freshly populated memory."""
    out = populated_empty(data.numel())
    out.copy_(data)
    return out
