"""Crash points: named places where a test can make the process die by SIGKILL, to prove crash consistency.

``crash_point(name)`` does nothing unless the environment variable ``TIERED_CKPT_CRASH_AT`` names that point
(``name``, or ``name:N`` for its N-th hit in this process); then the process kills itself with SIGKILL, as an OOM
killer or a lost node would: no ``finally``, no ``atexit``, no flush. When the variable is unset a call is one
global lookup and a comparison.

The variable is read once, at import. :func:`arm` changes it at run time, for this process and the processes it
starts afterwards (the drain worker inherits the environment), each of which counts its own hits.

:data:`POINTS` names every point and where it is, in the order a save meets them; tests iterate it.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "TIERED_CKPT_CRASH_AT"

#: name → where it is
POINTS: dict[str, str] = {
    "save.invalidated": "engine.save: the slot's old snapshot record was deleted, nothing copied yet",
    "save.item_copied": "engine.save: after each item's copy into the slot (hit 1 of 2 items: mid-copy)",
    "save.before_publish": "engine.save: every item copied, the slot record not yet published",
    "memory.publish": "memory_store.publish: before a slot record is written (save, memory hop, checksums)",
    "drain.before_write": "drain: before a file tier receives a step's files",
    "drain.after_write": "drain: a file tier has the step's files and this rank's manifest, not yet committed",
    "drain.before_commit": "drain: the committing rank is about to write the checkpoint manifest",
    "store.files_written": "file_store: a rank's files are written, its rank manifest is not",
    "store.rank_manifest_written": "file_store: right after a rank manifest was published",
    "store.manifest_written": "file_store: the checkpoint manifest is published, the tracker not yet updated",
    "store.retain_uncommitted": "file_store.uncommit_expired: an old step's manifest is deleted, its files not yet",
    "files.deleting": "tiers/_files: deleting a step directory, before each file (hit 2: midway)",
    "files.temp_written": "tiers/_files: a temporary file is written (and fsynced), not yet renamed",
    "megatron.pieces_written": "megatron/inplace: a rank's ranges of distrib_optim.pt are written and synced, "
                               "its rank manifest is not",
    "megatron.in_place_complete": "megatron/inplace: the committing rank completed distrib_optim.pt, not renamed",
    "megatron.in_place_renamed": "megatron/inplace: distrib_optim.pt is in place, the checkpoint manifest is not",
    "megatron.parts_sent": "megatron/inplace_parts: a rank sent its parts of distrib_optim.pt's upload (S3), its "
                           "rank manifest is not written",
    "megatron.tail_sent": "megatron/inplace_parts: the committing rank sent the upload's last part, not completed",
    "megatron.upload_completed": "megatron/inplace_parts: distrib_optim.pt's upload is completed, the checkpoint "
                                 "manifest is not written",
    "fsspec.temp_written": "tiers/fsspec_tier: a temporary file is written on a renaming store, not yet moved",
    "s3.part_sent": "tiers/_s3: a part of a multipart upload is on the store, the upload is not completed (each "
                    "part's hit)",
}

_target: tuple[str, int] | None = None
_hits = 0
_lock = threading.Lock()


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, sep, count = spec.partition(":")
    if sep and not (count.isdigit() and int(count) > 0):
        raise ValueError(f"{ENV}={spec!r}: expected NAME or NAME:N with N a positive integer")
    return name, int(count) if sep else 1


def arm(spec: str | None) -> None:
    """Crash at ``spec`` (``name`` or ``name:N``) from now on, here and in processes started later; None disarms."""
    global _target, _hits
    target = _parse(spec)
    with _lock:
        if spec:
            os.environ[ENV] = spec
        else:
            os.environ.pop(ENV, None)
        _target, _hits = target, 0


def crash_point(name: str) -> None:
    """SIGKILL this process if ``TIERED_CKPT_CRASH_AT`` names this point (and this is its N-th hit)."""
    if _target is None or _target[0] != name:
        return
    global _hits
    with _lock:
        _hits += 1
        if _hits == _target[1]:
            os.kill(os.getpid(), signal.SIGKILL)


_target = _parse(os.environ.get(ENV))
