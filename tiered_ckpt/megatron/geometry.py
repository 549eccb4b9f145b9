"""Bucket geometry of Megatron's distributed optimizer: where each param and each DP rank's shard sit.

DDP packs a model chunk's trainable params into one gradient *buffer* per ``(param_dtype, grad_dtype)``; the
distributed optimizer shards every *bucket* of a buffer evenly over the data-parallel ranks. The rules
(docs/megatron-format.md, "Buckets and their sizes"), checked against real Megatron checkpoints in
``tests/data/megatron``:

1. params are placed in **reverse** ``named_parameters()`` order;
2. each param start is rounded up to a multiple of 64 elements;
3. a param marked ``shared_embedding`` gets a bucket of its own. Megatron marks the tied word embedding (first
   stage) and output layer (last stage) only when PP > 1; with PP = 1 they share buckets like any param;
4. a bucket closes once ``param_end - bucket_start >= bucket_size`` (with ``bucket_size=None`` only rule 3
   splits a buffer);
5. a closing bucket keeps ``U_b = param_end - bucket_start`` (64-alignment gaps included) and is padded to
   ``N_b``, the next multiple of ``lcm(DP, 128)`` (``lcm(DP, 128, 65536)`` with
   ``--ddp-pad-buckets-for-high-nccl-busbw``). The next bucket starts at the padded end.

Since bucket starts are multiples of 128, a param's place inside its bucket and ``U_b`` do not depend on DP
(for a fixed ``bucket_size``): re-sharding for another DP only re-pads ``N_b``
(:meth:`BufferGeometry.with_dp_size`). DP rank ``r`` owns ``[r*N_b/DP, (r+1)*N_b/DP)`` of every bucket,
regardless of param boundaries.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from ..errors import ConfigError, DecodeError, LayoutMismatchError

ADAM_STATE_KEYS: tuple[str, ...] = ("param", "exp_avg", "exp_avg_sq")
LION_STATE_KEYS: tuple[str, ...] = ("param", "exp_avg")
PARAM_START_ALIGN = 64
DTypeKey = tuple[torch.dtype, torch.dtype]


def bucket_pad_multiple(dp_size: int, *, pad_for_high_nccl_busbw: bool = False) -> int:
    """What every bucket's padded size ``N_b`` is a multiple of: ``lcm(DP, 128)`` or ``lcm(DP, 128, 2**16)``.
    """
    _check_pos(dp_size, "dp_size")
    return math.lcm(dp_size, 128, 65536) if pad_for_high_nccl_busbw else math.lcm(dp_size, 128)


def megatron_bucket_size(
    dp_size: int,
    *,
    ddp_bucket_size: int | None = None,
    overlap_grad_reduce: bool = True,
    pp_rank: int = 0,
    disable_bucketing: bool = False,
) -> int | None:
    """The ``bucket_size`` Megatron's DDP uses.

    None (one bucket per buffer) without ``--overlap-grad-reduce``, on pipeline stages other than the first
    (even with ``--ddp-bucket-size``: the PP=2 fixture shows it), or with ``disable_bucketing``; else
    ``--ddp-bucket-size`` or the default ``max(40_000_000, 1_000_000 * DP)``. That default grows with DP
    beyond 40: a DP change then moves bucket boundaries and Megatron cannot re-shard (``numel_unpadded``
    differs).
    """
    if not overlap_grad_reduce or pp_rank > 0 or disable_bucketing:
        return None
    if ddp_bucket_size is not None:
        return ddp_bucket_size
    return max(40_000_000, 1_000_000 * dp_size)


@dataclass(frozen=True)
class ParamSpec:
    """One trainable param as DDP sees it, in ``named_parameters()`` order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32  # the buffer's param dtype: torch.uint8 for FP8/NVFP4 params
    shared_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamRange:
    """Where a param sits in its buffer: ``[start, end)`` (buffer coordinates) inside bucket ``bucket``."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    bucket: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class LocalParamRange:
    """The part of a param one DP rank owns; the four ranges of Megatron's ``param_range_map``."""

    name: str
    gbuf_world: tuple[int, int]  # in the buffer
    gbuf_world_in_bucket: tuple[int, int]  # in the bucket
    gbuf_local: tuple[int, int]  # in the rank's shard of the bucket
    param: tuple[int, int]  # in the flattened param


@dataclass(frozen=True)
class Bucket:
    index: int
    offset: int  # start in the buffer
    numel: int  # N_b, padded
    numel_unpadded: int  # U_b
    params: tuple[ParamRange, ...] = ()  # empty when the geometry was given as sizes


@dataclass(frozen=True)
class BufferGeometry:
    """One gradient buffer: its dtypes, DP size and buckets (in buffer order)."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    dp_size: int
    buckets: tuple[Bucket, ...]
    pad_for_high_nccl_busbw: bool = False

    def __post_init__(self) -> None:
        _check_pos(self.dp_size, "dp_size")
        offset = 0
        for i, b in enumerate(self.buckets):
            where = f"buffer {self.dtype_key}, bucket {i}"
            if b.index != i or b.offset != offset:
                raise LayoutMismatchError(f"{where}: index/offset {b.index}/{b.offset}, not {i}/{offset}")
            if b.numel % self.dp_size or not 0 <= b.numel_unpadded <= b.numel:
                raise LayoutMismatchError(
                    f"{where}: N_b={b.numel}, U_b={b.numel_unpadded} "
                    f"(need U_b <= N_b, N_b divisible by DP={self.dp_size})"
                )
            offset += b.numel

    @property
    def dtype_key(self) -> DTypeKey:
        return (self.param_dtype, self.grad_dtype)

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buckets)

    def shard_numel(self, bucket: int) -> int:
        """Elements of bucket ``bucket`` each DP rank holds: ``N_b / DP``."""
        return self.buckets[bucket].numel // self.dp_size

    def world_offsets(self) -> list[int]:
        """Start of each bucket in ``distrib_optim.pt``'s world tensor (buckets with tail padding dropped)."""
        return list(self._world_offsets)

    @cached_property
    def _world_offsets(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((b.numel_unpadded for b in self.buckets[:-1]), initial=0))

    def params(self) -> Iterator[ParamRange]:
        for b in self.buckets:
            yield from b.params

    def world_range(self, p: ParamRange) -> tuple[int, int]:
        """``[start, end)`` of a param in the world tensor: its buffer start less earlier buckets' tail
        padding."""
        b = self.buckets[p.bucket]
        start = self._world_offsets[p.bucket] + p.start - b.offset
        return start, start + p.numel

    def local_param_ranges(self, dp_rank: int) -> list[list[LocalParamRange]]:
        """Per bucket, the parts of params DP rank ``dp_rank`` owns (empty lists without param info)."""
        if not 0 <= dp_rank < self.dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is outside DP={self.dp_size}")
        out = []
        for b in self.buckets:
            n = b.numel // self.dp_size
            lo, hi = b.offset + dp_rank * n, b.offset + (dp_rank + 1) * n
            ranges = []
            for p in b.params:
                s, e = max(p.start, lo), min(p.end, hi)
                if s < e:
                    ranges.append(LocalParamRange(
                        p.name, (s, e), (s - b.offset, e - b.offset), (s - lo, e - lo),
                        (s - p.start, e - p.start),
                    ))
            out.append(ranges)
        return out

    def with_dp_size(self, dp_size: int, *, pad_for_high_nccl_busbw: bool | None = None) -> BufferGeometry:
        """The same buffer for another DP: same ``U_b`` and in-bucket positions, ``N_b`` re-padded."""
        high = self.pad_for_high_nccl_busbw if pad_for_high_nccl_busbw is None else pad_for_high_nccl_busbw
        mult = bucket_pad_multiple(dp_size, pad_for_high_nccl_busbw=high)
        buckets, offset = [], 0
        for b in self.buckets:
            numel = _round_up(b.numel_unpadded, mult)
            shift = offset - b.offset
            params = tuple(
                ParamRange(p.name, p.shape, p.start + shift, p.end + shift, p.bucket) for p in b.params
            )
            buckets.append(Bucket(b.index, offset, numel, b.numel_unpadded, params))
            offset += numel
        return BufferGeometry(self.param_dtype, self.grad_dtype, dp_size, tuple(buckets), high)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (ints, strings, lists): safe to store in a manifest or a weights-only pickle."""
        return {
            "param_dtype": dtype_name(self.param_dtype),
            "grad_dtype": dtype_name(self.grad_dtype),
            "dp_size": self.dp_size,
            "pad_for_high_nccl_busbw": self.pad_for_high_nccl_busbw,
            "numel": [b.numel for b in self.buckets],
            "numel_unpadded": [b.numel_unpadded for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferGeometry:
        try:
            return buffer_from_sizes(
                (dtype_from_name(d["param_dtype"]), dtype_from_name(d["grad_dtype"])),
                d["numel"], d["numel_unpadded"], dp_size=d["dp_size"],
                pad_for_high_nccl_busbw=bool(d.get("pad_for_high_nccl_busbw", False)),
            )
        except (KeyError, TypeError) as exc:
            raise DecodeError(f"bad buffer geometry {d!r}: {exc!r}") from None


@dataclass(frozen=True)
class OptimizerGeometry:
    """The buffers of one DistributedOptimizer, in ``gbuf_idx`` order, and its per-param state keys."""

    buffers: tuple[BufferGeometry, ...]
    state_keys: tuple[str, ...] = ADAM_STATE_KEYS
    dp_size: int = field(init=False)

    def __post_init__(self) -> None:
        sizes = {b.dp_size for b in self.buffers}
        if len(sizes) > 1:
            raise LayoutMismatchError(f"buffers disagree on the DP size: {sorted(sizes)}")
        object.__setattr__(self, "dp_size", sizes.pop() if sizes else 1)
        # One string object per key name, as Megatron's literals are: pickle writes a string seen before as a
        # reference to it, so a chained optimizer's second dict must use the very objects of the first for the
        # file to be Megatron's bytes (keys read from JSON are new objects each time; found by a MoE trial).
        object.__setattr__(self, "state_keys", tuple(sys.intern(k) for k in self.state_keys))

    def with_dp_size(self, dp_size: int, *, pad_for_high_nccl_busbw: bool | None = None) -> OptimizerGeometry:
        return OptimizerGeometry(
            tuple(b.with_dp_size(dp_size, pad_for_high_nccl_busbw=pad_for_high_nccl_busbw)
                  for b in self.buffers),
            self.state_keys,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"state_keys": list(self.state_keys), "buffers": [b.to_dict() for b in self.buffers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptimizerGeometry:
        try:
            return cls(tuple(BufferGeometry.from_dict(b) for b in d["buffers"]), tuple(d["state_keys"]))
        except (KeyError, TypeError) as exc:
            raise DecodeError(f"bad optimizer geometry: {exc!r}") from None


# ------------------------------------------------------------------------------------------------------------
# constructors


def compute_buffer_geometry(
    params: Sequence[ParamSpec],
    *,
    dp_size: int,
    bucket_size: int | None,
    param_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
    pad_for_high_nccl_busbw: bool = False,
) -> BufferGeometry:
    """Lay out one buffer's params (given in ``named_parameters()`` order) with Megatron's rules (module doc).

    ``param_dtype`` defaults to the params' dtype, ``grad_dtype`` to ``param_dtype``.
    """
    _check_pos(dp_size, "dp_size")
    if bucket_size is not None:
        _check_pos(bucket_size, "bucket_size")
    if param_dtype is None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ConfigError(f"params of one buffer have several dtypes {dtypes}; pass param_dtype")
        param_dtype = dtypes.pop() if dtypes else torch.float32
    grad_dtype = param_dtype if grad_dtype is None else grad_dtype
    mult = bucket_pad_multiple(dp_size, pad_for_high_nccl_busbw=pad_for_high_nccl_busbw)

    buckets: list[Bucket] = []
    members: list[ParamRange] = []
    bucket_start = param_end = 0

    def close() -> None:
        nonlocal bucket_start, members
        unpadded = param_end - bucket_start
        numel = _round_up(unpadded, mult)
        buckets.append(Bucket(len(buckets), bucket_start, numel, unpadded, tuple(members)))
        bucket_start += numel
        members = []

    for p in reversed(params):
        if p.shared_embedding and members:
            close()
        start = _round_up(param_end, PARAM_START_ALIGN) if members else bucket_start
        param_end = start + p.numel
        members.append(ParamRange(p.name, tuple(p.shape), start, param_end, len(buckets)))
        if p.shared_embedding or (bucket_size is not None and param_end - bucket_start >= bucket_size):
            close()
    if members:
        close()
    return BufferGeometry(param_dtype, grad_dtype, dp_size, tuple(buckets), pad_for_high_nccl_busbw)


def compute_optimizer_geometry(
    params: Sequence[ParamSpec],
    *,
    dp_size: int,
    bucket_size: int | None,
    grad_dtype: torch.dtype | None = None,
    state_keys: tuple[str, ...] = ADAM_STATE_KEYS,
    pad_for_high_nccl_busbw: bool = False,
) -> OptimizerGeometry:
    """Split one model chunk's (dense or expert) params into buffers by dtype, in order of first appearance.

    ``grad_dtype``: torch.float32 for ``--accumulate-allreduce-grads-in-fp32``, None for "same as the param".
    For several model chunks (VPP), concatenate the chunks' buffers in chunk order.
    """
    groups: dict[DTypeKey, list[ParamSpec]] = {}
    for p in params:
        groups.setdefault((p.dtype, grad_dtype or p.dtype), []).append(p)
    return OptimizerGeometry(
        tuple(
            compute_buffer_geometry(ps, dp_size=dp_size, bucket_size=bucket_size, param_dtype=k[0],
                                    grad_dtype=k[1], pad_for_high_nccl_busbw=pad_for_high_nccl_busbw)
            for k, ps in groups.items()
        ),
        state_keys,
    )


def buffer_from_sizes(
    dtype_key: DTypeKey,
    numel: Sequence[int],
    numel_unpadded: Sequence[int],
    *,
    dp_size: int,
    pad_for_high_nccl_busbw: bool = False,
) -> BufferGeometry:
    """A buffer given as its buckets' ``N_b`` (``bucket.grad_data.numel()``) and ``U_b``
    (``bucket.numel_unpadded``)."""
    if len(numel) != len(numel_unpadded):
        raise LayoutMismatchError(f"{len(numel)} padded sizes but {len(numel_unpadded)} unpadded sizes")
    buckets, offset = [], 0
    for i, (n, u) in enumerate(zip(numel, numel_unpadded, strict=True)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, u)):
            raise DecodeError(f"bucket {i}: sizes must be integers, got {n!r}, {u!r}")
        buckets.append(Bucket(i, offset, n, u))
        offset += n
    return BufferGeometry(dtype_key[0], dtype_key[1], dp_size, tuple(buckets), pad_for_high_nccl_busbw)


def geometry_from_sizes(
    buffers: Sequence[tuple[DTypeKey, Sequence[int], Sequence[int]]],
    *,
    dp_size: int,
    state_keys: tuple[str, ...] = ADAM_STATE_KEYS,
    pad_for_high_nccl_busbw: bool = False,
) -> OptimizerGeometry:
    """An optimizer given as ``[(dtype_key, N_b list, U_b list), ...]`` per buffer in ``gbuf_idx`` order:
    what a live DistributedOptimizer's buffers report."""
    return OptimizerGeometry(
        tuple(
            buffer_from_sizes(k, n, u, dp_size=dp_size, pad_for_high_nccl_busbw=pad_for_high_nccl_busbw)
            for k, n, u in buffers
        ),
        tuple(state_keys),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise DecodeError(f"unknown torch dtype {name!r}")
    return value


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_pos(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what}: expected a positive integer, got {value!r}")
