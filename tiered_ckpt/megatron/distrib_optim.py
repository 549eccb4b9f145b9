"""``distrib_optim.pt``: the distributed optimizer's parameter state, gathered per model-parallel rank.

Current form ("buckets_coalesced", Megatron core_v0.7 and later; docs/megatron-format.md, "distrib_optim.pt")::

    {'buckets_coalesced': True,
     gbuf_idx: {(param_dtype, grad_dtype): {'param': fp32 [U], 'exp_avg': fp32 [U], 'exp_avg_sq': fp32 [U],
                                            'numel_unpadded': U}}, ...}

where each world tensor is the buffer's buckets, each cut to its unpadded size ``U_b``, end to end (``U = sum
U_b``). A chained optimizer (MoE, ...) stores a list of such dicts, None where the sub-optimizer's DP rank 0
lives elsewhere.

*Local shards* are what one DP rank holds: ``{"gbuf<g>/bucket<b>/<key>": fp32 [N_b / DP]}``, element ``i``
being bucket element ``dp_rank * N_b / DP + i`` (zeros in the padding).

The merge/split recipe (docs/megatron-format.md, "Merging the DP shards into the file" and "Re-splitting for
another DP size") was checked bit for bit against Megatron's own files and its own re-split at other DP sizes
(``tests/megatron_format/test_megatron_distrib_optim.py``); confirmed:
- merge: concatenating the DP shards of a bucket and keeping the first ``U_b`` elements gives Megatron's file
  (re-saved with ``torch.save`` it is byte-identical to the file Megatron wrote);
- split: ``N'_b = ceil(U_b / lcm(DP', 128)) * lcm(DP', 128)``, zero-pad, rank r' takes its ``N'_b/DP'`` slice;
- ``U_b`` does not change with DP (fixed ``bucket_size``), only ``N_b`` does;
- per-param view: a param at buffer ``[s, e)`` in bucket b is at world offset ``s - sum_{b'<b}(N_b' - U_b')``
  (equal to the model weights stored in ``model_optim_rng.pt``).
Not testable on those fixtures: zeros in the 64-alignment gaps (their params are all multiples of 64), the
chained ``[None, expert_state]`` lists (no MoE), Megatron's older layouts (refused here with DecodeError).

Everything runs bucket by bucket (:func:`iter_merge`, :func:`iter_split`): peak extra memory is one bucket.
Their inputs may be lazy (:class:`~.lazy_torch.LazyTensor` shards or world tensors, read by range when sliced),
so a whole checkpoint is never in memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import DecodeError, LayoutMismatchError
from .geometry import BufferGeometry, OptimizerGeometry
from .lazy_torch import copy_range, is_tensor_like

BUCKETS_COALESCED = "buckets_coalesced"
NUMEL_UNPADDED = "numel_unpadded"


def shard_key(buffer_idx: int, bucket_idx: int, key: str) -> str:
    """The key of one local shard tensor: ``gbuf<g>/bucket<b>/<key>``."""
    return f"gbuf{buffer_idx}/bucket{bucket_idx}/{key}"


class MergedPiece(NamedTuple):
    """One bucket's share of a world tensor: ``tensor`` goes to ``world[buffer_idx][key][offset:offset+len]``.
    """

    buffer_idx: int
    bucket_idx: int
    key: str
    offset: int
    tensor: torch.Tensor


# ------------------------------------------------------------------------------------------------------------
# merge: local shards of every DP rank -> Megatron's dict


def iter_merge(
    shards_by_dp_rank: Sequence[Mapping[str, torch.Tensor]],
    geometry: OptimizerGeometry,
) -> Iterator[MergedPiece]:
    """Yield the world tensors piece by piece (buffer, then state key, then bucket: the order of the file).

    ``shards_by_dp_rank[r]`` is DP rank r's local shards (a dict, or any mapping that loads lazily); shards in
    another float dtype (a precision-aware optimizer's bf16 moments) are cast to float32, as Megatron stores.
    """
    _check_ranks(shards_by_dp_rank, geometry)
    for g, buf in enumerate(geometry.buffers):
        for key in geometry.state_keys:
            for b, offset in enumerate(buf.world_offsets()):
                out = torch.empty(buf.buckets[b].numel_unpadded, dtype=torch.float32)
                _merge_bucket_into(out, shards_by_dp_rank, buf, g, b, key)
                yield MergedPiece(g, b, key, offset, out)
                del out  # before the next bucket is allocated: one bucket at a time


def merge_shards(
    shards_by_dp_rank: Sequence[Mapping[str, torch.Tensor]],
    geometry: OptimizerGeometry,
) -> dict[Any, Any]:
    """The content of Megatron's ``distrib_optim.pt`` for one DistributedOptimizer, from every DP rank's
    shards."""
    _check_ranks(shards_by_dp_rank, geometry)
    state: dict[Any, Any] = {BUCKETS_COALESCED: True}
    for g, buf in enumerate(geometry.buffers):
        entry: dict[str, Any] = {}
        for key in geometry.state_keys:
            # One allocation per world tensor (not views of a shared one): torch.save then writes exactly what
            # Megatron writes.
            world = torch.empty(buf.numel_unpadded, dtype=torch.float32)
            for b, offset in enumerate(buf.world_offsets()):
                view = world[offset:offset + buf.buckets[b].numel_unpadded]
                _merge_bucket_into(view, shards_by_dp_rank, buf, g, b, key)
            entry[key] = world
        entry[NUMEL_UNPADDED] = buf.numel_unpadded
        state[g] = {buf.dtype_key: entry}
    return state


def merge_chained(
    parts: Sequence[tuple[Sequence[Mapping[str, torch.Tensor]], OptimizerGeometry] | None],
) -> list[dict[Any, Any] | None]:
    """A chained optimizer's file: one merged dict per sub-optimizer, None where this directory holds none."""
    return [None if p is None else merge_shards(*p) for p in parts]


def _merge_bucket_into(
    out: torch.Tensor,
    shards: Sequence[Mapping[str, torch.Tensor]],
    buf: BufferGeometry,
    g: int,
    b: int,
    key: str,
) -> None:
    """Fill ``out`` (U_b elements) with the first U_b elements of the concatenated DP shards of one bucket."""
    unpadded, n = buf.buckets[b].numel_unpadded, buf.shard_numel(b)
    name = shard_key(g, b, key)
    for r, rank_shards in enumerate(shards):
        lo = r * n
        if lo >= unpadded:
            # Only padding left; still check the shard exists, so a truncated input fails loudly.
            _get_shard(rank_shards, name, n, r)
            continue
        hi = min(lo + n, unpadded)
        copy_range(out[lo:hi], _get_shard(rank_shards, name, n, r), 0, hi - lo)


def _get_shard(rank_shards: Mapping[str, torch.Tensor], name: str, n: int, dp_rank: int) -> torch.Tensor:
    try:
        t = rank_shards[name]
    except KeyError:
        raise LayoutMismatchError(f"DP rank {dp_rank}: no local shard {name!r}") from None
    if not is_tensor_like(t) or t.dim() != 1 or t.numel() != n:
        found = tuple(t.shape) if is_tensor_like(t) else type(t).__name__
        raise LayoutMismatchError(f"DP rank {dp_rank}: shard {name!r} is {found}, expected ({n},) (N_b / DP)")
    return t


def _check_ranks(shards: Sequence[Any], geometry: OptimizerGeometry) -> None:
    if len(shards) != geometry.dp_size:
        raise LayoutMismatchError(
            f"got shards from {len(shards)} DP ranks, the geometry has DP={geometry.dp_size}"
        )


# ------------------------------------------------------------------------------------------------------------
# split: Megatron's dict -> one DP rank's local shards (at the same or another DP size)


def iter_split(
    state: Mapping[Any, Any],
    geometry: OptimizerGeometry,
    dp_rank: int,
    *,
    dp_size: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(shard_key, fp32 tensor of N'_b / DP')`` for DP rank ``dp_rank``, by buffer, bucket, state key.

    ``geometry`` is the optimizer's geometry at any DP size (only ``U_b`` and the dtypes matter); ``dp_size``
    re-pads it for another DP (default: the geometry's own).
    """
    geo = geometry if dp_size is None or dp_size == geometry.dp_size else geometry.with_dp_size(dp_size)
    if not 0 <= dp_rank < geo.dp_size:
        raise LayoutMismatchError(f"dp_rank {dp_rank} is outside DP={geo.dp_size}")
    worlds = [_buffer_state(state, g, buf, geo.state_keys) for g, buf in enumerate(geo.buffers)]
    for g, buf in enumerate(geo.buffers):
        for b, offset in enumerate(buf.world_offsets()):
            unpadded, n = buf.buckets[b].numel_unpadded, buf.shard_numel(b)
            lo, hi = dp_rank * n, min((dp_rank + 1) * n, unpadded)
            for key in geo.state_keys:
                out = torch.zeros(n, dtype=torch.float32)
                if lo < hi:
                    copy_range(out[: hi - lo], worlds[g][key], offset + lo, offset + hi)
                yield shard_key(g, b, key), out
                del out


def split_state(
    state: Mapping[Any, Any],
    geometry: OptimizerGeometry,
    dp_rank: int,
    *,
    dp_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """What DP rank ``dp_rank`` of a DP-``dp_size`` job holds after Megatron loads ``state`` (see
    :func:`iter_split`)."""
    return dict(iter_split(state, geometry, dp_rank, dp_size=dp_size))


def sub_optimizer_states(obj: Any) -> list[Mapping[Any, Any] | None]:
    """The per-sub-optimizer dicts of a loaded ``distrib_optim.pt``: ``[dict]`` for a plain file, the list as
    is for a chained optimizer. :class:`DecodeError` on anything else (older Megatron layouts too)."""
    items = obj if isinstance(obj, list) else [obj]
    for i, item in enumerate(items):
        if item is not None:
            _check_coalesced(item, f"sub-optimizer {i}" if isinstance(obj, list) else "distrib_optim")
    return items


def _check_coalesced(state: Any, where: str) -> None:
    if not isinstance(state, Mapping):
        raise DecodeError(f"{where}: expected a dict, got {type(state).__name__}")
    if state.get(BUCKETS_COALESCED) is True:
        return
    if "per_bucket_numel" in state:
        raise DecodeError(f"{where}: Megatron core_v0.6 layout (lists of padded buckets) is not supported")
    raise DecodeError(
        f"{where}: no 'buckets_coalesced' key: Megatron's pre-2024 layout (load it in Megatron with "
        "--ckpt-convert-update-legacy-dist-opt-format and save again)"
    )


def _buffer_state(
    state: Mapping[Any, Any], g: int, buf: BufferGeometry, keys: tuple[str, ...]
) -> Mapping[str, torch.Tensor]:
    """Buffer ``g``'s entry of ``state``, checked against the geometry the way Megatron's loader checks it."""
    _check_coalesced(state, "distrib_optim")
    try:
        by_dtype = state[g]
    except KeyError:
        raise LayoutMismatchError(f"distrib_optim has no buffer {g} (geometry has {g + 1} or more)") from None
    if not isinstance(by_dtype, Mapping) or len(by_dtype) != 1:
        raise DecodeError(f"distrib_optim[{g}]: want one (param_dtype, grad_dtype) key, got {by_dtype!r:.80}")
    (dtype_key, entry), = by_dtype.items()
    if tuple(dtype_key) != buf.dtype_key:
        raise LayoutMismatchError(f"distrib_optim[{g}]: dtypes {dtype_key}, the geometry has {buf.dtype_key}")
    where = f"distrib_optim[{g}][{dtype_key}]"
    numel = entry.get(NUMEL_UNPADDED)
    if numel != buf.numel_unpadded:
        raise LayoutMismatchError(
            f"{where}: numel_unpadded {numel}, the geometry has {buf.numel_unpadded} (changed model, "
            "TP/PP/EP, param order, dtypes or bucket_size?)"
        )
    for key in keys:
        t = entry.get(key)
        if not is_tensor_like(t) or t.dim() != 1 or t.numel() != numel:
            found = tuple(t.shape) if is_tensor_like(t) else type(t).__name__
            raise LayoutMismatchError(f"{where}[{key!r}]: {found}, expected a ({numel},) tensor")
    return entry


# ------------------------------------------------------------------------------------------------------------
# model-space view


def iter_param_states(
    state: Mapping[Any, Any], geometry: OptimizerGeometry
) -> Iterator[tuple[int, str, str, torch.Tensor]]:
    """Yield ``(buffer_idx, param name, state key, view shaped like the param)`` from a merged state (needs a
    geometry built from params). The views share memory with ``state``."""
    for g, buf in enumerate(geometry.buffers):
        entry = _buffer_state(state, g, buf, geometry.state_keys)
        for p in buf.params():
            start, end = buf.world_range(p)
            for key in geometry.state_keys:
                yield g, p.name, key, entry[key][start:end].view(p.shape)
