"""While a save copies, the drain of earlier steps steps aside.

A save's copy is the only work the training process waits for, and it is bound by memory bandwidth; the drain
of the previous step (hashing the slot, writing files through the page cache) wants the same bandwidth and, on a
small machine, the same cores. Measured on the 2-core development VM, a save issued while the previous step
drained took up to 1.35x the median of such saves. So a save marks the time of its copy in a shared cell
(:func:`copying`), and the drain's loops (the file write, the checks of the slot, the checksums taken after a
save) call :func:`wait_clear` between pieces of a few MiB: while a copy is marked, they sleep.

The cell holds a deadline, not a flag: ``time.monotonic()`` (one clock for every process of the machine) plus
an allowance for the copy's size. A drain never waits past it, so a training process that dies, or hangs, in
the middle of a copy delays the drain by that allowance at most; nothing has to clear the cell for the drain to
go on. The cell is a ``multiprocessing`` shared value made on first use in the training process and handed to
the drain worker when it is spawned (:func:`shared`, :func:`install`); drain threads in the training process
read the same cell.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

#: The longest a marked copy may hold a drain: a fixed part plus this many seconds per byte (1 GB/s, a fraction
#: of any machine's copy bandwidth); a copy that takes longer just has the drain running beside it again.
ALLOWANCE_S = 1.0
ALLOWANCE_S_PER_BYTE = 1e-9
POLL_S = 0.001  # how often a waiting drain looks at the cell again

_lock = threading.Lock()
_cell: Any = None  # a shared c_double: the deadline of the copy in progress, 0.0 when none
_active = 0  # copies in progress in this process (several engines may save at once)


def shared() -> Any:
    """This process's cell (made on first use), to hand to a drain worker at its spawn."""
    global _cell
    with _lock:
        if _cell is None:
            _cell = mp.get_context("spawn").RawValue(ctypes.c_double, 0.0)
        return _cell


def install(cell: Any) -> None:
    """In a drain worker: read the training process's cell (from :func:`shared`) from now on."""
    global _cell
    with _lock:
        _cell = cell


def allowance(nbytes: int) -> float:
    return ALLOWANCE_S + max(0, nbytes) * ALLOWANCE_S_PER_BYTE


@contextlib.contextmanager
def copying(nbytes: int) -> Iterator[None]:
    """Mark a save's copy of ``nbytes`` in progress for its duration (at most :func:`allowance` seconds)."""
    global _active
    cell = shared()
    deadline = time.monotonic() + allowance(nbytes)
    with _lock:
        _active += 1
        cell.value = max(cell.value, deadline)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                cell.value = 0.0


def busy() -> bool:
    """Whether a save's copy is marked in progress now (and its allowance not yet spent)."""
    cell = _cell
    return cell is not None and cell.value > time.monotonic()


def wait_clear(limit_s: float | None = None) -> float:
    """Sleep while a save's copy is marked (never past its deadline, nor past ``limit_s``); the seconds slept."""
    cell = _cell
    if cell is None:
        return 0.0
    deadline = cell.value
    now = time.monotonic()
    if deadline <= now:
        return 0.0
    start = now
    stop = deadline if limit_s is None else min(deadline, now + limit_s)
    while now < stop:
        time.sleep(min(POLL_S, stop - now))
        now = time.monotonic()
        current = cell.value
        if current <= now:
            break
        stop = current if limit_s is None else min(current, start + limit_s)
    return now - start


def _after_fork_in_child() -> None:
    global _lock, _active
    _lock, _active = threading.Lock(), 0  # a copy in progress at the fork is the parent's, not the child's


os.register_at_fork(after_in_child=_after_fork_in_child)
