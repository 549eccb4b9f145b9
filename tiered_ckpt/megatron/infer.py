"""The bucket geometry of a checkpoint Megatron wrote, rebuilt from its own ``model_optim_rng.pt``.

Megatron's ``distrib_optim.pt`` stores each buffer's state with the tail padding of every bucket removed, but not
where the buckets end: splitting it for a DP rank needs each bucket's unpadded size ``U_b``. Megatron gets them
from the live model; here they are recomputed with Megatron's bucketing rules (:mod:`.geometry`) from what the
checkpoint itself says:

* the params: the tensors of ``model`` (or ``model0``, ``model1``, ... with virtual pipelining) in state-dict
  order, which is ``named_parameters()`` order for Megatron's models; ``*._extra_state`` entries are skipped;
  names with ``.experts.`` are expert params (their own optimizer and buffers);
* the tied word embedding / output layer each get their own bucket when PP > 1 (``shared_embedding``);
* ``args``: ``ddp_bucket_size``, ``overlap_grad_reduce``, ``data_parallel_size``, ``context_parallel_size``,
  ``expert_model_parallel_size``, ``expert_tensor_parallel_size``, ``ddp_pad_buckets_for_high_nccl_busbw``;
  the pipeline stage from the directory name. Chunks after the first (VPP) are taken as unbucketed.

The result is checked against the file: same buffers, dtypes and ``numel_unpadded`` per buffer, else
:class:`LayoutMismatchError` (frozen params, custom models or other bucketing rules cannot be recognised from
the checkpoint; then convert from a run that knows its optimizer: the adapter saves the geometry).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import LayoutMismatchError
from .distrib_optim import NUMEL_UNPADDED, sub_optimizer_states
from .geometry import OptimizerGeometry, ParamSpec, compute_optimizer_geometry, megatron_bucket_size
from .lazy_torch import is_tensor_like

_EXPERT = re.compile(r"\.experts\.")
SHARED_EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")


def model_chunks(model_state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The model state dicts of ``model_optim_rng.pt``: ``[model]`` or ``[model0, model1, ...]``."""
    if "model" in model_state:
        return [model_state["model"]]
    chunks, i = [], 0
    while f"model{i}" in model_state:
        chunks.append(model_state[f"model{i}"])
        i += 1
    return chunks


def param_specs(chunk: Mapping[str, Any], *, pp_size: int, untie: bool) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """(dense, expert) params of one model chunk, in ``named_parameters()`` order."""
    dense, expert = [], []
    for name, t in chunk.items():
        if name.endswith("_extra_state") or not is_tensor_like(t) or not t.dtype.is_floating_point:
            continue
        spec = ParamSpec(name, tuple(t.shape), t.dtype,
                         shared_embedding=pp_size > 1 and not untie and name in SHARED_EMBEDDINGS)
        (expert if _EXPERT.search(name) else dense).append(spec)
    return dense, expert


def infer_geometry(
    model_state: Mapping[str, Any],
    args: Any,
    *,
    pp_rank: int,
    pp_size: int,
    distrib_optim: Any,
    where: str,
) -> list[OptimizerGeometry | None]:
    """Per sub-optimizer of ``distrib_optim`` (the loaded or lazily opened file): its geometry, at the DP size
    of the run that saved it; None where the file has no entry. Checked against the file (module doc)."""
    states = sub_optimizer_states(distrib_optim)
    untie = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    expert_dp = max(1, dp * tp // (etp * ep))
    common = {"pad_for_high_nccl_busbw": bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False))}
    kinds: list[list[OptimizerGeometry]] = [[], []]
    for c, chunk in enumerate(model_chunks(model_state)):
        bucket_size = megatron_bucket_size(dp, ddp_bucket_size=getattr(args, "ddp_bucket_size", None),
                                           overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
                                           pp_rank=pp_rank, disable_bucketing=c > 0)
        for k, (params, size) in enumerate(zip(param_specs(chunk, pp_size=pp_size, untie=untie), (dp, expert_dp),
                                               strict=True)):
            if params:
                kinds[k].append(compute_optimizer_geometry(params, dp_size=size, bucket_size=bucket_size,
                                                           **common))
    built = [_concat(parts) for parts in kinds]
    candidates = [g for g in built if g is not None]
    if len(states) == 1:
        wanted: list[OptimizerGeometry | None] = [candidates[0] if candidates else None]
    else:
        wanted = built + [None] * max(0, len(states) - len(built))
    if len(wanted) != len(states):
        raise LayoutMismatchError(f"{where}: {len(states)} sub-optimizers in the file, the model has "
                                  f"{len(candidates)} kinds of params (dense/expert)")
    out: list[OptimizerGeometry | None] = []
    for i, (state, geo) in enumerate(zip(states, wanted, strict=True)):
        if state is None:
            out.append(None)
            continue
        if geo is None:
            raise LayoutMismatchError(f"{where}: sub-optimizer {i} has state but the model has no such params")
        out.append(_matched(state, geo, f"{where}, sub-optimizer {i}"))
    return out


def _concat(parts: Sequence[OptimizerGeometry]) -> OptimizerGeometry | None:
    if not parts:
        return None
    return OptimizerGeometry(tuple(b for p in parts for b in p.buffers), parts[0].state_keys)


def _matched(state: Mapping[Any, Any], geo: OptimizerGeometry, where: str) -> OptimizerGeometry:
    """``geo`` with the file's grad dtypes and state keys, after checking buffers and ``numel_unpadded``."""
    indices = sorted(k for k in state if isinstance(k, int))
    if indices != list(range(len(geo.buffers))):
        raise LayoutMismatchError(f"{where}: the file has buffers {indices}, the model gives "
                                  f"{len(geo.buffers)} (cannot reconstruct the bucket geometry)")
    buffers, keys = [], None
    for g, buf in enumerate(geo.buffers):
        (dtype_key, entry), = state[g].items()
        pdt, gdt = tuple(dtype_key)
        if pdt != buf.param_dtype:
            raise LayoutMismatchError(f"{where}: buffer {g} holds {pdt} params in the file, {buf.param_dtype} "
                                      "in the model state")
        if entry.get(NUMEL_UNPADDED) != buf.numel_unpadded:
            raise LayoutMismatchError(
                f"{where}: buffer {g} has numel_unpadded {entry.get(NUMEL_UNPADDED)} in the file, "
                f"{buf.numel_unpadded} computed from the model state and args (frozen params, another "
                "bucket size or bucketing rule?): cannot split it without the live optimizer's geometry")
        keys = keys or tuple(k for k in ("param", "exp_avg", "exp_avg_sq") if is_tensor_like(entry.get(k)))
        buffers.append(type(buf)(pdt, gdt, buf.dp_size, buf.buckets, buf.pad_for_high_nccl_busbw))
    return OptimizerGeometry(tuple(buffers), keys or geo.state_keys)
