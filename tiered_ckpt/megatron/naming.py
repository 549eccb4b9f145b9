"""Megatron-LM's legacy (``torch``) checkpoint naming: step directories, rank directories, the tracker file.

Layout of a checkpoint (docs/megatron-format.md, "Directories and the tracker file")::

    <save>/latest_checkpointed_iteration.txt          "10" (no padding, no newline) or "release"
    <save>/iter_0000010/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
                                              /distrib_optim.pt

The ``_PPP`` suffix appears when the PP world size is > 1 and ``_EEE`` when the EP world size is > 1, decided
by the *sizes*, never by the ranks. So ``mp_rank_00_001`` is either pp=1 (PP > 1, EP = 1) or ep=1 (PP = 1, EP
> 1). Names alone cannot settle this: both layouts produce exactly the same set of sibling directories.
:func:`scan_rank_dirs` settles it from whatever is known (either size, or the checkpoint's own ``args``) and
uses the siblings to check consistency and to infer the sizes it can (TP size, and the size of the suffixed
dimension).

Rank order, groups and which rank writes which file: :class:`~tiered_ckpt.parallel.ParallelLayout` (here named
``MegatronTopology``). Megatron's default order is ``tp-cp-ep-dp-pp``, tp varying fastest, i.e.
``rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp)))``; with cp = ep = 1 that is ``tp + TP*(dp + DP*pp)``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError, DecodeError, LayoutMismatchError
from ..parallel import ParallelLayout, mp_rank_name

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
#: What to do with one step's directory (``iter_NNNNNNN``) given where the checkpoint directory above it belongs.
STEP_DIRECTORY_ADVICE = ("this is one step's directory (it holds mp_rank_* directories), not a checkpoint directory: "
                         f"give its parent, the directory holding the iter_* directories and {TRACKER_FILENAME}")


def is_step_directory(names: Iterable[str]) -> bool:
    """Whether a directory holding ``names`` is one step's (Megatron's ``mp_rank_*`` directories in it)."""
    return any(n.startswith("mp_rank_") for n in names)
RELEASE = "release"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"

Iteration = int | Literal["release"]

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
# tp has at least 2 digits (more from tp >= 100), pp and ep at least 3.
_RANK_DIR = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")
_TRACKER_INT = re.compile(r"^[0-9]+$")


# ------------------------------------------------------------------------------------------------------------
# step directories and the tracker


def iteration_dir_name(iteration: Iteration) -> str:
    """``iter_{iteration:07d}``, or ``release``. Iterations of 10**7 and more simply get more digits."""
    if iteration == RELEASE:
        return RELEASE
    _check_nonneg_int(iteration, "iteration")
    return f"iter_{iteration:07d}"


def parse_iteration_dir(name: str) -> Iteration | None:
    """The iteration of a step directory name (``release`` for the release directory); None for other names.
    """
    if name == RELEASE:
        return RELEASE
    m = _ITER_DIR.match(name)
    if not m:
        return None
    digits = m.group(1)
    # Megatron pads to 7 digits; a longer name with a leading zero (iter_00000010) is not one Megatron writes.
    if len(digits) > 7 and digits[0] == "0":
        return None
    return int(digits)


def format_tracker(iteration: Iteration) -> str:
    """The tracker's text exactly as Megatron writes it: ``str(iteration)`` or ``release``, no newline."""
    if iteration == RELEASE:
        return RELEASE
    _check_nonneg_int(iteration, "iteration")
    return str(iteration)


def parse_tracker(text: str | bytes, *, source: str = TRACKER_FILENAME) -> Iteration:
    """Parse the tracker: a decimal iteration or ``release``; surrounding whitespace is ignored (as Megatron).

    Stricter than Megatron (which calls ``int()``, accepting ``+10``, ``1_0`` or negative numbers, and calls
    ``sys.exit()`` on anything else): only ASCII digits or ``release``, else :class:`DecodeError` naming the
    file.
    """
    if isinstance(text, bytes | bytearray | memoryview):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError(f"{source}: tracker is not UTF-8 text: {bytes(text)[:40]!r}") from None
    stripped = text.strip()
    if stripped == RELEASE:
        return RELEASE
    if _TRACKER_INT.match(stripped):
        return int(stripped)
    shown = stripped if len(stripped) <= 40 else stripped[:40] + "..."
    raise DecodeError(f"{source}: expected an iteration number or 'release' in the tracker, got {shown!r}")


def read_tracker(save_dir: str | os.PathLike[str]) -> Iteration | None:
    """The iteration named by ``<save_dir>/latest_checkpointed_iteration.txt``; None when there is no tracker.
    """
    path = os.path.join(os.fspath(save_dir), TRACKER_FILENAME)
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return None
    return parse_tracker(data, source=path)


def write_tracker(save_dir: str | os.PathLike[str], iteration: Iteration) -> str:
    """Write the tracker atomically (temp file, fsync, rename; Megatron writes in place). Returns its path."""
    text = format_tracker(iteration)
    save_dir = os.fspath(save_dir)
    path = os.path.join(save_dir, TRACKER_FILENAME)
    fd, tmp = tempfile.mkstemp(prefix=f".{TRACKER_FILENAME}.", suffix=".tmp", dir=save_dir)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; Megatron's open('w') leaves the umask default
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


# ------------------------------------------------------------------------------------------------------------
# rank directories


@dataclass(frozen=True)
class RankDirCoords:
    """The model-parallel coordinates a ``mp_rank_*`` directory stands for."""

    tp: int
    pp: int = 0
    ep: int = 0


def rank_dir_name(tp: int, pp: int = 0, ep: int = 0, *, pp_size: int = 1, ep_size: int = 1) -> str:
    """``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]``: the pp part when ``pp_size > 1``, the ep part when
    ``ep_size > 1``."""
    for value, what in ((tp, "tp"), (pp, "pp"), (ep, "ep")):
        _check_nonneg_int(value, what)
    for size, what in ((pp_size, "pp_size"), (ep_size, "ep_size")):
        _check_pos_int(size, what)
    if pp >= pp_size or ep >= ep_size:
        raise ConfigError(f"rank (pp={pp}, ep={ep}) outside sizes (pp_size={pp_size}, ep_size={ep_size})")
    return mp_rank_name(tp, pp, ep, pp_size=pp_size, ep_size=ep_size)


def parse_rank_dir(name: str, *, pp_size: int | None = None, ep_size: int | None = None) -> RankDirCoords:
    """Coordinates of one ``mp_rank_*`` name. Two-part names need ``pp_size`` or ``ep_size`` (module doc).

    Raises :class:`DecodeError` for names Megatron does not write or ambiguous names, and
    :class:`LayoutMismatchError` when the name cannot come from a run with the given sizes.
    """
    m = _RANK_DIR.match(name)
    if not m:
        raise DecodeError(f"{name!r} is not a Megatron rank directory (mp_rank_TT[_PPP][_EEE])")
    tp = int(m.group(1))
    suffixes = [int(s) for s in m.group(2, 3) if s is not None]
    if len(suffixes) == 0:
        if (pp_size or 1) > 1 or (ep_size or 1) > 1:
            raise LayoutMismatchError(f"{name!r} has no suffix but pp_size={pp_size}, ep_size={ep_size}")
        return RankDirCoords(tp)
    if len(suffixes) == 2:
        if pp_size == 1 or ep_size == 1:
            raise LayoutMismatchError(f"{name!r} has two suffixes but pp_size={pp_size}, ep_size={ep_size}")
        coords = RankDirCoords(tp, suffixes[0], suffixes[1])
    else:
        suffix_is_pp = _suffix_is_pp(name, pp_size, ep_size)
        coords = RankDirCoords(tp, pp=suffixes[0]) if suffix_is_pp else RankDirCoords(tp, ep=suffixes[0])
    if pp_size is not None and coords.pp >= pp_size or ep_size is not None and coords.ep >= ep_size:
        raise LayoutMismatchError(f"{name!r} = {coords} is outside pp_size={pp_size}, ep_size={ep_size}")
    return coords


def _suffix_is_pp(name: str, pp_size: int | None, ep_size: int | None) -> bool:
    """Whether the single suffix of ``name`` is the pp rank (else the ep rank), from the sizes Megatron uses.
    """
    pp_on = None if pp_size is None else pp_size > 1
    ep_on = None if ep_size is None else ep_size > 1
    if pp_on is None and ep_on is None:
        raise DecodeError(
            f"{name!r} is ambiguous: its suffix is the pp rank when PP > 1 and EP = 1, the ep rank when "
            "PP = 1 and EP > 1; pass pp_size or ep_size (or the checkpoint's args, see scan_rank_dirs)"
        )
    if pp_on and ep_on:
        raise LayoutMismatchError(f"{name!r} has one suffix but PP and EP are both > 1 (mp_rank_TT_PPP_EEE)")
    if pp_on is False and ep_on is False:
        raise LayoutMismatchError(f"{name!r} has a suffix but PP = EP = 1 (expected mp_rank_TT)")
    if pp_on is not None:
        return pp_on
    return not ep_on


@dataclass(frozen=True)
class RankDirScan:
    """What the ``mp_rank_*`` entries of one step directory say: sizes and each directory's coordinates."""

    tp_size: int
    pp_size: int
    ep_size: int
    dirs: Mapping[str, RankDirCoords]

    def name_of(self, tp: int, pp: int = 0, ep: int = 0) -> str:
        return rank_dir_name(tp, pp, ep, pp_size=self.pp_size, ep_size=self.ep_size)


def scan_rank_dirs(
    names: Iterable[str],
    *,
    pp_size: int | None = None,
    ep_size: int | None = None,
    args: Any = None,
) -> RankDirScan:
    """Resolve every ``mp_rank_*`` name among ``names`` (others are ignored) into coordinates and sizes.

    The pp/ep ambiguity of two-part names is settled, in this order, by ``pp_size``/``ep_size``, then by
    ``args`` (the checkpoint's ``argparse.Namespace`` from ``model_optim_rng.pt``: its
    ``pipeline_model_parallel_size`` and ``expert_model_parallel_size``); otherwise :class:`DecodeError`.
    The siblings must form the full grid (every tp x pp x ep once, all with the same number of parts), else
    :class:`LayoutMismatchError`; sizes are inferred from the grid where they were not given.
    """
    rank_names = sorted(n for n in names if n.startswith("mp_rank_"))
    if not rank_names:
        raise DecodeError("no mp_rank_* directories")
    tp_size: int | None = None
    if args is not None:
        pp_size = pp_size if pp_size is not None else getattr(args, "pipeline_model_parallel_size", None)
        ep_size = ep_size if ep_size is not None else getattr(args, "expert_model_parallel_size", None)
        # The names alone cannot show that the last TP ranks' directories are gone (a copy cut short): the
        # checkpoint would pass for a smaller TP with half the model. The args say how many there were.
        tp_size = _positive_int(getattr(args, "tensor_model_parallel_size", None))
    parts = {n: sum(1 for g in _match_rank_dir(n).groups() if g is not None) for n in rank_names}
    if len(set(parts.values())) != 1:
        raise LayoutMismatchError(f"rank directories mix naming schemes: {rank_names}")
    nparts = next(iter(parts.values()))
    if nparts == 1:
        pp_size = 1 if pp_size is None else pp_size
        ep_size = 1 if ep_size is None else ep_size
    elif nparts == 3:
        if pp_size == 1 or ep_size == 1:
            raise LayoutMismatchError(f"mp_rank_TT_PPP_EEE names but pp_size={pp_size}, ep_size={ep_size}")
    elif pp_size is None and ep_size is None:
        _suffix_is_pp(rank_names[0], None, None)  # raises the ambiguity error
    elif pp_size is None:
        pp_size = 1 if ep_size > 1 else None
    elif ep_size is None:
        ep_size = 1 if pp_size > 1 else None
    coords = {n: parse_rank_dir(n, pp_size=pp_size, ep_size=ep_size) for n in rank_names}
    tp_size = tp_size or 1 + max(c.tp for c in coords.values())
    found_pp = 1 + max(c.pp for c in coords.values())
    found_ep = 1 + max(c.ep for c in coords.values())
    pp_size = found_pp if pp_size is None else pp_size
    ep_size = found_ep if ep_size is None else ep_size
    expected = {(t, p, e) for t in range(tp_size) for p in range(pp_size) for e in range(ep_size)}
    got = {(c.tp, c.pp, c.ep) for c in coords.values()}
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        told = [f"missing {', '.join(rank_dir_name(*c, pp_size=pp_size, ep_size=ep_size) for c in missing[:8])}"
                if missing else "", f"unexpected (tp, pp, ep) {extra[:8]}" if extra else ""]
        from_args = " (the sizes of the checkpoint's args)" if args is not None else ""
        raise LayoutMismatchError(
            f"rank directories do not form a tp={tp_size} x pp={pp_size} x ep={ep_size} grid{from_args}: "
            f"{'; '.join(t for t in told if t)}"
        )
    return RankDirScan(tp_size, pp_size, ep_size, coords)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _match_rank_dir(name: str) -> re.Match[str]:
    m = _RANK_DIR.match(name)
    if not m:
        raise DecodeError(f"{name!r} is not a Megatron rank directory (mp_rank_TT[_PPP][_EEE])")
    return m


# ------------------------------------------------------------------------------------------------------------
# rank order, groups and writers: the package's one topology class, under the name this format's code uses

MegatronTopology = ParallelLayout


def _check_nonneg_int(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{what}: expected a non-negative integer, got {value!r}")


def _check_pos_int(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what}: expected a positive integer, got {value!r}")
