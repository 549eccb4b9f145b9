"""The Drain protocol: what the engine asks of whatever moves its saves down the tiers (docs/architecture.md,
"The two protocols").

Three classes implement it: :class:`~tiered_ckpt.drain.DrainRuntime` (threads of this process),
:class:`~tiered_ckpt.worker.ProcessDrain` (a worker process reading the shared-memory snapshot) and
:class:`~tiered_ckpt.worker.SplitDrain` (threads for the in-process hop to shared memory, the worker for the rest).
:func:`tiered_ckpt.worker.open_drain` picks one from the configuration and the tiers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# step, tier, committed?, why not
OnTierDone = Callable[[int, str, bool, "str | None"], None]
# tier, slot, step: nothing will read that slot for that step again
OnSlotReleased = Callable[[str, int, int], None]


@dataclass(frozen=True)
class DrainRequest:
    step: int
    source: str  # the memory tier holding the snapshot
    slot: int
    due: tuple[str, ...]  # tiers to write, in pipeline order
    created: float = field(default_factory=time.time)  # when the snapshot was taken (time to durable)
    recover: bool = False
    save_id: str = ""  # the save's identity (engine._save_id): a commit found after a worker died is this save's
    # node-local tier -> the newest step every node has committed there: retention keeps it and every newer one
    # (node_commits.py; -1: not known yet, keep every step); a tier not named: retention as on one node
    kept_from: dict[str, int] = field(default_factory=dict)


class Drain(Protocol):
    """Takes requests in order and reports each tier's outcome through the callbacks it was built with."""

    def submit(self, req: DrainRequest) -> None:
        """Queue ``req``; never blocks for the drain itself."""
        ...

    def slots_ready(self) -> None:
        """The memory tiers' slots were allocated (``prepare()``). A drain that reads them from another process
        maps them now, in the background: otherwise the first save into each slot pays for it on its way to
        durable. Does not wait for the mapping."""
        ...

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every submitted request finished on every due tier; False if ``timeout`` passed first."""
        ...

    def close(self, timeout: float | None = None) -> bool:
        """Finish (waiting up to ``timeout``), then stop; whether everything finished."""
        ...

    def worker_note(self) -> str | None:
        """For a message about a save that waits on the drain: what is wrong with the drain's worker process
        (stopped, in an uninterruptible wait), or None (no worker, or nothing to say)."""
        ...
