"""Failure records: how the ranks of a multi-writer tier learn at once that a save will not commit there.

Without them a rank whose part of a step could not be written said nothing on the tier: the committing rank
waited ``drain.commit_timeout_s`` for its vote, and the other ranks waited as long again for a commit that would
never come. Now a rank whose write fails records why under the step's ``tiered_ckpt/`` directory
(``rank_NNNNN.failed``); the committing rank, seeing one for the save it commits, stops waiting and records the
step's failure (``commit.failed``), which the ranks waiting for the commit read (docs/architecture.md, "Failure
records").

A record names its save (``save_id``): one of another save of the step is stale and counts for nothing. Only the
save's first drain heeds records; a recovery of the same save in a later process may find its own earlier
attempt's, and waits for the deadline as before. A record is published under the tier's retry policy (a
throttled store must not lose it); a tier that still cannot take one leaves the waiting to the deadline, which is
where it was.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from .errors import TieredCkptError
from .tiers.base import Tier, as_memoryview

log = logging.getLogger(__name__)

MAX_RECORD = 16 * 1024  # a reason longer than this is cut: records are read while ranks wait
REASON_CHARS = 2000


def record_failure(tier: Tier, key: str, *, save_id: str, rank: int, reason: str,
                   retried: Callable[[Callable[[], Any]], Any] = lambda publish: publish()) -> None:
    """Publish at ``key`` that ``rank``'s part (or the commit) of the save ``save_id`` failed, saying ``reason``;
    ``retried(publish)`` calls it under the tier's retry policy."""
    if not save_id:
        return  # without an identity a record could not be told from another save's
    body = {"save_id": save_id, "rank": rank, "reason": reason[:REASON_CHARS]}
    try:
        retried(lambda: tier.publish(key, (json.dumps(body) + "\n").encode()))
    except Exception as exc:  # noqa: BLE001 - the failure itself is reported elsewhere; the waiting falls back
        log.warning("tier %r: could not record at %s that step's save failed (the other ranks wait for their "
                    "deadline instead): %s", tier.name, key, exc)


def recorded_failure(tier: Tier, key: str, save_id: str) -> dict[str, Any] | None:
    """The record at ``key`` when it is of the save ``save_id`` (``{"rank", "reason"}``), else None: none, another
    save's, or unreadable (a record never fails a wait by itself)."""
    try:
        raw = bytes(as_memoryview(tier.read_blob_hashed(key, max_size=MAX_RECORD)))
        body = json.loads(raw.decode())
    except (TieredCkptError, OSError, UnicodeDecodeError, ValueError):  # none, damaged, or no answer now
        return None
    if not isinstance(body, dict) or not save_id or body.get("save_id") != save_id:
        return None
    return {"rank": body.get("rank"), "reason": str(body.get("reason", ""))}
