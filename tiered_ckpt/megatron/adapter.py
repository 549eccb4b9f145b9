"""Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``, through a :class:`~tiered_ckpt.CheckpointEngine`.

Drop-in for the legacy (``--ckpt-format torch``) path of ``megatron.training.checkpointing``: same positional
arguments, same state (docs/megatron-format.md, "model_optim_rng.pt"), plus the engine.
``args.ckpt_format == "torch_dist"`` goes to :mod:`.adapter_dist` (Megatron's dist_checkpointing over our DCP
storage; it imports megatron.core). For ``torch``, Megatron's objects are used through the attributes Megatron
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
import weakref
from typing import Any

import torch

from ..errors import ConfigError, LayoutMismatchError
from . import rank_shard
from .adapter_state import (  # unwrap, rng_state, rank_shard_item, apply_distrib_optim: used from here too
    MODEL_ITEM,
    OPTIM_ITEM,
    apply_distrib_optim,
    live_group_ranks,
    model_optim_rng_item,
    rank_shard_item,
    restore,
    rng_state,
    unwrap,
)

log = logging.getLogger(__name__)
__all__ = ["CONFIG_ENV", "CONTEXT_KEY", "MODEL_ITEM", "OPTIM_ITEM", "apply_distrib_optim", "engine_for",
           "layout_from_args", "load_checkpoint", "rank_shard_item", "rng_state", "save_checkpoint", "unwrap"]


# ------------------------------------------------------------------------------------------------------------
# Megatron's defaults, where it is importable


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


def _arg_size(args: Any, name: str) -> int:
    """A size among Megatron's args (a parallel size, ``world_size``): 1 where unset."""
    return int(getattr(args, name, None) or 1)


def layout_from_args(args: Any) -> Any:
    """The job's :class:`~tiered_ckpt.ParallelLayout` from Megatron's args (Megatron's rank order)."""
    from ..parallel import ParallelLayout

    tp, pp = _arg_size(args, "tensor_model_parallel_size"), _arg_size(args, "pipeline_model_parallel_size")
    ep, cp = _arg_size(args, "expert_model_parallel_size"), _arg_size(args, "context_parallel_size")
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
            # The launcher's WORLD_SIZE, or Megatron's args where a launcher sets none (a user's trial: RANK=1 of a
            # world_size=2 job, no WORLD_SIZE, built an engine of its own)
            world = max(int(os.environ.get("WORLD_SIZE", "1") or 1), _arg_size(args, "world_size"))
            if world > 1 and not torch.distributed.is_initialized():
                # The engine would be built (and kept for the process) without the job's process group: each rank
                # would load, and commit, on its own (a user's trial: ranks resumed at different steps).
                raise ConfigError(f"the drop-in was called before torch.distributed.init_process_group (a world "
                                  f"of {world} ranks: WORLD_SIZE, args.world_size): the ranks could not agree on a "
                                  "step to load or commit a step together; call it after Megatron's "
                                  "initialize_megatron (or your own init_process_group)")
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
        if engine.pipeline.stores[name].slots() is not None:  # a memory tier's slots are no checkpoint directory
            continue
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
    fmt = getattr(args, "ckpt_format", "torch")
    if fmt == "torch" and engine.config.layout != "megatron":
        # The files are this layout's; Megatron-LM's own load_checkpoint reads only Megatron's file layout.
        log.warning("layout %r in $%s: the adapter loads these checkpoints, but plain Megatron-LM does not (it "
                    "reads mp_rank_*/distrib_optim.pt, which only layout: megatron writes). Set layout: megatron "
                    "in the configuration for checkpoints Megatron's own tools load, or export a step with "
                    "tiered-ckpt convert --to megatron", engine.config.layout, CONFIG_ENV)


def _step_directory_hint(path: Any) -> str:
    """What to say when ``--load`` names one step's directory (``.../iter_0000100``) instead of the checkpoint
    directory above it: Megatron would start from scratch there too, without a word."""
    import os

    from .naming import STEP_DIRECTORY_ADVICE, is_step_directory

    try:
        names = os.listdir(os.path.expanduser(str(path))) if path else []
    except OSError:
        return ""
    return f". args.load={path}: {STEP_DIRECTORY_ADVICE}" if is_step_directory(names) else ""


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
    _join_prepare(engine)
    handle = engine.save(iteration, items, persistent=not non_persistent_ckpt)
    # After the first save, the other slots are pre-faulted in the background (the first one already is).
    _prepare_in_background(engine, lambda: items)
    _raise_if_not_durable(engine, iteration)
    return handle


def _raise_if_not_durable(engine: Any, iteration: int) -> None:
    """Megatron-LM ignores what ``save_checkpoint`` returns, and its own save stops the job on a failed write. A
    Megatron user's trial: with the ``--save`` directory gone, every save failed on the disk (a warning each) and
    the job trained to its end, exit 0, with no checkpoint on disk. A save that reached no durable tier stops the
    job at the next save instead, once that save's snapshot is in memory (a restart resumes from it)."""
    lost = engine.take_not_durable()
    if not lost:
        return
    from ..handles import SavesFailedError

    err = SavesFailedError(lost)
    steps = ", ".join(map(str, sorted(lost)))
    why = "; ".join(f"{t!r}: {w[:300]}" for t, w in lost[max(lost)].items())
    err.args = (f"step(s) {steps} reached no durable tier (step {max(lost)}: {why}); iteration {iteration} may "
                "be in memory only as well. Stopping rather than training on with no checkpoint on disk: fix the "
                "tier and restart (the snapshots in shared memory are drained there at start-up, and the job "
                "resumes from the newest)",)
    raise err


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
        live = live_group_ranks(group) if group is not None else None
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
    * ``args.pretrained_checkpoint`` (``--pretrained-checkpoint``): when no tier holds a checkpoint, the Megatron
      checkpoint in that directory is loaded with ``args.finetune`` set, as Megatron does (``torch`` format).
    * ``step``: a given iteration instead of the newest (default: ``args.ckpt_step``, Megatron's
      ``--ckpt-step``; a step no tier holds is an error, never a fresh start); ``model``: an alias of
      ``ddp_model`` (Megatron's upcycling code passes it under that name).
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
    if step is None:
        step = _ckpt_step(args)
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
                                  strict, skip_load_to_model_and_opt, args, rng_tracker, engine, step)
    try:
        loaded = engine.load(step)
    except NoCheckpointError:
        # Every rank listed every tier and found nothing (a tier that could not be listed makes load() raise
        # TierUnavailableError instead, on every rank): Megatron's fresh start.
        pretrained = getattr(args, "pretrained_checkpoint", None)
        if pretrained:
            # Megatron-LM's finetuning start: nothing in --load yet, so the weights come from
            # --pretrained-checkpoint, loaded with --finetune semantics (iteration 0, no optimizer, scheduler or
            # RNG). Later launches find the job's own checkpoints on the tiers and resume from them.
            log.warning("no checkpoint on any tier: finetuning from args.pretrained_checkpoint=%s (Megatron's "
                        "behaviour: args.finetune is set)", pretrained)
            args.finetune = True
            return _load_megatron_dir(pretrained, "pretrained_checkpoint", chunks, optimizer, opt_param_scheduler,
                                      strict, skip_load_to_model_and_opt, args, rng_tracker, engine, step,
                                      required=True)
        if step is not None or getattr(args, "exit_on_missing_checkpoint", False):
            raise
        log.warning("no checkpoint on any tier: starting from iteration 0 (Megatron's behaviour)%s",
                    _step_directory_hint(getattr(args, "load", None)))
        _prepare_now(engine, lambda: _items(0, chunks, optimizer, opt_param_scheduler, 0, args, rng_tracker, engine,
                                            False, template=True))
        return 0, 0
    state, source = model_item.resolve(engine, loaded)
    log.info("rank %d: step %d from tier %r (model_optim_rng from %s)", engine.coords.rank, loaded.step,
             loaded.tier, source)
    result = restore(state, loaded.items, chunks, optimizer, opt_param_scheduler, strict, skip_load_to_model_and_opt,
                    args, rng_tracker, engine.coords, where=f"step {loaded.step} from tier {loaded.tier!r}")
    _prepare_now(engine, lambda: _items(result[0], chunks, optimizer, opt_param_scheduler, result[1], args,
                                        rng_tracker, engine, False, template=True))
    return result


def _ckpt_step(args: Any) -> int | None:
    """Megatron's ``--ckpt-step``: the iteration to load instead of the newest (unset or 0: the newest, as
    Megatron's ``if getattr(args, 'ckpt_step', None)`` reads it)."""
    value = getattr(args, "ckpt_step", None)
    return int(value) if value else None


def _load_megatron_dir(path: Any, load_arg: str, chunks: list[Any], optimizer: Any, opt_param_scheduler: Any,
                       strict: bool, skip: bool, args: Any, rng_tracker: Any, engine: Any,
                       step: int | None = None, *, required: bool = False) -> tuple[int, float]:
    """``load_arg`` other than ``"load"`` (or ``--pretrained-checkpoint`` when no tier holds a checkpoint): the
    Megatron checkpoint in ``getattr(args, load_arg)``. ``required``: none there is an error, not a fresh start."""
    from ..errors import NoCheckpointError
    from . import legacy
    from .convert import open_store

    if not path:
        raise ConfigError(f"load_arg={load_arg!r}: args.{load_arg} is not set")
    store = open_store(path, engine.config.layout, load_arg)
    try:
        items = legacy.load_rank_items(store.tier, step, engine.coords, trust_pickles=engine.config.load.trust_pickles)
    except NoCheckpointError:
        if required:
            raise NoCheckpointError(f"no checkpoint on any tier of the engine (args.load) nor in "
                                    f"args.{load_arg}={path} (Megatron stops here too)") from None
        if step is not None or getattr(args, "exit_on_missing_checkpoint", False):
            raise
        log.warning("args.%s=%s holds no checkpoint: starting from iteration 0", load_arg, path)
        return 0, 0
    if MODEL_ITEM not in items:
        raise LayoutMismatchError(f"args.{load_arg}={path}: no model_optim_rng for rank {engine.coords.rank}")
    return restore(items[MODEL_ITEM], items, chunks, optimizer, opt_param_scheduler, strict, skip, args,
                  rng_tracker, engine.coords, where=f"args.{load_arg}={path}")
