"""The Megatron state the adapter saves and restores, duck-typed on Megatron's own objects (the attributes
:mod:`.adapter`'s docstring lists): the ``model_optim_rng`` dict as ``generate_state_dict`` builds it, the rank's
distributed-optimizer shards, the RNG state, and the restore of all of it. Shared by the ``torch`` path
(:mod:`.adapter`) and the ``torch_dist`` path (:mod:`.adapter_dist`); nothing here imports Megatron at module level."""

from __future__ import annotations

import logging
import random
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, LayoutMismatchError
from . import rank_shard
from .distrib_optim import BUCKETS_COALESCED, shard_key, split_state, sub_optimizer_states
from .geometry import ADAM_STATE_KEYS, OptimizerGeometry, geometry_from_sizes
from .naming import MegatronTopology

log = logging.getLogger("tiered_ckpt.megatron.adapter")  # one logger name for the adapter's messages
MODEL_ITEM, OPTIM_ITEM = "model_optim_rng", "distrib_optim"
CHECKPOINT_VERSION = 3.0
_WRAPPERS = {"DistributedDataParallel", "Float16Module", "FullyShardedDataParallel", "TorchFullyShardedDataParallel",
             "MegatronFSDP"}

# ------------------------------------------------------------------------------------------------------------
# Megatron's objects, duck-typed


def unwrap(chunk: Any) -> Any:
    """Megatron's ``unwrap_model`` for one chunk: strip DDP / Float16Module / FSDP wrappers."""
    while type(chunk).__name__ in _WRAPPERS and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers of ``optimizer`` in ChainedOptimizer order ([] when it is not distributed)."""
    if optimizer is None:
        return []
    subs = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    dist = [o for o in subs if hasattr(o, "gbuf_ranges")]
    if dist and len(dist) != len(subs):
        raise ConfigError("a ChainedOptimizer mixing distributed and non-distributed optimizers is not supported")
    return dist


def _state_keys(opt: Any) -> tuple[str, ...]:
    keys = getattr(opt, "optimizer_state_keys", None)  # ('exp_avg',) for Lion; Adam's by default
    return ("param", *keys) if keys else ADAM_STATE_KEYS


def live_geometry(opt: Any, dp_size: int) -> OptimizerGeometry:
    """A DistributedOptimizer's bucket geometry, from its buffers."""
    ddp_config = getattr(opt, "ddp_config", None)
    sizes = [((b.param_dtype, b.grad_dtype), [k.grad_data.numel() for k in b.buckets],
              [k.numel_unpadded for k in b.buckets]) for b in opt.buffers]
    return geometry_from_sizes(
        sizes,
        dp_size=dp_size, state_keys=_state_keys(opt),
        pad_for_high_nccl_busbw=bool(getattr(ddp_config, "pad_buckets_for_high_nccl_busbw", False)))


def _kind(opt: Any) -> str:
    groups = getattr(getattr(opt, "optimizer", None), "param_groups", None) or []
    return "expert" if any(g.get("is_expert_parallel") for g in groups) else "dense"


def live_group_ranks(group: Any) -> list[int] | None:
    ranks = getattr(group, "ranks", None)
    if ranks is not None:
        return list(ranks)
    if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return list(torch.distributed.get_process_group_ranks(group))
    return None


def dp_layout(opt: Any, topology: MegatronTopology, rank: int) -> tuple[str, list[int]]:
    """(kind, DP group by DP rank) of a DistributedOptimizer on ``rank``, checked against its live group."""
    kind = _kind(opt)
    group = rank_shard.dp_group(topology, rank, kind)
    live = live_group_ranks(getattr(opt, "data_parallel_group", None))
    if live is not None and live != group:
        raise LayoutMismatchError(f"rank {rank}: the {kind} optimizer's DP group is {live}, Megatron's with the "
                                  f"engine's layout {rank_shard.topology_dict(topology)} would be {group}: give the "
                                  "engine the job's ParallelLayout (sizes and rank order)")
    return kind, group


def _param_maps(opt: Any, geo: OptimizerGeometry) -> list[list[Mapping[Any, Any]]]:
    """``gbuf_ranges`` as [buffer][bucket] -> param_map, checked against the buffers."""
    out = []
    if len(opt.gbuf_ranges) != len(geo.buffers):
        raise LayoutMismatchError(f"{len(opt.gbuf_ranges)} gbuf_ranges for {len(geo.buffers)} buffers")
    for g, by_dtype in enumerate(opt.gbuf_ranges):
        if len(by_dtype) != 1:
            raise LayoutMismatchError(f"buffer {g}: {len(by_dtype)} dtype entries in gbuf_ranges, expected one")
        (buckets,) = by_dtype.values()
        if len(buckets) != len(geo.buffers[g].buckets):
            raise LayoutMismatchError(f"buffer {g}: {len(buckets)} bucket ranges for {len(geo.buffers[g].buckets)} "
                                      "buckets")
        out.append([b["param_map"] for b in buckets])
    return out


# Per DistributedOptimizer: the local-shard tensors of its last save, reused while its geometry is unchanged, so a
# warm save copies into memory that is already faulted in (a fresh 3 x N/DP fp32 per save costs page faults).
_shard_buffers: weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, torch.Tensor]]] = weakref.WeakKeyDictionary()


def local_shards(opt: Any, geo: OptimizerGeometry, *, reuse: bool = False,
                 fill: bool = True) -> dict[str, torch.Tensor]:
    """This rank's contiguous local shards of one DistributedOptimizer (docs/megatron-format.md, "Local shards: what
    each DP rank holds"): fp32 zeros of ``N_b / DP`` per bucket and state key, each param's main param and moments
    copied in at ``gbuf_local``.

    ``reuse``: the same tensors as the previous call for ``opt`` (each call overwrites them: the engine copies
    them into its slot before ``save`` returns). ``fill=False``: zeros only, for sizing slots before the
    optimizer has state (before its first step); with ``reuse``, the first save then fills those tensors."""
    sig = [(b.dtype_key, [k.numel for k in b.buckets]) for b in geo.buffers], geo.state_keys
    cached = _shard_buffers.get(opt) if reuse else None
    out: dict[str, torch.Tensor] = cached[1] if cached is not None and cached[0] == sig else {}
    fresh = not out
    for g, buckets in enumerate(_param_maps(opt, geo)):
        buf = geo.buffers[g]
        for b, param_map in enumerate(buckets):
            if fresh:
                for k in geo.state_keys:
                    out[shard_key(g, b, k)] = torch.zeros(buf.shard_numel(b), dtype=torch.float32)
            if not fill:
                continue
            local = {k: out[shard_key(g, b, k)] for k in geo.state_keys}
            for model_param, ranges in param_map.items():
                tensors = opt._get_main_param_and_optimizer_states(model_param)
                start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                for k in geo.state_keys:
                    local[k][start:end].copy_(tensors[k].detach().reshape(-1))
    if reuse and fresh:
        _shard_buffers[opt] = (sig, out)
    return out


def apply_local_shards(opt: Any, geo: OptimizerGeometry, shards: Mapping[str, Any]) -> None:
    """The reverse of :func:`local_shards`: every param's slice at ``gbuf_local`` into its main param and moments."""
    for g, buckets in enumerate(_param_maps(opt, geo)):
        for b, param_map in enumerate(buckets):
            local = {k: shards[shard_key(g, b, k)] for k in geo.state_keys}
            for model_param, ranges in param_map.items():
                start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                opt._set_main_param_and_optimizer_states(model_param, {k: local[k][start:end] for k in local})


# ------------------------------------------------------------------------------------------------------------
# building the items


def rank_shard_item(optimizer: Any, topology: MegatronTopology, rank: int, *, reuse: bool = False,
                    fill: bool = True) -> dict[str, Any] | None:
    """The ``distrib_optim`` item of this rank (None when the optimizer is not distributed); ``reuse`` and
    ``fill`` as in :func:`local_shards`."""
    subs = []
    for opt in distributed_optimizers(optimizer):
        kind, group = dp_layout(opt, topology, rank)
        geo = live_geometry(opt, len(group))
        shards = local_shards(opt, geo, reuse=reuse, fill=fill)
        subs.append(rank_shard.SubOptimizerShard(geo, group.index(rank), tuple(group), shards, kind))
    return rank_shard.build(rank=rank, topology=topology, optimizers=subs) if subs else None


def rng_state(args: Any, rng_tracker: Any) -> list[dict[str, Any]]:
    """Megatron's ``get_rng_state`` for this rank (one element: no all-gather over DP here)."""
    state: dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    state["rng_tracker_states"] = rng_tracker.get_states() if rng_tracker is not None else {}
    if getattr(args, "data_parallel_random_init", False):
        log.warning("data_parallel_random_init: only this rank's RNG state is saved (no gather over DP)")
    return [state]


def model_optim_rng_item(iteration: int, model: Sequence[Any], optimizer: Any, opt_param_scheduler: Any,
                         num_floating_point_operations_so_far: float, args: Any, rng_tracker: Any) -> dict[str, Any]:
    """What Megatron's ``generate_state_dict`` builds, in its key order (docs/megatron-format.md,
    "model_optim_rng.pt")."""
    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    chunks = [unwrap(c) for c in model]
    if len(chunks) == 1:
        state["model"] = chunks[0].state_dict_for_save_checkpoint()
    else:
        for i, chunk in enumerate(chunks):
            state[f"model{i}"] = chunk.state_dict_for_save_checkpoint()
    if not getattr(args, "no_save_optim", False):
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not getattr(args, "no_save_rng", False):
        state["rng_state"] = rng_state(args, rng_tracker)
    state["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    return state


def restore(state: dict[str, Any], items: Mapping[str, Any], chunks: list[Any], optimizer: Any,
           opt_param_scheduler: Any, strict: bool, skip: bool, args: Any, rng_tracker: Any, coords: Any, *,
           where: str, distrib_optim_item: bool = True, rng: bool = True) -> tuple[int, float]:
    """Megatron's restore of one rank from its ``model_optim_rng`` dict and ``distrib_optim`` item.
    ``distrib_optim_item``: a DistributedOptimizer's state comes in that item (``torch`` format), so a checkpoint
    without it is refused; False for ``torch_dist``, whose optimizer state is in ``state`` itself. ``rng``: False
    where the caller left the RNG state out on purpose (``torch_dist`` at another TP/PP, said there)."""
    finetune = bool(getattr(args, "finetune", False))
    if "iteration" not in state and "total_iters" not in state:
        raise LayoutMismatchError(f"{where}: model_optim_rng has no iteration (Megatron stops here too)")
    iteration = 0 if finetune else int(state.get("iteration", state.get("total_iters")))
    if not skip:
        if len(chunks) == 1:
            _load_chunk(chunks[0], state["model"], strict, where)
        else:
            for i, chunk in enumerate(chunks):
                if f"model{i}" in state:
                    _load_chunk(chunk, state[f"model{i}"], strict, f"{where} model{i}")
    ckpt_args = state.get("args")
    if ckpt_args is not None and args is not None and not finetune:
        _megatron_hook("check_checkpoint_args", ckpt_args)  # Megatron's own checks, where megatron.training is
        for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
            setattr(args, name, getattr(ckpt_args, name, 0))
        _update_num_microbatches(args.consumed_train_samples)
    if not (finetune or getattr(args, "no_load_optim", False)):
        if optimizer is not None:
            if distrib_optim_item and OPTIM_ITEM not in items and distributed_optimizers(optimizer):
                # Megatron-LM stops here too (distrib_optim.pt not found). Going on would train with fresh
                # optimizer moments, and, in bf16/fp16, fp32 main params that never saw the loaded weights.
                if "optimizer" not in state:  # Megatron leaves it out with --no-save-optim (or no optimizer)
                    what, other = ("holds no optimizer state (saved with --no-save-optim, or by a job without an "
                                   "optimizer)", "saved with its optimizer state")
                else:
                    what, other = ("has no distributed-optimizer state (Megatron's distrib_optim.pt) for this job's "
                                   "DistributedOptimizer", "saved with --use-distributed-optimizer")
                raise LayoutMismatchError(
                    f"{where}: the checkpoint {what}. Point --load at a checkpoint {other}, or set "
                    "args.no_load_optim (--no-load-optim) to start the optimizer afresh from the loaded weights")
            if "optimizer" in state and not skip:
                optimizer.load_state_dict(state["optimizer"])
            if OPTIM_ITEM in items:
                try:
                    apply_distrib_optim(optimizer, items[OPTIM_ITEM], coords)
                except LayoutMismatchError as exc:  # which step, from where, and the likely cause (a user's trial)
                    raise LayoutMismatchError(
                        f"{where}: {exc}. A checkpoint of another model: if this job is a new one, give it a "
                        "run_id of its own and an empty checkpoint directory (an earlier run's snapshots with this "
                        "run_id are drained into it at start-up: remove those steps)") from None
        if opt_param_scheduler is not None:
            sched = state.get("opt_param_scheduler", state.get("lr_scheduler"))
            if sched is not None:
                opt_param_scheduler.load_state_dict(sched)
    elif optimizer is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
        # The optimizer's fp32 main params must follow the loaded model weights (Megatron does the same here),
        # or the first step would put back the weights the job started with.
        optimizer.reload_model_params()
    if rng and not (finetune or getattr(args, "no_load_rng", False)):
        if "rng_state" in state:
            _set_rng(state["rng_state"], args, coords, rng_tracker)
        else:  # Megatron-LM stops here ("Unable to load rng state"); the weights and optimizer are sound
            log.warning("%s: the checkpoint holds no RNG state (saved with --no-save-rng): this job keeps its own "
                        "fresh RNG state. Set args.no_load_rng (--no-load-rng) to say that is wanted (Megatron-LM "
                        "refuses such a checkpoint without it)", where)
    _megatron_hook("set_loaded_iteration", iteration)  # what training.py's get_loaded_iteration() reads
    return iteration, state.get("num_floating_point_operations_so_far", 0)


def _megatron_hook(name: str, *args: Any) -> None:
    """Call ``megatron.training.checkpointing.<name>`` where Megatron-LM's training package is importable (in a
    real Megatron job); without it (megatron-core alone) there is nothing of Megatron's to keep in step."""
    try:
        from megatron.training import checkpointing  # type: ignore[import-not-found]
    except ImportError:
        return
    func = getattr(checkpointing, name, None)
    if func is not None:
        func(*args)


def _update_num_microbatches(consumed_samples: int) -> None:
    """Megatron's batch-size ramp-up follows the samples consumed so far (when its calculator is set up)."""
    try:
        from megatron.core import num_microbatches_calculator as calc  # type: ignore[import-not-found]
    except ImportError:
        return
    if getattr(calc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is not None:
        calc.update_num_microbatches(consumed_samples=consumed_samples, verbose=True)


def _load_chunk(chunk: Any, sd: Any, strict: bool, where: str) -> None:
    """Megatron's model load: strict first; on failure, non-strict with what did not match logged."""
    try:
        chunk.load_state_dict(sd, strict=strict)
        return
    except Exception as exc:
        if not strict:
            raise
        first = exc
    result = chunk.load_state_dict(sd, strict=False)
    log.warning("%s: the strict model load failed (%s); loaded non-strictly as Megatron does: %s", where,
                str(first).splitlines()[0] if str(first) else type(first).__name__, result)


def apply_distrib_optim(optimizer: Any, obj: Any, coords: Any) -> None:
    """Put a loaded ``distrib_optim`` item into the DistributedOptimizer(s): our rank file, Megatron's gathered
    file (split here for this rank), or DLRover's per-param fragments (same DP only)."""
    topology = rank_shard.as_topology(coords.layout)
    opts = distributed_optimizers(optimizer)
    if not opts:
        raise ConfigError("the checkpoint holds distributed-optimizer state but the optimizer is not distributed")
    if isinstance(obj, Mapping) and obj.get("format") == rank_shard.FORMAT:
        parsed = rank_shard.parse(obj, where=f"rank {coords.rank}'s distrib_optim")
        if len(parsed.optimizers) != len(opts):
            raise LayoutMismatchError(f"the checkpoint has {len(parsed.optimizers)} optimizers, the job {len(opts)}")
        for i, (opt, sub) in enumerate(zip(opts, parsed.optimizers, strict=True)):
            kind, group = dp_layout(opt, topology, coords.rank)
            geo = live_geometry(opt, len(group))
            _check_geometry(sub.geometry, geo, sub.kind, kind, i)
            if sub.dp_size != len(group) or sub.dp_rank != group.index(coords.rank):
                raise LayoutMismatchError(f"optimizer {i}: the shards are DP rank {sub.dp_rank} of {sub.dp_size}, this "
                                          f"rank is {group.index(coords.rank)} of {len(group)} (re-split with "
                                          "tiered-ckpt convert --dp)")
            apply_local_shards(opt, geo, sub.shards)
    elif isinstance(obj, list) or (isinstance(obj, Mapping) and BUCKETS_COALESCED in obj):
        states = sub_optimizer_states(obj)
        for i, (opt, state) in enumerate(zip(opts, states, strict=True)):
            if state is None:
                raise LayoutMismatchError(f"optimizer {i}: the gathered file holds no state for it")
            _, group = dp_layout(opt, topology, coords.rank)
            geo = live_geometry(opt, len(group))
            apply_local_shards(opt, geo, split_state(state, geo, group.index(coords.rank)))
    elif isinstance(obj, Mapping):
        _apply_dlrover(opts, obj)
    else:
        raise LayoutMismatchError(f"unrecognised distrib_optim item: {type(obj).__name__}")


def _check_geometry(saved: OptimizerGeometry, live: OptimizerGeometry, saved_kind: str, kind: str, i: int) -> None:
    def sig(g: OptimizerGeometry) -> list[tuple]:
        return [(b.dtype_key, [k.numel_unpadded for k in b.buckets]) for b in g.buffers]

    if saved_kind != kind or sig(saved) != sig(live) or saved.state_keys != live.state_keys:
        raise LayoutMismatchError(f"optimizer {i}: the checkpoint's {saved_kind} buckets {sig(saved)!s:.200} differ "
                                  f"from the job's {kind} buckets {sig(live)!s:.200} (model, bucket size, dtypes or "
                                  "parallel layout changed)")


def _apply_dlrover(opts: list[Any], obj: Mapping[Any, Any]) -> None:
    """DLRover's ``{bucket: {group_index: {group_order: {"param": .., "exp_avg": .., ...}}}}`` (one optimizer)."""
    if len(opts) != 1:
        raise LayoutMismatchError("DLRover's optimizer files hold one DistributedOptimizer; this job has a chained one")
    opt = opts[0]
    by_index = {v: k for k, v in opt.model_param_group_index_map.items()}
    keys = _state_keys(opt)
    for groups in obj.values():
        for gi, orders in groups.items():
            for go, tensors in orders.items():
                opt._set_main_param_and_optimizer_states(by_index[(gi, go)], {k: tensors[k] for k in keys})


def _set_rng(states: Any, args: Any, coords: Any, rng_tracker: Any) -> None:
    """Megatron's RNG restore: element ``[dp_rank]`` with ``data_parallel_random_init``, else ``[0]``."""
    if isinstance(states, list):
        state = states[coords.dp] if getattr(args, "data_parallel_random_init", False) and len(states) > 1 \
            else states[0]
    else:
        state = states
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker_states = state.get("rng_tracker_states")
    if rng_tracker is not None:
        if not tracker_states:
            raise LayoutMismatchError("the checkpoint has no RNG tracker states (Megatron stops here too)")
        rng_tracker.set_states(tracker_states)
