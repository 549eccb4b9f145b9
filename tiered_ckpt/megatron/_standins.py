"""Inert stand-ins for the Megatron classes of Megatron's weights-only allow-list.

A Megatron checkpoint pickles a few Megatron objects inside ``args``: enum members (``GLOBAL
megatron.core.enums ModelType`` called with the member's value) and, in principle, ``OptimizerConfig`` (a
dataclass: ``NEWOBJ`` then ``BUILD`` with its fields). Without Megatron installed we rebuild them as instances
of small classes created here, one per ``(module, qualname)``, whose ``__module__``/``__qualname__`` are
Megatron's.

Pickling them again must emit the same ``GLOBAL``. The standard pickler only does that after
``PyImport_Import(module)`` succeeds (which imports the top-level package ``megatron`` too) and finds the very
same class there. So the first time a stand-in is pickled in a process without Megatron installed, placeholder
modules are put in ``sys.modules``: the stand-ins' own modules (e.g. ``megatron.core.enums``) and, unless some
``megatron`` module is already imported, a top-level ``megatron`` that is not a package (so ``import
megatron`` succeeds from then on, but ``import megatron.core`` still fails). :func:`remove_stand_in_modules`
takes them out again. When Megatron is installed, a stand-in pickles as the real class instead. Loading never
registers anything.
"""

from __future__ import annotations

import copyreg
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import pickle
import sys
import threading
import types
from typing import Any, ClassVar

from ..pickle_by_name import NamedReduce

log = logging.getLogger(__name__)

# Megatron's allow-listed enums (megatron/core/safe_globals.py) by full name, with member names by value.
# Names vary across Megatron versions and are informational only: the pickle holds the value.
MEGATRON_ENUMS: dict[str, dict[Any, str]] = {
    "megatron.core.enums.ModelType": {
        1: "encoder_or_decoder", 2: "encoder_and_decoder", 3: "retro_encoder", 4: "retro_decoder",
    },
    "megatron.core.transformer.enums.AttnBackend": {
        1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto",
    },
    "megatron.core.transformer.enums.CudaGraphScope": {
        1: "full_iteration", 2: "attn", 3: "mlp", 4: "moe", 5: "moe_router", 6: "moe_preprocess", 7: "mamba",
        8: "full_iteration_inference",
    },
    "megatron.core.transformer.enums.CudaGraphModule": {
        1: "attn", 2: "mlp", 3: "moe", 4: "moe_router", 5: "moe_preprocess", 6: "mamba",
    },
    "megatron.core.transformer.enums.InferenceCudaGraphScope": {1: "none", 2: "layer", 3: "block"},
    "megatron.core.rerun_state_machine.RerunDiagnostic": {
        "correct_result": "CORRECT_RESULT", "transient_error": "TRANSIENT_ERROR",
        "persistent_error": "PERSISTENT_ERROR",
    },
    "megatron.core.rerun_state_machine.RerunMode": {
        "disabled": "DISABLED", "validate_results": "VALIDATE_RESULTS",
        "report_determinism_stats": "REPORT_DETERMINISM_STATS",
    },
    "megatron.core.rerun_state_machine.RerunState": {
        0: "NOT_RUNNING_YET", 1: "INITIAL_RUN", 2: "RERUNNING_IN_PLACE", 3: "WILL_RERUN_FROM_CHECKPOINT",
        4: "RERUNNING_FROM_CHECKPOINT", 5: "RERUNNING_AGAIN_FROM_CHECKPOINT",
    },
}
MEGATRON_RECORDS: frozenset[str] = frozenset({"megatron.core.optimizer.optimizer_config.OptimizerConfig"})
_MARK = "__tiered_ckpt_stand_in__"
_lock = threading.RLock()
_classes: dict[str, type] = {}


class MegatronEnumStandIn:
    """A Megatron enum member: ``value`` (what the pickle holds) and ``name`` (None for an unknown value).

    Members are cached per value, so ``is`` and ``==`` behave like an Enum's.
    """

    __slots__ = ("value", "name")
    _full_name: ClassVar[str]
    _names: ClassVar[dict[Any, str]]
    _members: ClassVar[dict[Any, MegatronEnumStandIn]]

    def __new__(cls, value: Any) -> MegatronEnumStandIn:
        with _lock:
            member = cls._members.get(value)
            if member is None:
                member = object.__new__(cls)
                object.__setattr__(member, "value", value)
                object.__setattr__(member, "name", cls._names.get(value))
                cls._members[value] = member
            return member

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__qualname__} members are read-only")

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return (pickle_target(type(self)), (self.value,))

    def __reduce_by_name__(self) -> NamedReduce:
        return NamedReduce(type(self).__module__, type(self).__qualname__, (self.value,))

    def __copy__(self) -> MegatronEnumStandIn:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> MegatronEnumStandIn:
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__}.{self.name or '?'}: {self.value!r}>"


class MegatronRecordStandIn:
    """A Megatron dataclass (``OptimizerConfig``): its fields as attributes."""

    _full_name: ClassVar[str]

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        target = pickle_target(type(self))
        state = dict(self.__dict__)
        if target is type(self):
            return (copyreg.__newobj__, (target,), state)  # NEWOBJ + BUILD, as the dataclass pickles
        return (target, (), state)  # the real class: built with its defaults, then BUILD sets the fields

    def __reduce_by_name__(self) -> NamedReduce:
        return NamedReduce(type(self).__module__, type(self).__qualname__, (), dict(self.__dict__), newobj=True)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__qualname__}({fields})"


def stand_in(full_name: str) -> type | None:
    """The stand-in class for a Megatron allow-listed global (created once), or None for any other name."""
    with _lock:
        cls = _classes.get(full_name)
        if cls is not None:
            return cls
        module, _, qualname = full_name.rpartition(".")
        if full_name in MEGATRON_ENUMS:
            ns = {"__slots__": (), "_names": MEGATRON_ENUMS[full_name], "_members": {}}
            base: type = MegatronEnumStandIn
        elif full_name in MEGATRON_RECORDS:
            ns, base = {}, MegatronRecordStandIn
        else:
            return None
        ns.update({"__module__": module, "__qualname__": qualname, "_full_name": full_name,
                   "__doc__": f"Inert stand-in for {full_name} (Megatron is not imported)."})
        cls = type(qualname, (base,), ns)
        _classes[full_name] = cls
        return cls


def megatron_allow_list() -> list[tuple[Any, str]]:
    """``(class, full name)`` for Megatron's allow-listed classes: the real ones when already imported."""
    out = []
    for full_name in (*MEGATRON_ENUMS, *sorted(MEGATRON_RECORDS)):
        module, _, qualname = full_name.rpartition(".")
        real = _real_class(module, qualname, import_ok=False)
        out.append((real if real is not None else stand_in(full_name), full_name))
    return out


def pickle_target(cls: type) -> type:
    """The class a stand-in pickles as: Megatron's own when it can be imported, else the stand-in (whose
    module is then registered, so that the pickler finds it under Megatron's name)."""
    module, qualname = cls.__module__, cls.__qualname__
    real = _real_class(module, qualname, import_ok=True)
    if real is not None:
        return real
    with _lock:
        top = module.partition(".")[0]
        # PyImport_Import needs *a* top-level module (any will do, even a namespace package) and the leaf.
        for name in dict.fromkeys((top, module)):
            mod = sys.modules.get(name)
            if mod is None:
                mod = types.ModuleType(name, f"tiered_ckpt placeholder for {name} (no Megatron installed)")
                mod.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="tiered_ckpt stand-in")
                setattr(mod, _MARK, True)
                sys.modules[name] = mod
            elif name == module and not _is_placeholder(mod):
                raise pickle.PicklingError(
                    f"cannot pickle {qualname} with this pickler: {module} is imported but has no {qualname} (the "
                    "checkpoint comes from another Megatron version); write it with "
                    "tiered_ckpt.megatron.torch_zip.iter_torch_save, which emits the original global")
        setattr(sys.modules[module], qualname, cls)
    return cls


def _is_placeholder(mod: Any) -> bool:
    # vars(), not getattr(): some modules (torch.ops) answer every attribute
    return isinstance(mod, types.ModuleType) and vars(mod).get(_MARK) is True


def remove_stand_in_modules() -> list[str]:
    """Take the placeholder modules out of ``sys.modules`` (say, before importing the real Megatron)."""
    with _lock:
        names = [n for n, m in list(sys.modules.items()) if _is_placeholder(m)]
        for n in names:
            del sys.modules[n]
    return names


def _real_class(module: str, qualname: str, *, import_ok: bool) -> type | None:
    mod = sys.modules.get(module)
    if mod is not None:
        return None if _is_placeholder(mod) else getattr(mod, qualname, None)
    if not import_ok or not _installed(module):
        return None
    try:
        return getattr(importlib.import_module(module), qualname, None)
    except Exception as exc:  # Megatron installed but broken: fall back to the stand-in
        log.debug("cannot import %s (%r); pickling the stand-in", module, exc)
        return None


def _installed(module: str) -> bool:
    """Whether ``module``'s source is there to import, found without importing anything (a directory named
    ``megatron`` on sys.path, such as a test folder, is not Megatron)."""
    top, *middle, leaf = module.split(".")
    top_mod = sys.modules.get(top)
    if top_mod is not None:
        if _is_placeholder(top_mod):
            return False
        locations = list(getattr(top_mod, "__path__", []))
    else:
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: finds, does not import
        except (ImportError, ValueError):
            return False
        locations = list(spec.submodule_search_locations or []) if spec else []
    for part in middle:
        locations = [os.path.join(loc, part) for loc in locations if os.path.isdir(os.path.join(loc, part))]
    return any(os.path.isfile(os.path.join(loc, leaf + ".py")) or os.path.isdir(os.path.join(loc, leaf))
               for loc in locations)


class _TrustingUnpickler(pickle.Unpickler):
    """Full unpickling (``trust_pickles=True``), with stand-ins for Megatron's classes if it is missing."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            cls = stand_in(f"{module}.{name}")
            if cls is None:
                raise
            return cls


def trusting_pickle_module() -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load(weights_only=False)`` that falls back to stand-ins."""
    mod = types.ModuleType(__name__ + ".trusting_pickle")
    for attr in ("Pickler", "dump", "dumps", "loads", "HIGHEST_PROTOCOL", "DEFAULT_PROTOCOL", "PickleError",
                 "PicklingError", "UnpicklingError"):
        setattr(mod, attr, getattr(pickle, attr))
    mod.Unpickler = _TrustingUnpickler  # type: ignore[attr-defined]
    mod.load = lambda f, **kw: _TrustingUnpickler(f, **kw).load()  # type: ignore[attr-defined]
    return mod
