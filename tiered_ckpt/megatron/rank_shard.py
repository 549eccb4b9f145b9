"""The ``rank_sharded`` layout's per-rank file, ``iter_XXXXXXX/rank_RRRRR/distrib_optim.pt``.

It holds what one rank's DistributedOptimizer(s) hold, as Megatron holds it, plus everything needed to merge
the files of a DP group into Megatron's ``distrib_optim.pt`` with no knowledge of the model::

    {"format": "tiered_ckpt.megatron.rank_shard", "version": 1,
     "rank": 5,                                              # global rank
     "coords": {"tp": 1, "pp": 0, "dp": 1, "ep": 0, "cp": 0},  # this rank's coordinates
     "topology": {"tp": 2, "pp": 2, "dp": 2, "ep": 1, "cp": 1, "order": "tp-cp-ep-dp-pp"},
     "optimizers": [                                         # one per DistributedOptimizer, ChainedOptimizer order
       {"kind": "dense",                                     # "dense" or "expert": which DP group shards it
        "dp_rank": 1, "dp_size": 2,
        "group": [1, 5],                                     # global ranks of that DP group, by DP rank
        "state_keys": ["param", "exp_avg", "exp_avg_sq"],
        "buffers": [{"param_dtype": torch.bfloat16, "grad_dtype": torch.float32,
                     "numel": [N_0, N_1, ...],               # padded bucket sizes (bucket.grad_data.numel())
                     "numel_unpadded": [U_0, U_1, ...],      # bucket.numel_unpadded
                     "pad_for_high_nccl_busbw": False}],
        "shards": {"gbuf0/bucket0/param": fp32 [N_0/dp_size], "gbuf0/bucket0/exp_avg": ..., ...}}]}

``shards`` are the contiguous local shards of Megatron's ``get_parameter_state_dp_zero`` before its gather:
element ``i`` of ``gbuf<g>/bucket<b>/<key>`` is element ``dp_rank * N_b / dp_size + i`` of bucket ``b`` (zeros in
padding and alignment gaps), ordered by buffer, bucket, state key. Only tensors, dicts, lists, ints, bools,
strings and ``torch.dtype`` appear, so ``torch.load(weights_only=True)`` reads it with no allow-list.

Merging (:mod:`.merge`): the files whose ``group`` is the same are concatenated bucket by bucket in DP-rank order,
each bucket cut to ``U_b`` (docs/megatron-format.md, "Merging the DP shards into the file"); the result goes to the
``mp_rank_*`` directory of ``group[0]``.

DP groups (:func:`dp_group`), as Megatron forms them with its default order: a *dense* optimizer is sharded over
Megatron's data-parallel group with context parallelism, i.e. the ranks that differ only in (cp, ep, dp) (EP is
carved out of DP); an *expert* optimizer over the expert-data-parallel group, the ranks that differ only in
(cp, dp). The DP rank is the position in the group sorted by global rank. (With CP > 1 and EP > 1 at once,
Megatron's expert rank generator is not checked here.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DecodeError
from .distrib_optim import shard_key
from .geometry import BufferGeometry, OptimizerGeometry, buffer_from_sizes
from .lazy_torch import is_tensor_like
from .naming import MegatronTopology

FORMAT = "tiered_ckpt.megatron.rank_shard"
VERSION = 1
_DIMS = ("tp", "pp", "dp", "ep", "cp")
KINDS = {"dense": ("cp", "ep", "dp"), "expert": ("cp", "dp")}


def dp_group(topo: MegatronTopology, rank: int, kind: str) -> list[int]:
    """The global ranks of ``rank``'s DP group for an optimizer of ``kind``, by DP rank."""
    try:
        dims = KINDS[kind]
    except KeyError:
        raise DecodeError(f"unknown optimizer kind {kind!r} (expected one of {sorted(KINDS)})") from None
    return topo.group(rank, list(dims))


@dataclass(frozen=True)
class SubOptimizerShard:
    """One DistributedOptimizer's part on one rank."""

    geometry: OptimizerGeometry  # at this optimizer's DP size
    dp_rank: int
    group: tuple[int, ...]  # global ranks of the DP group, by DP rank
    shards: Mapping[str, Any]  # "gbuf<g>/bucket<b>/<key>" -> 1-D tensor (or StreamedTensor/LazyTensor)
    kind: str = "dense"

    @property
    def dp_size(self) -> int:
        return self.geometry.dp_size

    def keys(self) -> list[str]:
        """Shard keys in file order: buffer, bucket, state key."""
        return [shard_key(g, b, k) for g, buf in enumerate(self.geometry.buffers)
                for b in range(len(buf.buckets)) for k in self.geometry.state_keys]


@dataclass(frozen=True)
class RankShard:
    rank: int
    coords: dict[str, int]
    topology: MegatronTopology
    optimizers: tuple[SubOptimizerShard, ...]

    @property
    def mp_dir(self) -> str:
        """This rank's ``mp_rank_*`` directory."""
        return self.topology.rank_dir(self.rank)

    def owner_dir(self, index: int) -> str:
        """The ``mp_rank_*`` directory where sub-optimizer ``index``'s merged state goes (its DP rank 0's)."""
        return self.topology.rank_dir(self.optimizers[index].group[0])


def build(
    *,
    rank: int,
    topology: Any,
    optimizers: Sequence[SubOptimizerShard],
) -> dict[str, Any]:
    """The file's content for ``rank`` (``topology``: a MegatronTopology, a ParallelLayout or their dict)."""
    topo = as_topology(topology)
    pos = topo.position(rank)
    out_opts = []
    for i, opt in enumerate(optimizers):
        _check_sub(opt, rank, f"rank {rank}, optimizer {i}")
        shards = {}
        for k in opt.keys():
            if k not in opt.shards:
                raise DecodeError(f"rank {rank}, optimizer {i}: no local shard {k!r}")
            shards[k] = opt.shards[k]
        out_opts.append({
            "kind": opt.kind,
            "dp_rank": opt.dp_rank,
            "dp_size": opt.dp_size,
            "group": list(opt.group),
            "state_keys": list(opt.geometry.state_keys),
            "buffers": [_buffer_dict(b) for b in opt.geometry.buffers],
            "shards": shards,
        })
    return {
        "format": FORMAT,
        "version": VERSION,
        "rank": rank,
        "coords": {d: getattr(pos, d) for d in _DIMS},
        "topology": topology_dict(topo),
        "optimizers": out_opts,
    }


def parse(obj: Any, *, where: str) -> RankShard:
    """Check a loaded file (tensors may be :class:`~.lazy_torch.LazyTensor`); errors name ``where``."""
    def fail(msg: str) -> DecodeError:
        return DecodeError(f"{where}: not a valid rank_sharded distrib_optim file: {msg}")

    if not isinstance(obj, Mapping):
        raise fail(f"expected a dict, got {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise fail(f"format is {obj.get('format')!r}, expected {FORMAT!r} (a DLRover-written file?)")
    if obj.get("version") != VERSION:
        raise fail(f"version {obj.get('version')!r}, this tiered_ckpt reads version {VERSION}")
    rank = _int(obj, "rank", fail)
    try:
        topo = as_topology(obj.get("topology"))
    except (TypeError, ValueError) as exc:
        raise fail(f"topology: {exc}") from None
    coords = obj.get("coords")
    if not isinstance(coords, Mapping) or any(not isinstance(coords.get(d), int) for d in _DIMS):
        raise fail(f"coords: expected ints for {_DIMS}, got {coords!r:.100}")
    if rank >= topo.world_size:
        raise fail(f"rank {rank} is outside the world of {topo.world_size} of its topology")
    pos = topo.position(rank)
    if {d: coords[d] for d in _DIMS} != {d: getattr(pos, d) for d in _DIMS}:
        raise fail(f"coords {dict(coords)} disagree with rank {rank} in topology {topology_dict(topo)}")
    opts = obj.get("optimizers")
    if not isinstance(opts, list) or not opts:
        raise fail("optimizers: expected a non-empty list")
    parsed = []
    for i, o in enumerate(opts):
        if not isinstance(o, Mapping):
            raise fail(f"optimizers[{i}]: expected a dict")
        sub_fail = (lambda m, i=i: fail(f"optimizers[{i}]: {m}"))  # noqa: E731
        kind = o.get("kind")
        if kind not in KINDS:
            raise sub_fail(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
        dp_rank, dp_size = _int(o, "dp_rank", sub_fail), _int(o, "dp_size", sub_fail)
        group = o.get("group")
        keys = o.get("state_keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise sub_fail("state_keys: expected a list of strings")
        bufs = o.get("buffers")
        if not isinstance(bufs, list):
            raise sub_fail("buffers: expected a list")
        try:
            geometry = OptimizerGeometry(tuple(_buffer_from_dict(b, dp_size) for b in bufs), tuple(keys))
        except Exception as exc:  # DecodeError, LayoutMismatchError, KeyError, TypeError: all malformed
            raise sub_fail(f"buffers: {exc}") from None
        if not isinstance(group, list) or not all(isinstance(r, int) for r in group):
            raise sub_fail("group: expected a list of global ranks")
        shards = o.get("shards")
        if not isinstance(shards, Mapping):
            raise sub_fail("shards: expected a dict")
        sub = SubOptimizerShard(geometry, dp_rank, tuple(group), dict(shards), kind)
        try:
            _check_sub(sub, rank, "")
        except DecodeError as exc:
            raise sub_fail(str(exc).lstrip(": ")) from None
        _check_shards(sub, sub_fail)
        parsed.append(sub)
    return RankShard(rank, {d: coords[d] for d in _DIMS}, topo, tuple(parsed))


def _check_sub(opt: SubOptimizerShard, rank: int, where: str) -> None:
    if opt.kind not in KINDS:
        raise DecodeError(f"{where}: unknown optimizer kind {opt.kind!r}")
    if not 0 <= opt.dp_rank < opt.dp_size or len(opt.group) != opt.dp_size:
        raise DecodeError(f"{where}: dp_rank {opt.dp_rank} with a DP group of {len(opt.group)} ranks "
                          f"and dp_size {opt.dp_size}")
    if opt.group[opt.dp_rank] != rank or len(set(opt.group)) != len(opt.group):
        raise DecodeError(f"{where}: group {list(opt.group)} does not hold rank {rank} at DP rank {opt.dp_rank}")


def _check_shards(sub: SubOptimizerShard, fail: Any) -> None:
    want = sub.keys()
    got = list(sub.shards)
    if sorted(got) != sorted(want):
        missing, extra = sorted(set(want) - set(got))[:4], sorted(set(got) - set(want))[:4]
        raise fail(f"shards: keys do not match the geometry (missing {missing}, unexpected {extra})")
    for g, buf in enumerate(sub.geometry.buffers):
        for b in range(len(buf.buckets)):
            n = buf.shard_numel(b)
            for key in sub.geometry.state_keys:
                t = sub.shards[shard_key(g, b, key)]
                if not is_tensor_like(t) or t.dim() != 1 or t.numel() != n or not t.dtype.is_floating_point:
                    found = f"{t.dtype} {tuple(t.shape)}" if is_tensor_like(t) else type(t).__name__
                    raise fail(f"shards[{shard_key(g, b, key)!r}] is {found}, expected a float ({n},) tensor "
                               "(N_b / dp_size)")


def _buffer_dict(b: BufferGeometry) -> dict[str, Any]:
    return {
        "param_dtype": b.param_dtype,
        "grad_dtype": b.grad_dtype,
        "numel": [x.numel for x in b.buckets],
        "numel_unpadded": [x.numel_unpadded for x in b.buckets],
        "pad_for_high_nccl_busbw": b.pad_for_high_nccl_busbw,
    }


def _buffer_from_dict(d: Any, dp_size: int) -> BufferGeometry:
    if not isinstance(d, Mapping):
        raise DecodeError("expected a dict per buffer")
    pdt, gdt = d.get("param_dtype"), d.get("grad_dtype")
    if not isinstance(pdt, torch.dtype) or not isinstance(gdt, torch.dtype):
        raise DecodeError(f"param_dtype/grad_dtype must be torch dtypes, got {pdt!r}, {gdt!r}")
    numel, unpadded = d.get("numel"), d.get("numel_unpadded")
    if not isinstance(numel, list) or not isinstance(unpadded, list):
        raise DecodeError("numel and numel_unpadded must be lists")
    return buffer_from_sizes((pdt, gdt), numel, unpadded, dp_size=dp_size,
                             pad_for_high_nccl_busbw=bool(d.get("pad_for_high_nccl_busbw", False)))


def _int(d: Mapping, key: str, fail: Any) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise fail(f"{key}: expected a non-negative int, got {v!r}")
    return v


def topology_dict(topo: MegatronTopology) -> dict[str, Any]:
    return {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "ep": topo.ep, "cp": topo.cp, "order": topo.order}


def as_topology(value: Any) -> MegatronTopology:
    """A :class:`MegatronTopology` from itself, a ParallelLayout, or a dict with ``tp, pp, dp, ep, cp[, order]``.
    """
    if isinstance(value, MegatronTopology):
        return value
    if isinstance(value, Mapping):
        fields = {d: value[d] for d in _DIMS if d in value}
        if "order" in value:
            fields["order"] = value["order"]
        return MegatronTopology(**fields)
    if value is not None and all(hasattr(value, d) for d in _DIMS):
        return MegatronTopology.from_layout(value)
    raise TypeError(f"expected a topology (MegatronTopology, ParallelLayout or dict), got {value!r:.80}")

