"""Would Megatron-LM load this torch file? A static check of its pickle against Megatron's weights-only rules.

Megatron's ``load_checkpoint`` reads ``model_optim_rng.pt`` with ``torch.load`` and torch's default
``weights_only=True``, after ``import megatron.core`` registered its safe globals (``megatron/core/
safe_globals.py``). Any refusal makes it print a message and ``sys.exit()`` — exit code 0, as if training had
finished. So before we commit a Megatron-format file, and when ``verify`` or ``convert`` read one, its pickle
is checked here against exactly what that loader accepts: torch's own allow-list plus Megatron's list.
Nothing is unpickled.

Megatron's list is narrower than what :mod:`.safe_load` reads (ours also takes numpy scalars and every numpy
dtype class): a file we can read is not necessarily one Megatron can.
"""

from __future__ import annotations

import _compat_pickle
import functools
import pickletools

import numpy as np

from ..errors import DecodeError

# megatron/core/safe_globals.py (Megatron-LM d98e8a64dd, megatron-core 0.16): the Megatron classes by name.
MEGATRON_CLASSES = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)


@functools.cache
def allowed_globals() -> frozenset[str]:
    """``module.qualname`` of every global Megatron's weights-only load accepts (torch's and Megatron's)."""
    import argparse
    import io
    import pathlib
    import signal
    import types

    import torch

    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct

    def name(obj: object) -> str:
        return f"{obj.__module__}.{obj.__qualname__}"  # type: ignore[attr-defined]

    # The non-Megatron objects of Megatron's list, named as this Python and numpy name them (as they pickle).
    objects = (types.SimpleNamespace, pathlib.PosixPath, _reconstruct, np.ndarray, np.dtype, type(np.dtype("u4")),
               argparse.Namespace, io.BytesIO, signal.Signals, torch.Generator)
    return frozenset({*torch_default_globals(), *map(name, objects), *MEGATRON_CLASSES})


def torch_default_globals() -> frozenset[str]:
    """What torch's weights-only unpickler accepts without any registration."""
    from torch import _weights_only_unpickler as wu

    return frozenset(wu._get_allowed_globals())  # private, but the very table torch.load consults


def refused_globals(pkl: bytes) -> list[str]:
    """The globals (and numpy dtype classes, which torch rebuilds with BUILD) in ``pkl`` that Megatron's loader
    refuses; [] when it would load. Pickle protocols above 2 use opcodes torch's loader lacks: named too."""
    allowed = allowed_globals()
    refused: set[str] = set()
    try:
        ops = list(pickletools.genops(pkl))
    except Exception as exc:  # pickletools raises ValueError, UnicodeDecodeError, ... on garbage
        raise DecodeError(f"not a readable pickle ({type(exc).__name__}: {exc})") from None
    for i, (op, arg, _) in enumerate(ops):
        if op.name == "STACK_GLOBAL":
            refused.add("STACK_GLOBAL (pickle protocol 4 or later)")
            continue
        if op.name != "GLOBAL":
            continue
        full = _py3_name(*str(arg).split(" ", 1))
        if full not in allowed:
            refused.add(full)
        elif full == "numpy.dtype":  # np.dtype(code) then BUILD on an instance of the code's dtype class
            code = next((a for o, a, _ in ops[i + 1:i + 4] if isinstance(a, str) and "UNICODE" in o.name), None)
            if code is not None:
                try:
                    cls = type(np.dtype(code))
                except TypeError:
                    refused.add(f"numpy.dtype({code!r})")
                    continue
                cls_name = f"{cls.__module__}.{cls.__qualname__}"
                if cls_name not in allowed:
                    refused.add(cls_name)
    return sorted(refused)


def _py3_name(module: str, name: str) -> str:
    """Protocol 2 pickles name Python 2's modules (``__builtin__``); torch's loader maps them back, as here."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def explain(where: str, refused: list[str]) -> str:
    return (f"{where}: Megatron-LM's weights-only loader refuses {', '.join(refused)} (its load_checkpoint would "
            "stop, and exit 0): not in torch's or Megatron's safe globals")


def file_refusals(tier: object, key: str) -> list[str]:
    """:func:`refused_globals` of the torch file ``key`` on ``tier``, reading only its zip directory and pickle."""
    from . import tier_io
    from .lazy_torch import open_lazy

    return refused_globals(open_lazy(tier, key, where=tier_io.where(tier, key), unpickle=False).pickle_bytes())


def is_megatron_file(key: str) -> bool:
    """The files Megatron-LM itself opens with ``torch.load`` (our rank_sharded files it never reads)."""
    name = key.rsplit("/", 1)[-1]
    return name == "model_optim_rng.pt" or (name == "distrib_optim.pt" and "/mp_rank_" in f"/{key}")
