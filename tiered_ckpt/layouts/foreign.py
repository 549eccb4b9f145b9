"""Step directories another program wrote: Megatron-LM's (or DLRover's) torch files, PyTorch DCP's files.

Such a directory holds no manifest of ours, so nothing in it can be verified, but it is a checkpoint the user
may need (a job that switches to tiered_ckpt keeps saving into the directory Megatron-LM wrote): retention and
``gc`` never remove it as debris, and ``ls`` says who wrote it (docs/operations.md, "What `gc` may touch").

Our own layouts use Megatron's file names too, so a failed save of ours must not pass for Megatron's. Each rank
writes a marker under the step's ``tiered_ckpt/`` before its first file (``FileStore._mark_started``), so a
directory with anything under ``tiered_ckpt/`` is ours, and a partial one is debris, as always. Directories that
an older tiered_ckpt wrote without the marker are told by what else only we write: a flat file, a temporary file
of an unfinished write (the in-place ``distrib_optim.pt`` among them), or a ``rank_RRRRR/distrib_optim.pt`` in
our rank-shard format (DLRover's has another).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .base import META_DIR
from .dcp import METADATA_NAME

MEGATRON_FILES = frozenset({"model_optim_rng.pt", "distrib_optim.pt"})  # Megatron-LM's and DLRover's names
DCP_STATE = "dcp, no manifest (written by DCP: nothing to verify)"
MEGATRON_STATE = "megatron, no manifest (written by Megatron-LM or DLRover)"


def foreign_step_dirs(keys: Iterable[str], tier: Any = None) -> dict[str, str]:
    """The top-level directories of a tier's listing ``keys`` that another program wrote, each with its ``ls``
    state. A directory with DCP's ``.metadata`` counts whatever else it holds (a committed ``dcp`` step is
    listed as committed before this is asked); one with Megatron's file names only when nothing in it is ours.
    ``tier`` (the listing's): look at what a listing does not show (temporary files, the rank files' format);
    without it, or when that cannot be read, the directory counts as foreign."""
    ours: set[str] = set()
    dcp: set[str] = set()
    megatron: dict[str, list[str]] = {}
    for key in keys:
        top, _, rest = key.partition("/")
        if not rest:
            continue
        name = rest.rpartition("/")[2]
        if rest.startswith(META_DIR + "/") or ".flat" in name:
            ours.add(top)
        elif METADATA_NAME.match(name):
            dcp.add(top)
        elif name in MEGATRON_FILES:
            megatron.setdefault(top, []).append(key)
    candidates = {d: files for d, files in megatron.items() if d not in ours}
    if candidates and tier is not None:
        temp_dirs = _temp_dirs(tier)
        candidates = {d: files for d, files in candidates.items() if not _ours(tier, files, temp_dirs)}
    found = dict.fromkeys(candidates, MEGATRON_STATE)
    found.update(dict.fromkeys(dcp, DCP_STATE))
    return found


def _temp_dirs(tier: Any) -> set[str] | None:
    """The step directories holding a temporary file of an unfinished write (listings skip those files)."""
    try:
        return {k.partition("/")[0] for k in tier.temp_files()}
    except Exception:  # noqa: BLE001 - a tier (a plugin's) that cannot tell: then nothing counts as ours
        return None


def _ours(tier: Any, files: list[str], temp_dirs: set[str] | None) -> bool:
    step_dir = files[0].partition("/")[0]
    if temp_dirs is None:
        return False  # cannot tell: keep it
    if step_dir in temp_dirs:
        return True  # an unfinished write of ours (Megatron-LM writes no such names)
    rank_files = sorted(k for k in files if k.split("/")[1].startswith("rank_"))
    if not rank_files:
        return False
    from ..megatron.legacy import rank_file_kind

    try:
        return rank_file_kind(tier, rank_files[0]) == "rank_sharded"
    except Exception:  # noqa: BLE001 - a damaged file raises anything (struct, pickle): cannot tell, keep it;
        return False  # this runs in retention, which must not fail a commit over someone else's file
