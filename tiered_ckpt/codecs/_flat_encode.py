"""The encoding planner of the flat snapshot codec: :func:`plan_snapshot` walks a structure into a
:class:`~tiered_ckpt.codecs._flat_common.SnapshotPlan` (public API: :mod:`tiered_ckpt.codecs.flat`)."""

from __future__ import annotations

import argparse
import base64
import collections
import enum
import io
import pathlib
import struct
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from tiered_ckpt.codecs._flat_common import (
    _DTYPE_NAME,
    _MAX_SAFE_INT,
    _PATH_CLASSES,
    _RAW_COPY_DTYPES,
    _STORABLE_DTYPES,
    ALIGNMENT,
    INLINE_BYTES_MAX,
    PLACEMENT_MODULUS,
    EnumStandIn,
    PlanMemo,
    SnapshotPlan,
    TensorEntry,
    _check_np_dtype,
    _from_numpy,
    _gc_paused,
    _type_name,
)
from tiered_ckpt.errors import EncodeError


def _cannot(obj: Any, path: str, what: str = "object") -> EncodeError:
    hint = ""
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        hint = ("; a module or an optimizer is not state: save its .state_dict() (or the items "
                "tiered_ckpt.state.items_of(model=..., optimizer=...) builds)")
    return EncodeError(f"cannot encode {what} of type {_type_name(obj)} without pickle{hint}", path=path)


def _child(path: str, key: Any) -> str:
    if not path and type(key) is str and key.isidentifier():
        return key
    return f"{path}[{key!r}]"


def _float_node(x: float) -> Any:
    if x - x == 0.0:  # finite: repr round-trips exactly through JSON
        return x
    if x != x:
        (bits,) = struct.unpack("<Q", struct.pack("<d", x))
        return {"$": "float", "bits": f"{bits:016x}"}
    return {"$": "float", "hex": x.hex()}


def _int_node(x: int) -> Any:
    if -_MAX_SAFE_INT <= x <= _MAX_SAFE_INT:
        return x
    return {"$": "int", "hex": hex(x)}


_DEVICE_STR: dict[torch.device, str] = {}


def _device_str(device: torch.device) -> str:
    s = _DEVICE_STR.get(device)
    if s is None:
        s = _DEVICE_STR[device] = str(device)
    return s


_BARE_TYPES = frozenset((str, bool, type(None)))


def _is_bare(v: Any) -> bool:
    """Whether ``v`` is stored as itself, a bare JSON scalar (the fast path of the walk)."""
    t = type(v)
    if t in _BARE_TYPES:
        return True
    if t is int:
        return -_MAX_SAFE_INT <= v <= _MAX_SAFE_INT
    return t is float and v - v == 0.0


Placement = Callable[[], Mapping[int, int] | None]


class _Planner:
    __slots__ = ("entries", "sources", "seen", "cursor", "args", "source_keys", "previous", "same_sources",
                 "placement", "_placed")

    def __init__(self, previous: PlanMemo | None = None, placement: Placement | None = None) -> None:
        self.entries: list[TensorEntry] = []
        self.sources: list[torch.Tensor] = []
        self.seen: dict[Any, int] = {}
        self.cursor = 0
        self.args: list[tuple] = []
        self.source_keys: list[Any] = []
        self.previous = previous  # None once an entry differs from the previous plan's (PlanMemo)
        self.same_sources = previous is not None
        self.placement = placement
        self._placed: Mapping[int, int] | None = None  # what ``placement`` gave, once an entry is placed anew

    def add(self, entry_args: tuple, src: torch.Tensor, nbytes: int, source_key: Any = None,
            placed_id: int | None = None) -> int:
        """A slot for ``src``. ``source_key``: where its bytes are (address, strides, type...), None where it
        cannot be known to be the same memory as last time (then no copy list is reused). ``placed_id``: the
        ``id`` of the tensor the placement may name."""
        i = len(self.entries)
        prev = self.previous
        # Every earlier entry matched, so an entry with the same facts goes where it went (its placement too).
        if prev is not None and i < len(prev.args) and prev.args[i] == entry_args:
            entry = prev.entries[i]
            if source_key is None or prev.source_keys[i] != source_key:
                self.same_sources = False
        else:
            self.previous, self.same_sources = None, False
            offset = self.cursor
            residue = self._residue(placed_id)
            if residue is not None:
                offset += (residue - offset) % PLACEMENT_MODULUS
            path, dtype, shape, kind, device, requires_grad, np_dtype = entry_args
            entry = TensorEntry(path, offset, nbytes, dtype, shape, kind, device, requires_grad, np_dtype)
        self.cursor = entry.offset + nbytes + (-nbytes % ALIGNMENT)
        self._append(entry, entry_args, source_key, src)
        return i

    def _residue(self, placed_id: int | None) -> int | None:
        """The offset modulo :data:`PLACEMENT_MODULUS` the placement asks of the tensor ``placed_id`` (None: no
        wish, or one the 64-byte alignment cannot meet). The placement is asked once per plan, and only when an
        entry is placed anew: a plan that reuses the last one keeps its placement."""
        if self.placement is None or placed_id is None:
            return None
        if self._placed is None:
            self._placed = self.placement() or {}
        residue = self._placed.get(placed_id)
        if residue is None or residue % ALIGNMENT or not 0 <= residue < PLACEMENT_MODULUS:
            return None
        return residue

    def reuse(self, i: int, src: torch.Tensor, source_key: Any) -> None:
        """Entry ``i`` of the previous plan, for the same source (:meth:`add` found to match, without its checks)."""
        entry = self.previous.entries[i]
        self.cursor = entry.offset + entry.nbytes + (-entry.nbytes % ALIGNMENT)
        self._append(entry, self.previous.args[i], source_key, src)

    def _append(self, entry: TensorEntry, entry_args: tuple, source_key: Any, src: torch.Tensor) -> None:
        self.entries.append(entry)
        self.args.append(entry_args)
        self.source_keys.append(source_key)
        self.sources.append(src)

    def memo(self) -> PlanMemo:
        """What the next plan of this structure may reuse; the previous plan's derived facts where it matched."""
        prev = self.previous
        if prev is None or len(prev.entries) != len(self.entries) or prev.total_bytes != self.cursor:
            return PlanMemo(self.args, self.source_keys, self.entries, self.cursor)
        memo = PlanMemo(prev.args, self.source_keys, prev.entries, self.cursor)
        memo.fingerprint, memo.tensors_json = prev.fingerprint, prev.tensors_json
        if self.same_sources:
            memo.copies = prev.copies
        return memo

    # -- values

    def enc(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if t is str or t is bool or obj is None:
            return obj
        if t is int:
            return _int_node(obj)
        if t is float:
            return _float_node(obj)
        handler = _ENCODERS.get(t)
        if handler is not None:
            return handler(self, obj, path)
        return self.enc_other(obj, path)

    def seq(self, obj: Any, path: str) -> list:
        out = []
        append = out.append
        for i, v in enumerate(obj):
            if _is_bare(v):
                append(v)
            else:
                append(self.enc(v, f"{path}[{i}]"))
        return out

    def enc_list(self, obj: list, path: str) -> Any:
        return self.seq(obj, path)

    def enc_tuple(self, obj: tuple, path: str) -> Any:
        return {"$": "tuple", "v": self.seq(obj, path)}

    def enc_dict(self, obj: dict, path: str, tag: str = "dict") -> Any:
        if all(type(k) is str for k in obj):
            kv = {}
            for k, v in obj.items():
                if _is_bare(v):
                    kv[k] = v
                else:
                    kv[k] = self.enc(v, _child(path, k))
            return {"$": tag, "kv": kv}
        items = [[self.enc_key(k, path), self.enc(v, _child(path, k))] for k, v in obj.items()]
        return {"$": tag, "items": items}

    def enc_odict(self, obj: collections.OrderedDict, path: str) -> Any:
        return self.enc_dict(obj, path, "odict")

    def enc_namespace(self, obj: argparse.Namespace, path: str) -> Any:
        attrs = vars(obj)
        kv = {}
        for k, v in attrs.items():
            if type(k) is not str:
                raise EncodeError(f"argparse.Namespace attribute name {k!r} is not a str", path=path)
            kv[k] = self.enc(v, f"{path}.{k}")
        return {"$": "namespace", "kv": kv}

    def enc_set(self, obj: set | frozenset, path: str) -> Any:
        tag = "set" if type(obj) is set else "frozenset"
        return {"$": tag, "v": [self.enc_key(x, path, "set element") for x in obj]}

    def enc_blob(self, data: bytes | bytearray, path: str, tag: str) -> Any:
        n = len(data)
        if n <= INLINE_BYTES_MAX:
            return {"$": tag, "b64": base64.b64encode(data).decode("ascii")}
        with warnings.catch_warnings():  # bytes are read-only; we never write through this tensor
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        idx = self.add((path, torch.uint8, (n,), "bytes", "cpu", False, None), src, n)
        return {"$": tag, "i": idx}

    def enc_bytes(self, obj: bytes, path: str) -> Any:
        return self.enc_blob(obj, path, "bytes")

    def enc_bytearray(self, obj: bytearray, path: str) -> Any:
        return self.enc_blob(obj, path, "bytearray")

    def enc_bytesio(self, obj: io.BytesIO, path: str) -> Any:
        return self.enc_blob(obj.getvalue(), path, "bytesio")

    def enc_complex(self, obj: complex, path: str) -> Any:
        return {"$": "complex", "re": _float_node(obj.real), "im": _float_node(obj.imag)}

    def enc_size(self, obj: torch.Size, path: str) -> Any:
        return {"$": "size", "v": list(obj)}

    def enc_torch_dtype(self, obj: torch.dtype, path: str) -> Any:
        return {"$": "dtype", "v": _DTYPE_NAME[obj]}

    def enc_device(self, obj: torch.device, path: str) -> Any:
        return {"$": "device", "v": str(obj)}

    def enc_enum_standin(self, obj: EnumStandIn, path: str) -> Any:
        value = self.enc(obj.value, f"{path}.value")
        return {"$": "enum", "module": obj.module, "qualname": obj.qualname, "name": obj.name, "value": value}

    def enc_tensor(self, t: torch.Tensor, path: str) -> Any:
        kind = "parameter" if type(t) is torch.nn.Parameter else "tensor"
        prev = self.previous
        if prev is not None and t.layout is torch.strided:
            i = len(self.entries)
            if i < len(prev.source_keys) and prev.args[i][0] == path:
                was = prev.source_keys[i]
                key = (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device, kind, t.requires_grad, t.is_conj(),
                       t.is_neg())
                # The same memory read the same way as at the last plan, which checked it: only the walk is left.
                if was is not None and was[1] is type(t) and was[0] == key and key not in self.seen:
                    self.seen[key] = i
                    src = t.view(torch.uint8) if key[1] in _RAW_COPY_DTYPES else t
                    self.reuse(i, src, was)
                    return {"$": "tensor", "i": i}
        if t.is_nested:
            raise EncodeError("cannot encode a nested tensor in a flat snapshot", path=path)
        if t.layout is not torch.strided:
            raise EncodeError(f"cannot encode a tensor with layout {t.layout} (only dense tensors)", path=path)
        if t.is_quantized:
            raise EncodeError(f"cannot encode a quantized tensor ({t.dtype}) in a flat snapshot", path=path)
        if t.is_meta:
            raise EncodeError("cannot encode a meta tensor (it has no data)", path=path)
        dtype = t.dtype
        if dtype not in _STORABLE_DTYPES:
            raise EncodeError(f"cannot encode a tensor of dtype {dtype}", path=path)
        shape = t.shape
        n = t.numel()
        requires_grad = t.requires_grad
        device = t.device
        if n:  # same memory, read the same way (conj/neg views are lazy: not the same values)
            key = (t.data_ptr(), dtype, shape, t.stride(), device, kind, requires_grad, t.is_conj(),
                   t.is_neg())
        else:
            key = ("id", id(t))
        idx = self.seen.get(key)
        if idx is None:
            src = t.view(torch.uint8) if dtype in _RAW_COPY_DTYPES else t
            args = (path, dtype, tuple(shape), kind, _device_str(device), requires_grad, None)
            source = (key, type(t)) if n else None
            idx = self.seen[key] = self.add(args, src, n * dtype.itemsize, source, id(t))
        return {"$": "tensor", "i": idx}

    def enc_ndarray(self, a: np.ndarray, path: str) -> Any:
        dt = a.dtype
        why = _check_np_dtype(dt)
        if why is not None:
            raise EncodeError(f"cannot encode an array of {why} without pickle", path=path)
        key = (
            ("np", a.__array_interface__["data"][0], a.shape, a.strides, dt.str) if a.size else ("id", id(a))
        )
        idx = self.seen.get(key)
        if idx is None:
            src = None
            if dt.isnative and dt.kind in "biufc" and all(s >= 0 for s in a.strides):
                try:
                    src = _from_numpy(a)
                except (TypeError, ValueError, RuntimeError):  # e.g. longdouble, odd strides
                    src = None
            source = key if src is not None and a.size else None
            if src is None:  # raw bytes (any byte order); the only case that copies during planning
                src = _from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            args = (path, torch.uint8, tuple(a.shape), "ndarray", "cpu", False, dt.str)
            idx = self.seen[key] = self.add(args, src, a.nbytes, source)
        return {"$": "ndarray", "i": idx}

    def enc_other(self, obj: Any, path: str) -> Any:
        if isinstance(obj, enum.Enum):
            cls = type(obj)
            value = self.enc(obj.value, f"{path}.value")
            return {
                "$": "enum",
                "module": cls.__module__,
                "qualname": cls.__qualname__,
                "name": obj.name,
                "value": value,
            }
        if isinstance(obj, torch.Tensor):
            if obj.is_nested:
                raise EncodeError("cannot encode a nested tensor in a flat snapshot", path=path)
            raise EncodeError(f"cannot encode tensor subclass {_type_name(obj)} without pickle", path=path)
        if isinstance(obj, np.ndarray) and type(obj) is np.memmap:
            return self.enc_ndarray(obj, path)
        if isinstance(obj, np.generic):
            why = _check_np_dtype(obj.dtype, scalar=True)
            if why is not None:
                raise EncodeError(f"cannot encode a numpy scalar of {why} without pickle", path=path)
            raw = obj.tobytes() if obj.dtype.itemsize else b""  # np.str_('') still gives 4 bytes
            return {"$": "npscalar", "dtype": obj.dtype.str, "b64": base64.b64encode(raw).decode()}
        if isinstance(obj, np.dtype):
            if obj.fields is not None or obj.subdtype is not None:
                raise EncodeError(f"cannot encode structured numpy dtype {obj!r}", path=path)
            return {"$": "npdtype", "v": obj.str}
        if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # namedtuple: restored as a plain tuple
            return self.enc_tuple(obj, path)
        if type(obj) is collections.defaultdict:  # restored as a plain dict: the factory is a callable
            return self.enc_dict(obj, path)
        if isinstance(obj, pathlib.PurePath) and type(obj).__name__ in _PATH_CLASSES:
            if getattr(pathlib, type(obj).__name__) is type(obj):
                return {"$": "path", "cls": type(obj).__name__, "v": str(obj)}
        raise _cannot(obj, path)

    # -- dict keys and set elements: hashable values only, always inline

    def enc_key(self, k: Any, path: str, what: str = "dict key") -> Any:
        t = type(k)
        if t is str or t is bool or k is None:
            return k
        if t is int:
            return _int_node(k)
        if t is float:
            return _float_node(k)
        if t is bytes:
            return {"$": "bytes", "b64": base64.b64encode(k).decode("ascii")}
        if t is torch.Size:
            return self.enc_size(k, path)
        if t is tuple or (isinstance(k, tuple) and hasattr(t, "_fields")):
            return {"$": "tuple", "v": [self.enc_key(x, path, what) for x in k]}
        if t is frozenset:
            return {"$": "frozenset", "v": [self.enc_key(x, path, what) for x in k]}
        if t in (complex, torch.dtype, torch.device, EnumStandIn) or isinstance(
            k, (enum.Enum, np.generic, np.dtype, pathlib.PurePath)
        ):
            return self.enc(k, path)
        raise EncodeError(f"cannot encode {what} of type {_type_name(k)} without pickle", path=path)


_ENCODERS: dict[type, Any] = {
    list: _Planner.enc_list,
    tuple: _Planner.enc_tuple,
    dict: _Planner.enc_dict,
    collections.OrderedDict: _Planner.enc_odict,
    torch.Tensor: _Planner.enc_tensor,
    torch.nn.Parameter: _Planner.enc_tensor,
    np.ndarray: _Planner.enc_ndarray,
    torch.Size: _Planner.enc_size,
    torch.dtype: _Planner.enc_torch_dtype,
    torch.device: _Planner.enc_device,
    argparse.Namespace: _Planner.enc_namespace,
    io.BytesIO: _Planner.enc_bytesio,
    bytes: _Planner.enc_bytes,
    bytearray: _Planner.enc_bytearray,
    complex: _Planner.enc_complex,
    set: _Planner.enc_set,
    frozenset: _Planner.enc_set,
    EnumStandIn: _Planner.enc_enum_standin,
}


def plan_snapshot(items: Any, *, root: str = "", previous: PlanMemo | None = None,
                  placement: Placement | None = None) -> SnapshotPlan:
    """Walk ``items`` once and assign every tensor a 64-byte-aligned slot; no tensor bytes are copied.

    ``previous``: the ``memo`` of the last plan of the same item (:class:`PlanMemo`); what still holds is reused,
    and the plan is the same as without it, but for ``placement``, which a plan reusing ``previous`` keeps.

    ``placement``: called at most once, when a tensor is placed anew (not on a plan that reuses ``previous``
    whole), it returns ``{id(tensor): offset % PLACEMENT_MODULUS}`` for tensors of ``items`` that should start at
    that offset modulo a page (a multiple of 64; others are ignored), or None. The ``megatron`` layout asks it
    so that each optimizer shard sits in memory as it sits in Megatron's file, and a direct write can send it
    from the slot.

    ``root`` prefixes the key paths used in :class:`TensorEntry` and error messages; with the default,
    top-level identifier keys are written bare (``state['optimizer'][0]``). Raises :class:`EncodeError` naming
    the key path of the first value that cannot be encoded without pickle.
    """
    planner = _Planner(previous, placement)
    try:
        with _gc_paused():
            tree = planner.enc(items, root)
            memo = planner.memo()
    except RecursionError:
        raise EncodeError("structure is nested too deeply (or contains a reference cycle)", path=root) from None
    return SnapshotPlan(memo.entries, planner.sources, planner.cursor, tree, memo)
