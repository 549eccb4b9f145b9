"""Models and optimizers as items, for users of PyTorch DCP's ``get_state_dict``.

``engine.save`` takes items (item name → state dict) and never a module or an optimizer: a state dict is what
gets copied, and the engine must not guess how to take one. These two helpers make the usual case one line,
through :mod:`torch.distributed.checkpoint.state_dict` (which needs no process group: it works on one process
too, and handles FSDP/DDP wrappers and fully-qualified optimizer keys when there is one)::

    from tiered_ckpt import state

    engine.save(step, state.items_of(model=model, optimizer=optimizer))
    ...
    result = engine.load()
    state.apply(result.items, model=model, optimizer=optimizer)

``items_of`` returns ``{"model": ..., "optimizer": ...}`` (the optimizer's keyed by parameter name, as
``get_state_dict`` gives it) plus any extra items given as keywords, such as ``{"meta": {"step": step}}``.
``apply`` is ``set_state_dict`` with the items of the same names. ``options`` is passed through to both
(a :class:`torch.distributed.checkpoint.state_dict.StateDictOptions`: ``full_state_dict``, ``strict``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

MODEL = "model"
OPTIMIZER = "optimizer"

__all__ = ["MODEL", "OPTIMIZER", "apply", "items_of"]


def _optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    if isinstance(optimizer, Iterable) and not isinstance(optimizer, (str, bytes, Mapping)):
        opts = tuple(optimizer)
        if opts and all(isinstance(o, torch.optim.Optimizer) for o in opts):
            return opts
    raise TypeError(f"optimizer: expected a torch.optim.Optimizer (or several), got {type(optimizer).__name__}")


def _check_model(model: Any, where: str) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def items_of(model: torch.nn.Module, optimizer: Any = None, *, options: Any = None, **extra: Any) -> dict[str, Any]:
    """Items for ``engine.save``: ``"model"`` (and ``"optimizer"``, if given) from ``get_state_dict``, then the
    ``extra`` items as given (each an item name → state; a module or optimizer among them is refused)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    _check_model(model, "items_of")
    for name, value in extra.items():
        if name in (MODEL, OPTIMIZER):
            raise TypeError(f"items_of: {name!r} is the model's or optimizer's item; pass it as model=/optimizer=")
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            raise TypeError(f"items_of: extra item {name!r} is a {type(value).__name__}: give its .state_dict(), "
                            "or pass it as model=/optimizer=")
    optimizers = _optimizers(optimizer)
    if optimizers:
        model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
        items: dict[str, Any] = {MODEL: model_sd, OPTIMIZER: optim_sd}
    else:
        items = {MODEL: get_model_state_dict(model, options=options)}
    return {**items, **extra}


def apply(items: Any, model: torch.nn.Module, optimizer: Any = None, *, options: Any = None) -> None:
    """Load ``items`` (``engine.load().items``, or the :class:`~tiered_ckpt.handles.LoadResult` itself) into
    ``model`` (and ``optimizer``) with ``set_state_dict``: the counterpart of :func:`items_of`."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if not isinstance(items, Mapping):  # a LoadResult
        items = getattr(items, "items", items)
    if not isinstance(items, Mapping):
        raise TypeError(f"apply: expected the loaded items (a dict) or a LoadResult, got {type(items).__name__}")
    _check_model(model, "apply")
    optimizers = _optimizers(optimizer)
    wanted = [MODEL, OPTIMIZER] if optimizers else [MODEL]
    missing = [name for name in wanted if name not in items]
    if missing:
        raise ValueError(f"apply: the checkpoint has no item {missing[0]!r} (its items: "
                       f"{', '.join(repr(n) for n in items) or 'none'}); was it saved with items_of?")
    if optimizers:
        set_state_dict(model, optimizers, model_state_dict=items[MODEL], optim_state_dict=items[OPTIMIZER],
                       options=options)
    else:
        set_model_state_dict(model, items[MODEL], options=options)
