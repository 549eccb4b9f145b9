"""Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``, through a :class:`~tiered_ckpt.CheckpointEngine`.

Drop-in for the legacy (``--ckpt-format torch``) path of ``megatron.training.checkpointing``: same positional
arguments, same state (spec 1.3), plus the engine. ``args.ckpt_format == "torch_dist"`` goes to
:mod:`.adapter_dist` (Megatron's dist_checkpointing over our DCP storage; it imports megatron.core). For
``torch``, Megatron's objects are used through the attributes Megatron itself uses, so nothing here imports
Megatron:

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


# Per DistributedOptimizer: the local-shard tensors of its last save, reused while its geometry is unchanged, so a
# warm save copies into memory that is already faulted in (a fresh 3 x N/DP fp32 per save costs page faults).
_shard_buffers: weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, torch.Tensor]]] = weakref.WeakKeyDictionary()


def local_shards(opt: Any, geo: OptimizerGeometry, *, reuse: bool = False,
                 fill: bool = True) -> dict[str, torch.Tensor]:
    """This rank's contiguous local shards of one DistributedOptimizer (spec 2.2 step 1): fp32 zeros of
    ``N_b / DP`` per bucket and state key, each param's main param and moments copied in at ``gbuf_local``.

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
    """``args`` from ``megatron.training.get_args()`` and the tracker from megatron.core's
    ``get_cuda_rng_tracker()`` when not given (each wherever it is importable)."""
    if args is None:
        try:
            from megatron.training import get_args  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError("args: pass Megatron's args (megatron.training is not importable here)") from None
        args = get_args()
    if rng_tracker is None:
        try:
            from megatron.core import tensor_parallel  # type: ignore[import-not-found]
        except ImportError:  # no Megatron: the checkpoint then holds no tracker states, and says so at load
            log.warning("no rng_tracker given and megatron.core is not importable: the CUDA RNG tracker's states "
                        "are not saved (pass rng_tracker=...)")
        else:
            rng_tracker = tensor_parallel.get_cuda_rng_tracker()
    return args, rng_tracker


# ------------------------------------------------------------------------------------------------------------
# the engine: given, kept in Megatron's checkpointing_context, or built once from TIERED_CKPT_CONFIG

CONFIG_ENV = "TIERED_CKPT_CONFIG"
CONTEXT_KEY = "tiered_ckpt_engine"
_default_engine: Any = None


def layout_from_args(args: Any) -> Any:
    """The job's :class:`~tiered_ckpt.ParallelLayout` from Megatron's args (Megatron's rank order)."""
    from ..parallel import ParallelLayout

    def size(name: str) -> int:
        return int(getattr(args, name, None) or 1)

    tp, pp = size("tensor_model_parallel_size"), size("pipeline_model_parallel_size")
    ep, cp = size("expert_model_parallel_size"), size("context_parallel_size")
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        dp = world // (tp * pp * cp)
    if dp % ep:
        raise ConfigError(f"args.data_parallel_size={dp} is not a multiple of expert_model_parallel_size={ep}")
    if torch.distributed.is_initialized() and tp * pp * cp * dp != torch.distributed.get_world_size():
        raise ConfigError(f"args: tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x "
                          f"context_parallel_size={cp} x data_parallel_size={dp} = {tp * pp * cp * dp} ranks, but "
                          f"torch.distributed has {torch.distributed.get_world_size()}: fix these args")
    return ParallelLayout(tp=tp, pp=pp, ep=ep, cp=cp, dp=dp // ep)


def engine_for(engine: Any, checkpointing_context: Any, args: Any) -> Any:
    """The engine to use: ``engine``; else the one kept in ``checkpointing_context``; else one built (once per
    process, closed at exit) from the configuration file named by ``$TIERED_CKPT_CONFIG`` and the job's layout."""
    global _default_engine
    if engine is None and isinstance(checkpointing_context, dict):
        engine = checkpointing_context.get(CONTEXT_KEY)
    if engine is None:
        if _default_engine is None:
            import atexit
            import os

            path = os.environ.get(CONFIG_ENV)
            if not path:
                raise ConfigError(f"no engine: pass engine=..., or set {CONFIG_ENV} to a tiers.yaml (the drop-in "
                                  "builds its engine from it)")
            from ..engine import CheckpointEngine

            _default_engine = CheckpointEngine(path, layout_from_args(args))
            _warn_if_elsewhere(_default_engine, args)
            atexit.register(_default_engine.close)  # the last save drains before the process exits
        engine = _default_engine
    if isinstance(checkpointing_context, dict):
        checkpointing_context.setdefault(CONTEXT_KEY, engine)
    return engine


_LAYOUT_FIX = ("give the engine the job's ParallelLayout (the drop-in builds it from args: tensor_model_parallel_size, "
               "pipeline_model_parallel_size, expert_model_parallel_size, context_parallel_size, data_parallel_size, "
               "in Megatron's rank order)")


def _warn_if_elsewhere(engine: Any, args: Any) -> None:
    """Megatron's own tools look for checkpoints in ``--save``/``--load``: say so if no file tier writes there."""
    import os

    dirs = set()
    for name in engine.tiers:
        opts = engine.tier_config(name).options
        where = getattr(opts, "path", None) or getattr(opts, "url", None)
        if isinstance(where, str) and where.startswith("file://"):
            where = where[len("file://"):]
        if isinstance(where, str) and "://" not in where:
            dirs.add(os.path.realpath(os.path.expanduser(where)))
    for arg in ("save", "load"):
        value = getattr(args, arg, None)
        if value and os.path.realpath(os.path.expanduser(str(value))) not in dirs:
            log.warning("args.%s=%s is not the directory of any file tier in $%s (%s): checkpoints go to the "
                        "tiers; point a file tier at it if Megatron's own tools should find them there", arg, value,
                        CONFIG_ENV, ", ".join(sorted(dirs)) or "no local file tier")


def _check_rank_args(engine: Any, **given: Any) -> None:
    """Megatron's explicit ranks and groups must be the engine's view of this rank (else: the wrong files)."""
    c = engine.coords
    mine = {"tensor_rank": c.tp, "pipeline_rank": c.pp, "expert_rank": c.ep,
            "pipeline_parallel": c.layout.pp > 1, "expert_parallel": c.layout.ep > 1}
    for name, value in given.items():
        if name in mine and value is not None and value != mine[name]:
            raise ConfigError(f"{name}={value!r}, but the engine's layout {c.layout.to_dict()} puts rank {c.rank} "
                              f"at {mine[name]!r}: {_LAYOUT_FIX}")
    for name, want in (("tp_group", c.tp), ("pp_group", c.pp)):
        group = given.get(name)
        if group is not None and torch.distributed.is_initialized():
            got = torch.distributed.get_group_rank(group, c.rank) if hasattr(torch.distributed, "get_group_rank") \
                else None
            if got is not None and got != want:
                raise ConfigError(f"{name}: rank {c.rank} is rank {got} of the group Megatron passed, the engine's "
                                  f"layout says {want}: {_LAYOUT_FIX}")


_prepared: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # engine -> its pre-faulting thread


def _prepare(engine: Any, build_items: Any) -> None:
    try:
        engine.prepare(build_items())
    except Exception as exc:  # the save then allocates as usual: slower, never wrong
        if not getattr(engine, "_closed", False):
            log.warning("could not prepare the memory slots in advance: %s: %s", type(exc).__name__, exc,
                        exc_info=True)


def _prepare_now(engine: Any, build_items: Any) -> None:
    """Size and pre-fault every slot for this job's items (at ``load_checkpoint``: before training starts, so
    the first ``save_checkpoint`` copies into ready memory without the user calling ``prepare()``)."""
    if engine not in _prepared:
        _prepared[engine] = None
        _prepare(engine, build_items)


def _prepare_in_background(engine: Any, build_items: Any) -> None:
    """After the first save of a job that never called ``load_checkpoint``: pre-fault the other slots while
    training runs (the next save joins the thread first)."""
    import threading

    if engine not in _prepared:
        thread = threading.Thread(target=_prepare, args=(engine, build_items), name="tiered-ckpt-prepare",
                                  daemon=True)
        _prepared[engine] = thread
        thread.start()


def _join_prepare(engine: Any) -> None:
    thread = _prepared.get(engine)
    if thread is not None:
        thread.join()


def _items(iteration: int, chunks: list[Any], optimizer: Any, opt_param_scheduler: Any, flops: float, args: Any,
           rng_tracker: Any, engine: Any, model_on_every_rank: bool, *, template: bool = False) -> dict[str, Any]:
    """What ``save_checkpoint`` snapshots on this rank; ``template``: shaped like it, for sizing the slots (the
    optimizer shards as zeros: before the first step Megatron's optimizer has no moments to read)."""
    coords = engine.coords
    topology = rank_shard.as_topology(coords.layout)
    items: dict[str, Any] = {}
    if model_on_every_rank or (coords.dp == 0 and coords.cp == 0):
        # (a template leaves out optimizer.state_dict(): small, and Megatron's asserts before the first step)
        items[MODEL_ITEM] = model_optim_rng_item(iteration, chunks, None if template else optimizer,
                                                 opt_param_scheduler, flops, args, rng_tracker)
    if not getattr(args, "no_save_optim", False):
        shard = rank_shard_item(optimizer, topology, coords.rank, reuse=True, fill=not template)
        if shard is not None:
            items[OPTIM_ITEM] = shard
    return items


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float, checkpointing_context: Any = None,
                    pipeline_rank: int | None = None, expert_rank: int | None = None,
                    tensor_rank: int | None = None, pipeline_parallel: bool | None = None,
                    expert_parallel: bool | None = None, non_persistent_ckpt: bool = False,
                    train_data_iterator: Any = None, preprocess_common_state_dict_fn: Any = None,
                    release: bool = False, tp_group: Any = None, pp_group: Any = None, dp_cp_group: Any = None,
                    dp_group: Any = None, expt_dp_group: Any = None, rng_state_key_prefix: str = "", *,
                    engine: Any = None, args: Any = None, rng_tracker: Any = None,
                    model_on_every_rank: bool = False) -> Any:
    """Megatron-LM's ``save_checkpoint`` (legacy ``torch`` format), into a CheckpointEngine; every parameter of
    Megatron's function, in its order and with its defaults (docs/megatron.md lists what each does here).
    Blocks only for the engine's snapshot copy; returns the engine's SaveHandle (Megatron returns None and its
    callers ignore the value; ``.wait()`` on it waits for the durable tiers).

    * ``non_persistent_ckpt=True``: memory tiers only (Megatron's frequent, disposable checkpoints); file tiers
      skip the step. Loads pick the newest step as usual, so a newer non-persistent one wins, as in Megatron.
    * ``checkpointing_context``: the engine is kept in it (key ``tiered_ckpt_engine``).
    * ranks and groups (``tensor_rank``, ``pipeline_rank``, ``expert_rank``, ``pipeline_parallel``,
      ``expert_parallel``, ``tp_group``, ``pp_group``, ``dp_group``, ``expt_dp_group``): checked against the
      engine's layout, and the DP groups against each DistributedOptimizer's; a mismatch is an error.
    * ``train_data_iterator``, ``preprocess_common_state_dict_fn``, ``rng_state_key_prefix``, ``dp_cp_group``:
      what Megatron does with them in the ``torch`` format is nothing (they serve ``torch_dist``), so nothing here;
      ``args.dataloader_save`` (dataloader state files) is refused. ``release=True`` is refused.
    * ``engine``: else the one in ``checkpointing_context``, else one built from ``$TIERED_CKPT_CONFIG``.
    * ``model_on_every_rank``: snapshot ``model_optim_rng`` on every rank, not only DP rank 0 of each
      model-parallel group (memory for speed: a DP rank > 0 resuming from memory then reads its own snapshot
      instead of its holder's).
    """
    args, rng_tracker = _megatron_defaults(args, rng_tracker)
    engine = engine_for(engine, checkpointing_context, args)
    if release:
        raise ConfigError("release=True: release checkpoints (iteration-less, model only) are not written through "
                          "the engine; save a normal step and export it with `tiered-ckpt convert`")
    if train_data_iterator is not None and getattr(args, "dataloader_save", None):
        raise ConfigError("args.dataloader_save: Megatron's dataloader state files are not supported by the "
                          "adapter; unset dataloader_save")
    _check_rank_args(engine, tensor_rank=tensor_rank, pipeline_rank=pipeline_rank, expert_rank=expert_rank,
                     pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel, tp_group=tp_group,
                     pp_group=pp_group)
    chunks = model if isinstance(model, list | tuple) else [model]
    _check_dp_groups(engine, optimizer, dp_group, expt_dp_group)
    if _format(args) == "torch_dist":  # Megatron's dist_checkpointing through our DCP storage
        from . import adapter_dist

        return adapter_dist.save(iteration, chunks, optimizer, opt_param_scheduler,
                                 num_floating_point_operations_so_far, args, rng_tracker, engine,
                                 persistent=not non_persistent_ckpt, preprocess_common=preprocess_common_state_dict_fn,
                                 rng_key_prefix=rng_state_key_prefix, dp_cp_group=dp_cp_group)
    items = _items(iteration, chunks, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, args,
                   rng_tracker, engine, model_on_every_rank)
    if not items:
        raise ConfigError(f"rank {engine.coords.rank} has nothing to save (no distributed optimizer, not DP rank 0)")
    _join_prepare(engine)
    handle = engine.save(iteration, items, persistent=not non_persistent_ckpt)
    # After the first save, the other slots are pre-faulted in the background (the first one already is).
    _prepare_in_background(engine, lambda: items)
    return handle


def _format(args: Any) -> str:
    """Megatron's checkpoint format for this job: ``torch`` (legacy) or ``torch_dist``; others are refused."""
    fmt = getattr(args, "ckpt_format", None) or "torch"
    if fmt not in ("torch", "torch_dist"):
        raise ConfigError(f"args.ckpt_format={fmt!r}: the adapter handles 'torch' and 'torch_dist'")
    return fmt


def _check_dp_groups(engine: Any, optimizer: Any, dp_group: Any, expt_dp_group: Any) -> None:
    """The DP groups Megatron passed must be those the engine's layout gives (our checkpoint's DP split)."""
    topology = rank_shard.as_topology(engine.coords.layout)
    for kind, group in (("dense", dp_group), ("expert", expt_dp_group)):
        live = _live_group_ranks(group) if group is not None else None
        if live is None:
            continue
        if kind == "dense" and engine.coords.layout.ep > 1:
            continue  # Megatron's dp_group (no expert ranks) is not the dense optimizer's group with EP
        want = rank_shard.dp_group(topology, engine.coords.rank, kind)
        if sorted(live) != sorted(want):
            raise LayoutMismatchError(f"rank {engine.coords.rank}: {'dp_group' if kind == 'dense' else 'expt_dp_group'}"
                                      f" holds ranks {live}, the engine's layout "
                                      f"{rank_shard.topology_dict(topology)} gives {want}: {_LAYOUT_FIX}")


# ------------------------------------------------------------------------------------------------------------
# loading


def load_checkpoint(ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, checkpointing_context: Any = None, skip_load_to_model_and_opt: bool = False,
                    tp_group: Any = None, pp_group: Any = None, dp_cp_group: Any = None, dp_group: Any = None,
                    expt_dp_group: Any = None, rng_state_key_prefix: str = "", *, engine: Any = None,
                    args: Any = None, rng_tracker: Any = None, step: int | None = None,
                    model: Any = None) -> tuple[int, float]:
    """Megatron-LM's ``load_checkpoint`` (legacy ``torch`` format) from a CheckpointEngine: every parameter of
    Megatron's function, in its order and with its defaults; returns ``(iteration,
    num_floating_point_operations_so_far)``, ``(0, 0)`` when no checkpoint exists anywhere (as Megatron; but
    never when a tier could not be reached: then :class:`~tiered_ckpt.errors.TierUnavailableError` is raised on
    every rank). Collective: every rank calls it.

    * ``load_arg``: ``"load"`` reads the engine's tiers (``args.load`` is where the engine's file tier should
      point); another name (``"pretrained_checkpoint"``, say) reads the Megatron checkpoint in that directory
      ``getattr(args, load_arg)`` (and, as in Megatron, sets ``finetune`` semantics only if ``args.finetune``).
    * ``strict``: passed to each chunk's ``load_state_dict``; a strict failure is retried non-strictly, as
      Megatron does, with the missing and unexpected keys logged (never silently swallowed).
    * ``skip_load_to_model_and_opt``: the model's and optimizer's ``load_state_dict`` are skipped; the
      distributed-optimizer shards, scheduler and RNG are still restored (Megatron's behaviour).
    * ``checkpointing_context``, groups, ``rng_state_key_prefix``: as in :func:`save_checkpoint`.
    * ``step``: a given iteration instead of the newest; ``model``: an alias of ``ddp_model`` (Megatron's
      upcycling code passes it under that name).
    * a DP rank > 0 resumes from memory without ``model_on_every_rank``: see :mod:`.model_item`.
    Honours ``args.finetune``, ``no_load_optim``, ``no_load_rng`` and ``exit_on_missing_checkpoint`` like Megatron.
    """
    from ..errors import NoCheckpointError
    from . import model_item

    if model is not None:
        if ddp_model is not None:
            raise ConfigError("load_checkpoint: give the model once (ddp_model or model)")
        ddp_model = model
    args, rng_tracker = _megatron_defaults(args, rng_tracker)
    engine = engine_for(engine, checkpointing_context, args)
    _check_rank_args(engine, tp_group=tp_group, pp_group=pp_group)
    _check_dp_groups(engine, optimizer, dp_group, expt_dp_group)
    chunks = [unwrap(c) for c in (ddp_model if isinstance(ddp_model, list | tuple) else [ddp_model])]
    if _format(args) == "torch_dist" and load_arg == "load":
        from . import adapter_dist

        return adapter_dist.load(chunks, optimizer, opt_param_scheduler, strict, skip_load_to_model_and_opt, args,
                                 rng_tracker, engine, step, rng_key_prefix=rng_state_key_prefix,
                                 dp_cp_group=dp_cp_group)
    if load_arg != "load":
        return _load_megatron_dir(getattr(args, load_arg, None), load_arg, chunks, optimizer, opt_param_scheduler,
                                  strict, skip_load_to_model_and_opt, args, rng_tracker, engine)
    try:
        loaded = engine.load(step)
    except NoCheckpointError:
        # Every rank listed every tier and found nothing (a tier that could not be listed makes load() raise
        # TierUnavailableError instead, on every rank): Megatron's fresh start.
        if step is not None or getattr(args, "exit_on_missing_checkpoint", False):
            raise
        log.warning("no checkpoint on any tier: starting from iteration 0 (Megatron's behaviour)")
        _prepare_now(engine, lambda: _items(0, chunks, optimizer, opt_param_scheduler, 0, args, rng_tracker, engine,
                                            False, template=True))
        return 0, 0
    state, source = model_item.resolve(engine, loaded)
    log.info("rank %d: step %d from tier %r (model_optim_rng from %s)", engine.coords.rank, loaded.step,
             loaded.tier, source)
    result = _apply(state, loaded.items, chunks, optimizer, opt_param_scheduler, strict, skip_load_to_model_and_opt,
                    args, rng_tracker, engine.coords, where=f"step {loaded.step}")
    _prepare_now(engine, lambda: _items(result[0], chunks, optimizer, opt_param_scheduler, result[1], args,
                                        rng_tracker, engine, False, template=True))
    return result


def _load_megatron_dir(path: Any, load_arg: str, chunks: list[Any], optimizer: Any, opt_param_scheduler: Any,
                       strict: bool, skip: bool, args: Any, rng_tracker: Any, engine: Any) -> tuple[int, float]:
    """``load_arg`` other than ``"load"``: the Megatron checkpoint in ``getattr(args, load_arg)``."""
    from ..errors import NoCheckpointError
    from . import legacy
    from .convert import open_store

    if not path:
        raise ConfigError(f"load_arg={load_arg!r}: args.{load_arg} is not set")
    store = open_store(path, engine.config.layout, load_arg)
    try:
        items = legacy.load_rank_items(store.tier, None, engine.coords, trust_pickles=engine.config.load.trust_pickles)
    except NoCheckpointError:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise
        log.warning("args.%s=%s holds no checkpoint: starting from iteration 0", load_arg, path)
        return 0, 0
    if MODEL_ITEM not in items:
        raise LayoutMismatchError(f"args.{load_arg}={path}: no model_optim_rng for rank {engine.coords.rank}")
    return _apply(items[MODEL_ITEM], items, chunks, optimizer, opt_param_scheduler, strict, skip, args,
                  rng_tracker, engine.coords, where=f"args.{load_arg}={path}")


def _apply(state: dict[str, Any], items: Mapping[str, Any], chunks: list[Any], optimizer: Any,
           opt_param_scheduler: Any, strict: bool, skip: bool, args: Any, rng_tracker: Any, coords: Any, *,
           where: str) -> tuple[int, float]:
    """Megatron's restore of one rank from its ``model_optim_rng`` dict and ``distrib_optim`` item."""
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
            if "optimizer" in state and not skip:
                optimizer.load_state_dict(state["optimizer"])
            if OPTIM_ITEM in items:
                apply_distrib_optim(optimizer, items[OPTIM_ITEM], coords)
        if opt_param_scheduler is not None:
            sched = state.get("opt_param_scheduler", state.get("lr_scheduler"))
            if sched is not None:
                opt_param_scheduler.load_state_dict(sched)
    elif optimizer is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
        # The optimizer's fp32 main params must follow the loaded model weights (Megatron does the same here),
        # or the first step would put back the weights the job started with.
        optimizer.reload_model_params()
    if not (finetune or getattr(args, "no_load_rng", False)) and "rng_state" in state:
        _set_rng(state["rng_state"], args, coords, rng_tracker)
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
