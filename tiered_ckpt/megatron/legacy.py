"""Checkpoints without our manifest — written by Megatron-LM itself, or by DLRover — found and loaded.

:func:`detect` tells what a tier holds for a step: the layout (``megatron``: ``mp_rank_*`` files only;
``rank_sharded``: ours, ``rank_RRRRR/distrib_optim.pt`` beside them; ``dlrover``: the same directory names
holding DLRover's per-param optimizer fragments), the iteration from Megatron's tracker, and the parallel
topology from the directory names and the ``args`` inside ``model_optim_rng.pt``. Tracker edge cases follow
Megatron (docs/megatron-format.md, "How Megatron reads the tracker"): whitespace is stripped, ``release`` names the
``release/`` directory, anything else is an error naming the file (Megatron would ``sys.exit``); a missing tracker
is an error here (Megatron would silently start from random weights) unless ``step`` is given.

:func:`load_rank_items` returns one rank's items as the engine saves them: ``model_optim_rng`` (the dict) and
``distrib_optim`` (the rank's :mod:`.rank_shard` dict, split out of Megatron's gathered file at the
checkpoint's or the current DP size). Such a checkpoint has no checksums: nothing is verified, the result says so
(``verified`` False) and a warning is logged once per checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import BlobNotFoundError, DecodeError, LayoutMismatchError, NoCheckpointError, UnsafePickleError
from ..layouts.base import META_DIR
from ..parallel import RankCoords
from ..tiers.base import Tier, as_memoryview
from . import rank_shard, tier_io
from .checkpoint_info import CheckpointInfo, LoadedItems
from .geometry import OptimizerGeometry
from .lazy_torch import open_lazy
from .naming import (
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    RELEASE,
    STEP_DIRECTORY_ADVICE,
    TRACKER_FILENAME,
    Iteration,
    MegatronTopology,
    is_step_directory,
    iteration_dir_name,
    parse_iteration_dir,
    parse_tracker,
    scan_rank_dirs,
)
from .source import StepSource

__all__ = ["CheckpointInfo", "LoadedItems", "detect", "load_rank_items", "warn_unverified"]

log = logging.getLogger(__name__)
LAYOUTS = ("megatron", "rank_sharded", "dlrover")
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def read_tracker(tier: Tier) -> Iteration | None:
    """Megatron's tracker on ``tier``: an iteration, ``release``, or None when there is none."""
    try:
        data = tier.read_blob(TRACKER_FILENAME)
    except BlobNotFoundError:
        return None
    return parse_tracker(bytes(as_memoryview(data)[:4096]), source=tier_io.where(tier, TRACKER_FILENAME))


def _step_dirs(tier: Tier) -> list[int]:
    """The iterations of the ``iter_*`` directories on ``tier``, oldest first."""
    return sorted({it for k in tier.list("iter_") if (it := parse_iteration_dir(k.split("/", 1)[0])) is not None})


def _manifest_key(step_dir: str) -> str:
    return f"{step_dir}/{META_DIR}/manifest.json"


def detect(tier: Tier, *, step: Iteration | None = None, trust_pickles: bool = False) -> CheckpointInfo:
    """Find the checkpoint of ``step`` (default: the tracker's) on ``tier`` and tell what it is."""
    notes: list[str] = []
    try:
        tracker = read_tracker(tier)
    except DecodeError as exc:
        if step is None:
            raise
        tracker = None  # an explicit step does not need it (Megatron's --ckpt-step)
        notes.append(f"the tracker is unreadable and was ignored: {exc}")
    iteration = step if step is not None else tracker
    if iteration is None:
        steps = _step_dirs(tier)
        committed = [s for s in steps if tier.exists(_manifest_key(iteration_dir_name(s)))]
        if not committed:
            if not steps and is_step_directory(tier.list("")):
                raise NoCheckpointError(f"tier {tier.name!r} ({tier.describe()}): {STEP_DIRECTORY_ADVICE}")
            raise NoCheckpointError(
                f"{tier_io.where(tier, TRACKER_FILENAME)}: no tracker file, so no checkpoint is named (Megatron "
                f"would start from random weights); step directories present: {steps[:10] or 'none'}; pass a "
                "step to load one of them")
        iteration = committed[-1]
    step_dir = iteration_dir_name(iteration)
    keys = tier.list(step_dir + "/")
    where = tier_io.where(tier, step_dir)
    if not keys:
        named = f"the tracker names iteration {iteration}" if step is None else f"step {iteration} was asked for"
        there = _step_dirs(tier)
        shown = ", ".join(map(str, there[-10:])) if there else "none"
        raise NoCheckpointError(f"{where}: {named}, but this step directory is missing or empty (step directories "
                                f"there: {shown})")
    names = {k[len(step_dir) + 1:] for k in keys}
    if "metadata.json" in names:
        raise DecodeError(f"{where}: a torch_dist (distributed) checkpoint; only Megatron's legacy torch format is "
                          "read here (convert it with Megatron's tools first)")
    if any(n.endswith(".distcp") for n in names):  # DCP's files without Megatron's metadata.json: not Megatron's
        raise DecodeError(f"{where}: a PyTorch DCP checkpoint (.distcp files), not a Megatron one; only Megatron's "
                          "legacy torch format is read here (DCP's own reader, or tiered_ckpt.dcp."
                          "TieredStorageReader, loads it)")
    mp_dirs = sorted({n.split("/")[0] for n in names if n.startswith("mp_rank_") and n.count("/") == 1})
    rank_files = sorted(int(n[5:10]) for n in names
                        if n.startswith("rank_") and n.endswith("/" + DISTRIB_OPTIM_FILENAME) and n[5:10].isdigit())
    has_distrib = any(f"{d}/{DISTRIB_OPTIM_FILENAME}" in names for d in mp_dirs)
    has_manifest = f"{META_DIR}/manifest.json" in names
    if not mp_dirs:
        if has_manifest:  # ours, of a state that is not Megatron's (an S3 user's trial: the message said less)
            raise DecodeError(f"{where}: a tiered_ckpt checkpoint of a state that is not a Megatron model's (no "
                              "mp_rank_* directories: it was not saved through tiered_ckpt.megatron): convert and "
                              "the Megatron loaders read Megatron checkpoints only; CheckpointEngine.load() reads "
                              "this one")
        raise DecodeError(f"{where}: no mp_rank_* directories: not a Megatron torch-format checkpoint")
    if not has_manifest and any(n.startswith(f"{META_DIR}/") for n in names):
        raise NoCheckpointError(f"{where}: step {iteration} was saved by tiered_ckpt but never committed (files "
                                f"under {META_DIR}/, no checkpoint manifest): it is incomplete")
    args = None
    if has_manifest:
        from ..manifest import load_checkpoint

        manifest = load_checkpoint(as_memoryview(tier.read_blob(_manifest_key(step_dir))).tobytes(),
                                   _manifest_key(step_dir), tier.name)
        topo = rank_shard.as_topology(manifest.parallel)
        layout, writer = manifest.layout, "tiered_ckpt"
    else:
        _check_complete(names, mp_dirs, has_distrib, where)
        args = _read_args(tier, f"{step_dir}/{mp_dirs[0]}/{MODEL_FILENAME}", trust_pickles)
        topo = _topology(mp_dirs, rank_files, args, where)
        layout, writer = "megatron", "megatron"
        if rank_files:
            layout = writer = rank_file_kind(tier, f"{step_dir}/rank_{rank_files[0]:05d}/{DISTRIB_OPTIM_FILENAME}")
            if layout == "rank_sharded":
                writer = "tiered_ckpt"
                notes.append("tiered_ckpt rank files without a checkpoint manifest: an incomplete save?")
        notes.append("no tiered_ckpt manifest: no checksums of ours, only the CRC-32s torch wrote into each file's "
                     "zip directory can be checked")
    if iteration == RELEASE:
        notes.append("a release checkpoint: Megatron loads it as iteration 0, without optimizer and RNG state")
    return CheckpointInfo(layout, iteration, step_dir, has_manifest, topo, tuple(mp_dirs), tuple(rank_files),
                          has_distrib, tracker, writer, where, args, tuple(notes))


def _check_complete(names: set[str], mp_dirs: Sequence[str], has_distrib: bool, where: str) -> None:
    """LayoutMismatchError when a file Megatron-LM writes in every ``mp_rank_*`` directory is missing from some:
    ``model_optim_rng.pt`` always, ``distrib_optim.pt`` in all of them or none (a copy cut short, a lost file).
    Read as it is, such a step would lose those ranks' state without a word."""
    wanted = [MODEL_FILENAME, *([DISTRIB_OPTIM_FILENAME] if has_distrib else [])]
    missing = [f"{d}/{f}" for d in mp_dirs for f in wanted if f"{d}/{f}" not in names]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise LayoutMismatchError(f"{where}: incomplete checkpoint, missing {shown} (Megatron-LM writes "
                                  f"{MODEL_FILENAME} in every mp_rank_* directory, and {DISTRIB_OPTIM_FILENAME} in "
                                  "all of them or none): copy the step again from where it was saved")


def _read_args(tier: Tier, key: str, trust_pickles: bool) -> Any:
    """The ``args`` of a ``model_optim_rng.pt``, reading only its pickle (not the weights) when it is safe."""
    try:
        return open_lazy(tier, key, where=tier_io.where(tier, key)).obj.get("args")
    except (DecodeError, UnsafePickleError):
        if not trust_pickles:
            raise
    from .safe_load import load_bytes

    obj = load_bytes(as_memoryview(tier.read_blob(key)), where=tier_io.where(tier, key), trust_pickles=True)
    return obj.get("args")


def _topology(mp_dirs: Sequence[str], rank_files: Sequence[int], args: Any, where: str) -> MegatronTopology:
    try:
        scan = scan_rank_dirs(mp_dirs, args=args)
    except LayoutMismatchError as exc:
        raise LayoutMismatchError(f"{where}: {exc}") from None
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    model_parallel = scan.tp_size * scan.pp_size * scan.ep_size * cp
    if rank_files:
        world = len(rank_files)
        if world % model_parallel or rank_files != list(range(world)):
            raise LayoutMismatchError(f"{where}: {world} rank files do not fill TP={scan.tp_size} x PP={scan.pp_size}"
                                      f" x EP={scan.ep_size} x CP={cp} x DP")
        dp = world // model_parallel
    else:
        megatron_dp = getattr(args, "data_parallel_size", None)
        if not isinstance(megatron_dp, int) or megatron_dp % scan.ep_size:
            raise DecodeError(f"{where}: the checkpoint's args give no usable data_parallel_size ({megatron_dp!r})")
        dp = megatron_dp // scan.ep_size
    return MegatronTopology(tp=scan.tp_size, pp=scan.pp_size, dp=dp, ep=scan.ep_size, cp=cp)


def rank_file_kind(tier: Tier, key: str) -> str:
    """``rank_sharded`` for our rank files, ``dlrover`` for anything else under that name."""
    try:
        obj = open_lazy(tier, key, where=tier_io.where(tier, key)).obj
    except (DecodeError, UnsafePickleError):
        return "dlrover"
    return "rank_sharded" if isinstance(obj, dict) and obj.get("format") == rank_shard.FORMAT else "dlrover"


def warn_unverified(info: CheckpointInfo) -> None:
    """Log, once per checkpoint, that nothing of it can be verified."""
    key = (info.where, str(info.iteration))
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("%s: %s-written checkpoint without a tiered_ckpt manifest: no checksums of ours vouch for it (each "
                "model file read whole is checked against its zip CRC-32s; the optimizer's ranges are not: "
                "tiered-ckpt verify checks every file)", info.where, info.writer)


def load_rank_items(
    tier: Tier,
    step: Iteration | None,
    coords: RankCoords,
    *,
    trust_pickles: bool = False,
    geometry: Sequence[OptimizerGeometry | None] | None = None,
    verify: bool = True,
) -> LoadedItems:
    """This rank's ``model_optim_rng`` and ``distrib_optim`` items from the checkpoint of ``step`` on ``tier``.

    ``coords`` is the *current* job's rank and layout: TP, PP, EP and CP must match the checkpoint's, DP may
    differ (the optimizer state is re-split by Megatron's rule: docs/megatron-format.md, "Re-splitting for
    another DP size"). ``geometry``: the live optimizer's bucket geometry per sub-optimizer, to split a
    Megatron-written file without recomputing its buckets from the model state. With a manifest (our layouts)
    every file read is verified (``verify``); without one nothing is, and the result says so.
    """
    info = detect(tier, step=step, trust_pickles=trust_pickles)
    if not info.has_manifest:
        warn_unverified(info)
    with StepSource(tier, info, trust_pickles=trust_pickles, verify=verify, geometry=geometry) as src:
        return src.rank_items(coords)
