"""Events: small frozen records of what the pipeline did, delivered to ``tiered_ckpt_on_event`` hooks.

Every event has a ``kind`` (a short verb), the ``run_id`` of the engine that emitted it, the ``step`` and
``rank`` it concerns, and where it applies the ``tier`` plus timings and byte counts. Events are plain data:
observers may log, export metrics or alert, but must never raise (a raising observer is logged and ignored, so
observation never breaks a save).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    kind: str
    step: int | None = None
    rank: int | None = None
    tier: str | None = None
    seconds: float | None = None
    nbytes: int | None = None
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    # The engine's run_id: set when the engine delivers the event (plugins.EngineEvents), so an observer of
    # several engines in one process can tell them apart. None only for an event not delivered by an engine.
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "", {})}


# The kinds the engine emits. Observers should ignore kinds they do not know: new ones get added.
SNAPSHOT = "snapshot"  # a save copied its items into the first tier (seconds = blocking time)
SLOT_WAIT = "slot_wait"  # every slot was still draining; save() waited (policy "wait")
SKIP = "skip"  # every slot was still draining; the save was skipped (policy "skip")
REPLAN = "replan"  # the items' structure changed; a slot was re-planned
DRAIN = "drain"  # a tier received a step's files (seconds = write time, nbytes = bytes written)
COMMIT = "commit"  # a step became committed (loadable) on a tier
COMMIT_FAILED = "commit_failed"  # a tier could not take a step; the others proceed
EVICT = "evict"  # retention removed a step from a tier
RETRY = "retry"  # a transient failure is being retried on a tier
FALLBACK = "fallback"  # load found a tier's copy unusable and moves to the next one
LOAD = "load"  # a step was loaded (tier = where it came from)
# load() or the recovery at start could not list a tier (message = why): it goes on without it
TIER_UNREACHABLE = "tier_unreachable"
RECOVER = "recover"  # after a restart, a snapshot found in memory is queued for draining
TIER_BEHIND = "tier_behind"  # a tier has this many steps still to take (detail.steps): saves outpace it
TIER_DISABLED = "tier_disabled"  # a tier was turned off (e.g. gpu with enabled: auto and no CUDA)
