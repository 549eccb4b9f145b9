"""Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``, through a :class:`~tiered_ckpt.CheckpointEngine`.

Drop-in for the legacy (``--ckpt-format torch``) path of ``megatron.training.checkpointing``: same positional
arguments, same state (spec 1.3), plus the engine. Megatron's objects are used through the attributes Megatron
itself uses, so nothing here imports Megatron:

* model: a list of chunks (or one); ``state_dict_for_save_checkpoint()`` / ``load_state_dict(sd, strict)`` on the
  chunk with DDP / Float16Module wrappers (``.module``) removed, as Megatron's ``unwrap_model`` does;
* optimizer: a ChainedOptimizer (``chained_optimizers``) of DistributedOptimizers, or one; ``state_dict()`` /
  ``load_state_dict()``; per DistributedOptimizer ``buffers[g].buckets[b]`` (``grad_data.numel()`` = N_b,
  ``numel_unpadded`` = U_b, buffer ``param_dtype``/``grad_dtype``), ``gbuf_ranges[g][dtype][b]["param_map"]``
  (model param -> ranges, ``"gbuf_local"``), ``_get_main_param_and_optimizer_states(param)`` and
  ``_set_main_param_and_optimizer_states(param, tensors)``; ``data_parallel_group`` (checked when its ranks are
  known); an optimizer without ``gbuf_ranges`` keeps its state in ``model_optim_rng.pt`` as in Megatron;
* scheduler: ``state_dict()`` / ``load_state_dict()``; RNG tracker: ``get_states()`` / ``set_states()``;
* ``args``: Megatron's ``argparse.Namespace`` (``get_args()`` when Megatron is importable and none is given).

Saving never gathers: every rank saves its own optimizer shards (``distrib_optim``, the :mod:`.rank_shard` dict,
built exactly as Megatron's ``get_parameter_state_dp_zero`` builds its local shards before the gather) and DP
rank 0 of each model-parallel group the ``model_optim_rng`` dict. The engine's layout decides the files.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, LayoutMismatchError
from . import rank_shard
from .distrib_optim import BUCKETS_COALESCED, shard_key, split_state, sub_optimizer_states
from .geometry import ADAM_STATE_KEYS, OptimizerGeometry, geometry_from_sizes
from .naming import MegatronTopology

log = logging.getLogger(__name__)
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


def _live_group_ranks(group: Any) -> list[int] | None:
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
    live = _live_group_ranks(getattr(opt, "data_parallel_group", None))
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


def local_shards(opt: Any, geo: OptimizerGeometry) -> dict[str, torch.Tensor]:
    """This rank's contiguous local shards of one DistributedOptimizer (spec 2.2 step 1): fp32 zeros of
    ``N_b / DP`` per bucket and state key, each param's main param and moments copied in at ``gbuf_local``."""
    out: dict[str, torch.Tensor] = {}
    for g, buckets in enumerate(_param_maps(opt, geo)):
        buf = geo.buffers[g]
        for b, param_map in enumerate(buckets):
            local = {k: torch.zeros(buf.shard_numel(b), dtype=torch.float32) for k in geo.state_keys}
            for model_param, ranges in param_map.items():
                tensors = opt._get_main_param_and_optimizer_states(model_param)
                start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                for k in geo.state_keys:
                    local[k][start:end].copy_(tensors[k].detach().reshape(-1))
            for k in geo.state_keys:
                out[shard_key(g, b, k)] = local[k]
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


def rank_shard_item(optimizer: Any, topology: MegatronTopology, rank: int) -> dict[str, Any] | None:
    """The ``distrib_optim`` item of this rank (None when the optimizer is not distributed)."""
    subs = []
    for opt in distributed_optimizers(optimizer):
        kind, group = dp_layout(opt, topology, rank)
        geo = live_geometry(opt, len(group))
        subs.append(rank_shard.SubOptimizerShard(geo, group.index(rank), tuple(group), local_shards(opt, geo), kind))
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
    """What Megatron's ``generate_state_dict`` builds (spec 1.3, in its key order)."""
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


def _megatron_defaults(args: Any, rng_tracker: Any) -> tuple[Any, Any]:
    if args is None or rng_tracker is None:
        try:
            from megatron.core import tensor_parallel  # type: ignore[import-not-found]
            from megatron.training import get_args  # type: ignore[import-not-found]
        except ImportError:
            if args is None:
                raise ConfigError("args: pass Megatron's args (megatron.training is not importable here)") from None
            return args, rng_tracker
        args = get_args() if args is None else args
        rng_tracker = tensor_parallel.get_cuda_rng_tracker() if rng_tracker is None else rng_tracker
    return args, rng_tracker


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float = 0, checkpointing_context: Any = None, *,
                    engine: Any, args: Any = None, rng_tracker: Any = None,
                    model_on_every_rank: bool = False) -> Any:
    """Megatron's ``save_checkpoint`` into ``engine``; returns the engine's SaveHandle (``.wait()`` for the
    durable tiers). Blocks only for the engine's snapshot copy.

    ``model_on_every_rank``: snapshot ``model_optim_rng`` on every rank, not only DP rank 0 of each model-parallel
    group (costs memory; lets every rank restore from its own memory tier without reading a file tier).
    """
    args, rng_tracker = _megatron_defaults(args, rng_tracker)
    chunks = model if isinstance(model, list | tuple) else [model]
    coords = engine.coords
    topology = rank_shard.as_topology(coords.layout)
    items: dict[str, Any] = {}
    if model_on_every_rank or (coords.dp == 0 and coords.cp == 0):
        items[MODEL_ITEM] = model_optim_rng_item(iteration, chunks, optimizer, opt_param_scheduler,
                                                 num_floating_point_operations_so_far, args, rng_tracker)
    if not getattr(args, "no_save_optim", False):
        shard = rank_shard_item(optimizer, topology, coords.rank)
        if shard is not None:
            items[OPTIM_ITEM] = shard
    if not items:
        raise ConfigError(f"rank {coords.rank} has nothing to save (no distributed optimizer, not DP rank 0)")
    return engine.save(iteration, items)


# ------------------------------------------------------------------------------------------------------------
# loading


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load", strict: bool = True,
                    checkpointing_context: Any = None, *, engine: Any, args: Any = None, rng_tracker: Any = None,
                    step: int | None = None) -> tuple[int, float]:
    """Megatron's ``load_checkpoint`` from ``engine``: the newest step every rank can read (or ``step``);
    returns ``(iteration, num_floating_point_operations_so_far)``. Honours ``args.finetune``,
    ``no_load_optim`` and ``no_load_rng`` like Megatron.
    """
    args, rng_tracker = _megatron_defaults(args, rng_tracker)
    loaded = engine.load(step)
    items = loaded.items
    state = items.get(MODEL_ITEM)
    if state is None:
        state = _model_item_from_files(engine, loaded.step)
    finetune = bool(getattr(args, "finetune", False))
    if "iteration" not in state and "total_iters" not in state:
        raise LayoutMismatchError(f"step {loaded.step}: model_optim_rng has no iteration (Megatron stops here too)")
    iteration = 0 if finetune else int(state.get("iteration", state.get("total_iters")))
    chunks = [unwrap(c) for c in (model if isinstance(model, list | tuple) else [model])]
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"], strict=strict)
    else:
        for i, chunk in enumerate(chunks):
            if f"model{i}" in state:
                chunk.load_state_dict(state[f"model{i}"], strict=strict)
    if not (finetune or getattr(args, "no_load_optim", False)):
        if optimizer is not None:
            if "optimizer" in state:
                optimizer.load_state_dict(state["optimizer"])
            if OPTIM_ITEM in items:
                apply_distrib_optim(optimizer, items[OPTIM_ITEM], engine.coords)
        if opt_param_scheduler is not None:
            sched = state.get("opt_param_scheduler", state.get("lr_scheduler"))
            if sched is not None:
                opt_param_scheduler.load_state_dict(sched)
    if not (finetune or getattr(args, "no_load_rng", False)) and "rng_state" in state:
        _set_rng(state["rng_state"], args, engine.coords, rng_tracker)
    ckpt_args = state.get("args")
    if ckpt_args is not None and args is not None and not finetune:
        for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
            setattr(args, name, getattr(ckpt_args, name, 0))
    return iteration, state.get("num_floating_point_operations_so_far", 0)


def _model_item_from_files(engine: Any, step: int) -> dict[str, Any]:
    """``model_optim_rng`` of this rank's model-parallel group from a file tier, for a rank that did not
    snapshot it (DP rank > 0 loading from a memory tier)."""
    for store in engine.pipeline.file_stores().values():
        try:
            manifest = store.read_manifest(step)
            items = store.load_rank(manifest, engine.coords, trust_pickles=engine.config.load.trust_pickles)
        except Exception as exc:  # try the next tier
            log.info("model_optim_rng of step %d not readable from tier %r: %s", step, store.name, exc)
            continue
        if MODEL_ITEM in items:
            return items[MODEL_ITEM]
    raise LayoutMismatchError(f"rank {engine.coords.rank}: step {step} has no model_optim_rng for this rank on any "
                              "file tier (save with model_on_every_rank=True to restore it from memory)")


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
