"""The adapter's ``torch_dist`` path: Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` with
``args.ckpt_format == "torch_dist"``, through :mod:`.torch_dist` (our DCP storage under Megatron's
``dist_checkpointing``).

The state is what Megatron's ``generate_state_dict`` builds for ``torch_dist``: ``args``, ``checkpoint_version``,
``iteration``, each chunk's ``sharded_state_dict(metadata=...)``, the optimizer's ``sharded_state_dict``, the
scheduler's state, the RNG state as a ShardedObject keyed ``rng_state`` over (PP, TP), and
``num_floating_point_operations_so_far``; the content metadata (the optimizer's sharding type, ...) is Megatron's
``_build_sharded_state_dict_metadata``. Imports megatron.core (a torch_dist job has it).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from ..errors import ConfigError, LayoutMismatchError, NoCheckpointError

log = logging.getLogger(__name__)
CHECKPOINT_VERSION = 3.0
FULLY_RESHARDABLE = {"fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor"}

# engine -> {persistent: strategy}: the save strategy (and its cached plan) lives as long as the engine
_strategies: weakref.WeakKeyDictionary[Any, dict[bool, Any]] = weakref.WeakKeyDictionary()


def content_metadata(args: Any, dp_cp_group: Any) -> dict[str, Any]:
    """Megatron's ``_build_sharded_state_dict_metadata`` (with the DP x CP group, which is not saved)."""
    md: dict[str, Any] = {}
    if getattr(args, "use_distributed_optimizer", False):
        if getattr(args, "dist_ckpt_optim_fully_reshardable", False):
            md["distrib_optim_sharding_type"] = "fully_reshardable"
            md["distrib_optim_fully_reshardable_mem_efficient"] = bool(
                getattr(args, "distrib_optim_fully_reshardable_mem_efficient", False))
        else:
            md["distrib_optim_sharding_type"] = "dp_reshardable"
    md["singleton_local_shards"] = False
    md["chained_optim_avoid_prefix"] = True
    md["dp_cp_group"] = dp_cp_group
    return md


def _groups(dp_cp_group: Any) -> tuple[Any, int, int, int, int, int]:
    from megatron.core import parallel_state as ps

    group = dp_cp_group if dp_cp_group is not None else ps.get_data_parallel_group(with_context_parallel=True)
    return (group, ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_rank(with_context_parallel=True))


def sharded_state(iteration: int, chunks: list[Any], optimizer: Any, scheduler: Any, flops: float, args: Any,
                  rng_tracker: Any, metadata: dict[str, Any], *, is_loading: bool = False, with_optim: bool = True,
                  with_rng: bool = True, rng_key_prefix: str = "", dp_cp_group: Any = None) -> dict[str, Any]:
    """Megatron's ``generate_state_dict`` for ``torch_dist`` (``is_loading``: the request for a load)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from .adapter_state import rng_state

    _, pp_rank, pp_size, tp_rank, tp_size, dp_cp_rank = _groups(dp_cp_group)
    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    for i, chunk in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    if with_optim and not getattr(args, "no_save_optim", False):
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng and not getattr(args, "no_save_rng", False):
        state["rng_state"] = ShardedObject(f"{rng_key_prefix}rng_state", rng_state(args, rng_tracker),
                                           (pp_size, tp_size), (pp_rank, tp_rank), replica_id=dp_cp_rank)
    state["num_floating_point_operations_so_far"] = flops
    return state


def strategy_for(engine: Any, persistent: bool, args: Any) -> Any:
    from .torch_dist import TieredSaveShardedStrategy

    per_engine = _strategies.setdefault(engine, {})
    if persistent not in per_engine:
        per_engine[persistent] = TieredSaveShardedStrategy(
            engine, persistent=persistent, cache_plan=bool(getattr(args, "ckpt_assume_constant_structure", False)))
    return per_engine[persistent]


def save(iteration: int, chunks: list[Any], optimizer: Any, scheduler: Any, flops: float, args: Any,
         rng_tracker: Any, engine: Any, *, persistent: bool, preprocess_common: Any = None,
         rng_key_prefix: str = "", dp_cp_group: Any = None) -> Any:
    """Megatron's torch_dist save into the engine; returns this rank's SaveHandle."""
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    from . import torch_dist
    from .adapter_state import unwrap

    _check_engine(engine)
    group = _groups(dp_cp_group)[0]
    md = content_metadata(args, group)
    state = sharded_state(iteration, [unwrap(c) for c in chunks], optimizer, scheduler, flops, args, rng_tracker,
                          md, rng_key_prefix=rng_key_prefix, dp_cp_group=group)
    strategy = strategy_for(engine, persistent, args)
    # Megatron validates the sharding on every save, or the first only with a constant structure
    validate = not (strategy.cache_plan and strategy.planned_saves) and \
        getattr(args, "ckpt_load_validate_sharding_integrity", True) is not False
    return torch_dist.save(engine, iteration, state, strategy, validate_access_integrity=validate,
                           preprocess_common=preprocess_common,
                           content_metadata=_clean_metadata_for_serialization(md))


def load(chunks: list[Any], optimizer: Any, scheduler: Any, strict: bool, skip: bool, args: Any, rng_tracker: Any,
         engine: Any, step: int | None, *, rng_key_prefix: str = "", dp_cp_group: Any = None) -> tuple[int, float]:
    """Megatron's torch_dist load from the engine's tiers (collective); ``(0, 0)`` when no tier holds a step."""
    from . import torch_dist
    from .adapter_state import restore, unwrap

    _check_engine(engine)
    chunks = [unwrap(c) for c in chunks]
    try:
        reader, common = torch_dist.open_step(engine, step)
    except NoCheckpointError:
        if getattr(args, "pretrained_checkpoint", None):
            # Megatron would finetune from it; starting from random weights instead must not pass unnoticed.
            raise ConfigError(f"no torch_dist checkpoint on any tier, and args.pretrained_checkpoint="
                              f"{args.pretrained_checkpoint}: the adapter loads --pretrained-checkpoint for "
                              "--ckpt-format torch only (Megatron would finetune from it here); for the first "
                              "launch, load it with Megatron's own load_checkpoint") from None
        if step is not None or getattr(args, "exit_on_missing_checkpoint", False):
            raise
        log.warning("no torch_dist checkpoint on any tier: starting from iteration 0 (Megatron's behaviour)")
        return 0, 0
    ckpt_args = common.get("args")
    ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                  getattr(ckpt_args, "pipeline_model_parallel_size", 1))
    run_tp_pp = (int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                 int(getattr(args, "pipeline_model_parallel_size", 1) or 1))
    finetune = bool(getattr(args, "finetune", False))
    with_rng = (ckpt_tp_pp == run_tp_pp and not finetune and not getattr(args, "no_load_rng", False)
                and not getattr(ckpt_args, "no_save_rng", False))
    with_optim = not (finetune or getattr(args, "no_load_optim", False) or getattr(ckpt_args, "no_save_optim", False))
    md = dict(common.get(torch_dist.CONTENT_METADATA_KEY) or {})
    sharding = md.get("distrib_optim_sharding_type")
    if with_optim and getattr(args, "use_distributed_optimizer", False) and ckpt_tp_pp != run_tp_pp \
            and sharding not in FULLY_RESHARDABLE:
        raise LayoutMismatchError(f"step {reader.step}: (TP, PP) {ckpt_tp_pp} -> {run_tp_pp}, but the distributed "
                                  f"optimizer was saved as {sharding!r}, which reshards over DP only: save it with "
                                  "args.dist_ckpt_optim_fully_reshardable=True, or load with no_load_optim")
    group = _groups(dp_cp_group)[0]
    md["dp_cp_group"] = group
    request = sharded_state(0, chunks, optimizer if with_optim else None, None, 0, args, rng_tracker, md,
                            is_loading=True, with_optim=with_optim, with_rng=with_rng, rng_key_prefix=rng_key_prefix,
                            dp_cp_group=group)
    request.pop("args")
    state = torch_dist.load(reader, common, request)
    if not with_rng:
        state.pop("rng_state", None)
        if ckpt_tp_pp != run_tp_pp:
            log.warning("step %d: (TP, PP) %s -> %s: the RNG state is not loaded (Megatron's behaviour)",
                        reader.step, ckpt_tp_pp, run_tp_pp)
    return restore(state, {}, chunks, optimizer, scheduler, strict, skip, args, rng_tracker, engine.coords,
                  where=f"step {reader.step} (torch_dist, tiers {sorted(set(reader.sources.values()))})",
                  distrib_optim_item=False, rng=ckpt_tp_pp == run_tp_pp)


def _check_engine(engine: Any) -> None:
    if engine.config.layout != "dcp":
        raise ConfigError(f"args.ckpt_format='torch_dist' needs an engine with layout: dcp (this one has "
                          f"{engine.config.layout!r}): set layout: dcp in the tier configuration, or use "
                          "--ckpt-format torch with the megatron or rank_sharded layout", key_path="layout")
