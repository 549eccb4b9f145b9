"""Stand-ins for classes that are not imported here, pickled under the original class's global name.

Restoring a snapshot never imports modules (importing runs code), so an enum member whose class is not imported
in the restoring process (Megatron's ``ModelType`` inside ``args``, in a drain worker that never imported
Megatron) comes back as an inert stand-in that remembers ``(module, qualname, value)``. A file written from it
must name the original global, byte for byte as if the real object had been pickled: Megatron's weights-only
loader accepts ``megatron.core.enums.ModelType`` and refuses anything else.

Python's C pickler only writes a ``GLOBAL`` after importing the module and finding the very same class there,
so stand-ins go through :class:`ByNamePickler`, the pure-Python pickler with one addition: an object that
implements ``__reduce_by_name__()`` is written as the :class:`NamedReduce` it returns, its class written as a
``GLOBAL`` by name. Everything else is pickled exactly as the C pickler pickles it (same opcodes, same memo), so
a file holds the same bytes whichever process wrote it (see docs/architecture.md, "Writing Megatron files").
"""

from __future__ import annotations

import _compat_pickle
import pickle
from dataclasses import dataclass
from typing import Any, BinaryIO


@dataclass(frozen=True)
class NamedReduce:
    """How a stand-in pickles: ``module.qualname(*args)`` (REDUCE), or ``cls.__new__(cls, *args)`` (NEWOBJ) when
    ``newobj``; then ``state`` applied by BUILD unless None."""

    module: str
    qualname: str
    args: tuple[Any, ...] = ()
    state: Any = None
    newobj: bool = False


def reduce_by_name(obj: Any) -> NamedReduce | None:
    """``obj``'s :class:`NamedReduce` if it is a stand-in, else None."""
    hook = getattr(type(obj), "__reduce_by_name__", None)
    return hook(obj) if hook is not None else None


class _GlobalName:
    """A class known only by name; one object per name and pickler, so the pickle memoizes it as the class."""

    __slots__ = ("module", "qualname")

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname


class NeedsByNamePickler(pickle.PicklingError):
    """Raised by :class:`StandInDetector` when a stand-in is met: pickle again with :class:`ByNamePickler`."""


class StandInDetector(pickle.Pickler):
    """The C pickler, refusing stand-ins: the fast path, retried with :class:`ByNamePickler` when it raises
    :class:`NeedsByNamePickler`."""

    def reducer_override(self, obj: Any) -> Any:
        if getattr(type(obj), "__reduce_by_name__", None) is not None:
            raise NeedsByNamePickler(f"{type(obj).__qualname__} is a stand-in")
        return NotImplemented


class ByNamePickler(pickle._Pickler):  # type: ignore[misc, name-defined]
    """The pure-Python pickler, writing stand-ins under their original global names."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: BinaryIO, protocol: int | None = None, **kwargs: Any):
        super().__init__(file, protocol, **kwargs)
        self._names: dict[tuple[str, str], _GlobalName] = {}
        self._members: dict[tuple[Any, ...], Any] = {}

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        named = reduce_by_name(obj) if not isinstance(obj, type) else None
        if named is None:
            super().save(obj, save_persistent_id)
            return
        # One enum member is one object: equal stand-ins restored separately still pickle as one memo entry.
        key = (named.module, named.qualname, named.newobj, _freeze(named.args)) if named.state is None else None
        first = self._members.setdefault(key, obj) if key is not None else obj
        memo = self.memo.get(id(first))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        cls = self._names.setdefault((named.module, named.qualname), _GlobalName(named.module, named.qualname))
        self.save(cls)
        self.save(tuple(named.args))
        self.write(pickle.NEWOBJ if named.newobj else pickle.REDUCE)
        self.memoize(first)
        if named.state is not None:
            self.save(named.state)
            self.write(pickle.BUILD)

    def save_global_name(self, obj: _GlobalName) -> None:
        module, name = obj.module, obj.qualname
        if self.proto >= 4:
            self.save(module)
            self.save(name)
            self.write(pickle.STACK_GLOBAL)
        else:
            if self.fix_imports and self.proto < 3:  # the same renaming the C pickler does for protocols < 3
                r_name_mapping = _compat_pickle.REVERSE_NAME_MAPPING
                r_import_mapping = _compat_pickle.REVERSE_IMPORT_MAPPING
                if (module, name) in r_name_mapping:
                    module, name = r_name_mapping[(module, name)]
                elif module in r_import_mapping:
                    module = r_import_mapping[module]
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + name.encode("utf-8") + b"\n")
        self.memoize(obj)

    dispatch[_GlobalName] = save_global_name


def _freeze(args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        hash(args)
        return args
    except TypeError:
        return (id(args),)


def dumps(obj: Any, *, protocol: int, pickler: type[pickle.Pickler] | None = None, **kwargs: Any) -> bytes:
    """``pickle.dumps(obj, protocol)`` with the C pickler class ``pickler`` (a subclass of
    :class:`StandInDetector` may add ``persistent_id``), or, when ``obj`` holds stand-ins, the same with
    :class:`ByNamePickler`. ``kwargs`` go to both (``persistent_id`` through a subclass)."""
    import io

    buf = io.BytesIO()
    try:
        (pickler or StandInDetector)(buf, protocol=protocol, **kwargs).dump(obj)
        return buf.getvalue()
    except NeedsByNamePickler:
        pass
    buf = io.BytesIO()
    slow = _by_name_class(pickler)
    slow(buf, protocol=protocol, **kwargs).dump(obj)
    return buf.getvalue()


def _by_name_class(pickler: type[pickle.Pickler] | None) -> type[ByNamePickler]:
    """:class:`ByNamePickler` with the ``persistent_id`` of ``pickler``."""
    pid = getattr(pickler, "persistent_id", None) if pickler is not None else None
    if pid is None or pickler is StandInDetector:
        return ByNamePickler
    return type(f"ByName{pickler.__name__}", (ByNamePickler,), {"persistent_id": pid})
