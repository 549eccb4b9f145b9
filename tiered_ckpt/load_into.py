"""``load(into=...)``: restore a checkpoint into the caller's existing tensors, in place.

A resume copies the checkpoint into tensors that already exist (the model's parameters, the optimizer's
state), which is what ``load_state_dict`` does after ``load()``. Asking for it directly saves one pass over
memory: from a memory snapshot whose checksum is piecewise (:func:`~tiered_ckpt.checksum.snapshot_checksum`),
each 64 MiB piece is copied into the targets 1 MiB at a time and hashed right after, while those source bytes
are still in the CPU's cache, with the pieces spread over the cores torch uses (:mod:`.memcopy`).
Verifying first and copying after reads the snapshot from memory twice; on the development VM that made a
verified restore cost 1.4x a plain ``copy_``, fused it costs about one. :func:`copy_out_verified` does the same
for ``load(copy=True)``, into fresh memory, hashing the copy itself.

Tensors are paired by their place in the structure (dict keys, list and tuple positions). A saved tensor whose
counterpart in ``into`` has another shape or dtype is an error naming the item and the path; one without a
counterpart is returned as loaded. A tensor of ``into`` the checkpoint does not hold (a renamed or misspelt
key) keeps its values, with a warning naming it. Values that are not tensors (step counters, ``args``)
come from the checkpoint. If verification fails part-way, the targets hold partial data: the engine then loads the
next tier (or an older step) into them, and if no tier can be loaded they must not be used. A target that the step
finally loaded does not hold, after a failed read that may have written it, is refused (``LoadIntoError``):
it holds neither its own values nor the checkpoint's.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import xxhash

from . import memcopy
from .checksum import SNAPSHOT_PIECE, is_piecewise, snapshot_matches
from .errors import LoadIntoError

log = logging.getLogger("tiered_ckpt")
_SUB = 1 << 20  # bytes copied, then hashed: small enough that the sub-block just read is still in cache


_ABSENT = object()  # no counterpart in ``into``


def pair_into(loaded: Any, into: Any, where: str, unmatched: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``loaded`` with each tensor that has a counterpart in ``into`` replaced by that counterpart, and the
    (loaded, target) pairs to copy. Raises :class:`LoadIntoError` (a ValueError) for a counterpart of another
    shape or dtype.
    ``unmatched``: applied to every loaded tensor without a counterpart (a copy, say); None keeps them."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _pair(loaded, into, where, pairs, unmatched)
    filled = {id(t) for _, t in pairs}
    left = [p for p, t in _targets(into, where) if id(t) not in filled]
    if left:
        # A warning, not an error: a fresh optimizer's state (torch's get_state_dict makes it for every
        # parameter) holds tensors for parameters that never had a gradient, which no checkpoint holds.
        more = f" (and {len(left) - 1} more: {', '.join(left[1:4])}{', ...' if len(left) > 4 else ''})" \
            if len(left) > 1 else ""
        log.warning("load(into=...): %s is a tensor in into that the checkpoint does not hold as a tensor%s: it "
                    "keeps its current values (a renamed or misspelt key? optimizer state of a parameter that never "
                    "had a gradient is expected here)", left[0], more)
    return out, pairs


def unfilled_targets(into: dict[str, Any], items: dict[str, Any]) -> list[str]:
    """The paths of the tensors of ``into`` that a load's ``items`` (which hold the targets they filled) do not."""
    filled = {id(t) for t in tensors(items)}
    return [path for name, state in into.items() for path, t in _targets(state, repr(name)) if id(t) not in filled]


def _targets(into: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``into`` with its path, as :func:`_pair` names them."""
    if isinstance(into, torch.Tensor):
        yield path, into
    elif isinstance(into, dict):
        for k, v in into.items():
            yield from _targets(v, f"{path}[{k!r}]")
    elif type(into) in (list, tuple):
        for i, v in enumerate(into):
            yield from _targets(v, f"{path}[{i}]")


def _pair(loaded: Any, into: Any, path: str, pairs: list, unmatched: Callable | None) -> Any:
    if isinstance(loaded, torch.Tensor):
        if not isinstance(into, torch.Tensor):
            return loaded if unmatched is None else unmatched(loaded)
        if into.shape != loaded.shape or into.dtype != loaded.dtype:
            raise LoadIntoError(f"load(into=...): {path} is {_describe(loaded)} in the checkpoint but "
                                f"{_describe(into)} in into")
        pairs.append((loaded, into))
        return into
    if isinstance(loaded, dict):
        if not isinstance(into, dict):
            if unmatched is None:
                return loaded
            into = {}  # nothing to pair below: walked only for ``unmatched``
        out = {k: _pair(v, into.get(k, _ABSENT), f"{path}[{k!r}]", pairs, unmatched) for k, v in loaded.items()}
        return out if type(loaded) is dict else type(loaded)(out)
    if type(loaded) in (list, tuple):
        if not (isinstance(into, list | tuple) and len(into) == len(loaded)):
            if unmatched is None:
                return loaded
            into = [_ABSENT] * len(loaded)
        return type(loaded)(_pair(v, t, f"{path}[{i}]", pairs, unmatched)
                            for i, (v, t) in enumerate(zip(loaded, into, strict=True)))
    if unmatched is not None and isinstance(loaded, np.ndarray):  # a view of the snapshot too (an RNG state)
        return loaded.copy()
    return loaded


def check_into_names(into: dict[str, Any], saved: list[str], where: str) -> None:
    """An item name in ``into`` that the checkpoint does not hold is a typo, never silently nothing."""
    unknown = [name for name in into if name not in saved]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], saved, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise LoadIntoError(f"load(into=...): no item {unknown[0]!r} in {where} (its items: "
                            f"{', '.join(repr(n) for n in saved) or 'none'}){hint}")


def apply_into(items: dict[str, Any], into: dict[str, Any], where: str = "the checkpoint") -> dict[str, Any]:
    """Loaded items (from a file tier, say) with the tensors ``into`` has counterparts for copied into those."""
    check_into_names(into, list(items), where)
    out = {}
    for name, value in items.items():
        if name in into:
            value, pairs = pair_into(value, into[name], f"item {name!r}")
            copy_pairs(pairs)
        out[name] = value
    return out


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair: host to host on every core (:func:`memcopy.copy_tensors`)."""
    memcopy.copy_tensors(pairs)


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from tensors(v)


def copy_verified(data: torch.Tensor, checksum: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Copy each pair's source (a view into ``data``, one item of a memory snapshot) into its target and check
    ``data`` against ``checksum``; False on a mismatch (the targets may then hold part of the bad bytes)."""
    if not (is_piecewise(checksum) and data.device.type == "cpu" and all(_fusable(s, d) for s, d in pairs)):
        if not snapshot_matches(data, checksum):
            return False
        copy_pairs(pairs)
        return True
    expected = checksum.partition(":")[2].split(",")
    n = data.numel()
    if len(expected) != max(1, -(-n // SNAPSHOT_PIECE)):
        return False
    base = data.data_ptr()
    # (offset in data, bytes, target address): addresses, not numpy views (thousands of small tensors: the
    # views cost more than their bytes' copy). _fusable checked every target is contiguous host memory.
    spans = sorted((s.data_ptr() - base, s.numel() * s.element_size(), d.data_ptr()) for s, d in pairs
                   if s.numel())
    starts = [off for off, _, _ in spans]
    src = data.numpy()

    def piece(k: int) -> bool:
        start, end = k * SNAPSHOT_PIECE, min(n, (k + 1) * SNAPSHOT_PIECE)
        h = xxhash.xxh3_128()
        i = max(0, bisect.bisect_right(starts, start) - 1)
        pos = start
        while pos < end:
            stop = min(end, pos + _SUB)
            while i < len(spans) and spans[i][0] + spans[i][1] <= pos:
                i += 1
            j, moves = i, []
            while j < len(spans) and spans[j][0] < stop:
                off, nbytes, dst = spans[j]
                lo, hi = max(pos, off), min(stop, off + nbytes)
                if lo < hi:
                    moves.append((dst + lo - off, base + lo, hi - lo))
                j += 1
            memcopy.move_all(moves)  # releases the GIL: pieces run in parallel
            h.update(memoryview(src[pos:stop]))  # the bytes just read: hashed from the cache
            pos = stop
        return h.hexdigest() == expected[k]

    return all(memcopy.parallel_map(piece, range(len(expected))))


def copy_out(data: torch.Tensor) -> torch.Tensor:
    """A copy of ``data`` (a 1-D uint8 host tensor) in fresh, populated memory, moved on every core."""
    out = memcopy.fresh_buffer(data.numel())
    if data.numel():
        memcopy.copy_spans([(out.data_ptr(), data.data_ptr(), data.numel())])
    return out


def copy_out_verified(data: torch.Tensor, checksum: str) -> torch.Tensor | None:
    """:func:`copy_out` checked against ``checksum`` (the item's, from its slot record) while it is made: each
    sub-block is hashed from the copy right after it is written, with the pieces spread over the cores. What is
    returned is the very bytes verified (a writer changing the slot meanwhile makes a mismatch, never a verified
    copy of other bytes). None on a mismatch. (The copy streams past the cache, so the hash reads the sub-block
    back from memory; measured on 256 MiB, that is still faster than memmove's cached copy: 0.051 s against
    0.060 s.)"""
    if not (is_piecewise(checksum) and data.device.type == "cpu"):
        out = copy_out(data.cpu())
        return out if snapshot_matches(out, checksum) else None
    expected = checksum.partition(":")[2].split(",")
    n = data.numel()
    if len(expected) != max(1, -(-n // SNAPSHOT_PIECE)):
        return None
    out = memcopy.fresh_buffer(n)
    src, dst = data.data_ptr(), out.data_ptr()
    view = memoryview(out.numpy())

    def piece(k: int) -> bool:
        start, end = k * SNAPSHOT_PIECE, min(n, (k + 1) * SNAPSHOT_PIECE)
        h = xxhash.xxh3_128()
        for pos in range(start, end, _SUB):
            stop = min(end, pos + _SUB)
            memcopy.move(dst + pos, src + pos, stop - pos)  # releases the GIL
            h.update(view[pos:stop])
        return h.hexdigest() == expected[k]

    return out if all(memcopy.parallel_map(piece, range(len(expected)))) else None


def _fusable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return (src.device.type == "cpu" and dst.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous()
            and not dst.is_conj() and not dst.is_neg())

