"""Flat snapshot codec: a nested state dict <-> one contiguous byte buffer plus a JSON header (never pickle).

This is what the memory tiers (``shm``, ``gpu``) hold and what the engine's blocking ``save()`` copies into,
so the copy runs at memory speed: :func:`plan_snapshot` walks the structure once (no tensor bytes touched),
and :func:`copy_into` does one ``Tensor.copy_`` per tensor straight into its slot of the destination buffer.

Buffer
    Every tensor (and numpy array, and large ``bytes`` blob) gets a slot at an offset that is a multiple of
    :data:`ALIGNMENT` (64) bytes, in the order the walk meets them; ``total_bytes`` is rounded up to 64 too.
    Slots hold the C-contiguous bytes in native byte order (numpy arrays: in the array's own byte order).
    Tensors that are the same object, or the same view of the same storage (tied embeddings), get one slot.

Header (UTF-8 JSON, pure ASCII)::

    {"format": "tiered_ckpt.flat", "version": 1, "alignment": 64, "total_bytes": N, "fingerprint": "<hex>",
     "tensors": [{"path": "state['model']['w']", "kind": "tensor|parameter|ndarray|bytes", "offset": 0,
                  "nbytes": 64, "dtype": "float32", "shape": [4, 4], "device": "cuda:0",
                  "requires_grad": true, "np_dtype": "<f4"}, ...],
     "tree": <node>}

Tree nodes: ``str``, ``bool``, ``null``, integers within +-(2**53 - 1) and finite floats are bare JSON
values (Python's float repr round-trips exactly, -0.0 included); a bare JSON array is a ``list``; every other
value is an object tagged by ``"$"``: ``dict``/``odict`` (``"kv"``: an object when every key is a str, else
``"items"``: ``[[key, value], ...]``), ``tuple``, ``set``, ``frozenset``, ``int`` (hex string), ``float``
(``"hex"`` for +-inf, ``"bits"`` for NaN, payload kept), ``complex``, ``bytes``/``bytearray``/``bytesio``
(``"b64"`` inline, or ``"i"``: a slot), ``tensor``/``ndarray`` (``"i"``: index into ``tensors``),
``npscalar``, ``npdtype``, ``dtype``, ``device``, ``size``, ``namespace``, ``enum``, ``path``.

Documented narrowings: a namedtuple is restored as a plain tuple, a ``defaultdict`` as a plain ``dict`` (its
factory is a callable), an ``np.memmap`` as an ``ndarray``; identity is kept for tensors and arrays only.
Anything that cannot be represented without pickle raises :class:`~tiered_ckpt.errors.EncodeError` naming its
key path.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import contextlib
import enum
import gc
import hashlib
import io
import json
import math
import pathlib
import re
import struct
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from tiered_ckpt.errors import DecodeError, EncodeError

__all__ = [
    "ALIGNMENT",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INLINE_BYTES_MAX",
    "EnumStandIn",
    "HeaderInfo",
    "SnapshotPlan",
    "TensorEntry",
    "copy_into",
    "decode_header",
    "encode_header",
    "plan_snapshot",
    "restore",
]

FORMAT_NAME = "tiered_ckpt.flat"
FORMAT_VERSION = 1
ALIGNMENT = 64
#: ``bytes``/``bytearray``/``BytesIO`` contents up to this size are inlined (base64) in the header; larger
#: ones get a slot in the buffer.
INLINE_BYTES_MAX = 4096

_MAX_SAFE_INT = 2**53 - 1
_TENSOR_KINDS = ("tensor", "parameter")
_KINDS = ("tensor", "parameter", "ndarray", "bytes")
_NP_KINDS = "biufcmMSU"  # numeric, datetime and fixed-width string dtypes; never object ("O") or void ("V")
_PATH_CLASSES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")


def _dtype_tables() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype], frozenset[torch.dtype]]:
    names: dict[torch.dtype, str] = {}
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype):
            names[value] = str(value).removeprefix("torch.")
    quantized = {n for n in names.values() if n.startswith(("qint", "quint"))}
    storable = {n: d for d, n in names.items() if n not in quantized}
    # Sub-byte dtypes have no copy kernel: their bytes are copied through a uint8 view instead.
    raw = frozenset(d for n, d in storable.items() if re.fullmatch(r"u?int[1-7]", n))
    return names, storable, raw


_DTYPE_NAME, _DTYPE_BY_NAME, _RAW_COPY_DTYPES = _dtype_tables()
_ANY_DTYPE_BY_NAME = {n: d for d, n in _DTYPE_NAME.items()}  # dtype *values* may be quantized dtypes too
_STORABLE_DTYPES = frozenset(_DTYPE_BY_NAME.values())


class TensorEntry(NamedTuple):
    """One slot of the buffer.

    ``dtype``/``shape`` describe the stored tensor; for ``ndarray`` slots ``dtype`` is ``torch.uint8`` (raw
    bytes), ``shape`` the array's shape and ``np_dtype`` the numpy dtype string; ``bytes`` slots have
    ``shape == (nbytes,)``.
    """

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str = "tensor"
    device: str = "cpu"
    requires_grad: bool = False
    np_dtype: str | None = None


@dataclass(frozen=True)
class EnumStandIn:
    """An enum member whose class is not importable without running code (module not in ``sys.modules``).

    Restoring never imports modules; this inert record keeps what was saved and encodes back to the same node.
    """

    module: str
    qualname: str
    name: str | None
    value: Any

    def __repr__(self) -> str:
        return f"<EnumStandIn {self.module}.{self.qualname}.{self.name}: {self.value!r}>"


class SnapshotPlan:
    """The result of :func:`plan_snapshot`: where every tensor goes, and the header tree."""

    __slots__ = ("tensors", "sources", "total_bytes", "tree", "_fingerprint", "_views")

    def __init__(self, tensors: list[TensorEntry], sources: list[torch.Tensor], total_bytes: int, tree: Any):
        self.tensors = tensors
        self.sources = sources
        self.total_bytes = total_bytes
        self.tree = tree
        self._fingerprint: str | None = None
        self._views: tuple[Any, ...] | None = None

    @property
    def fingerprint(self) -> str:
        """Hash of the buffer layout (paths, kinds, dtypes, shapes, offsets). Equal => identical offsets."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self.tensors, self.total_bytes)
        return self._fingerprint

    def __repr__(self) -> str:
        return f"SnapshotPlan(tensors={len(self.tensors)}, total_bytes={self.total_bytes})"


@dataclass(frozen=True)
class HeaderInfo:
    """A parsed and validated header (see :func:`decode_header`)."""

    version: int
    total_bytes: int
    alignment: int
    fingerprint: str
    tensors: tuple[TensorEntry, ...]
    tree: Any = field(repr=False)


def _fingerprint(entries: list[TensorEntry] | tuple[TensorEntry, ...], total_bytes: int) -> str:
    lines = [f"{FORMAT_NAME}/{FORMAT_VERSION}/{ALIGNMENT}/{total_bytes}"]
    lines += [
        f"{e.path}\0{e.kind}\0{_DTYPE_NAME[e.dtype]}\0{e.np_dtype}\0{e.shape}\0{e.offset}\0{e.nbytes}"
        for e in entries
    ]
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# ------------------------------------------------------------------------------------------------ encoding


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold off the cyclic GC while building many small containers (walk, header): in a process holding
    thousands of tensors, the full collections those allocations trigger cost more than the work itself
    (measured: encode_header of a 12k-tensor state 170 ms -> 65 ms). Nothing built here forms cycles."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _where(path: str) -> str:
    return path or "<root>"


def _cannot(obj: Any, path: str, what: str = "object") -> EncodeError:
    return EncodeError(f"{_where(path)}: cannot encode {what} of type {_type_name(obj)} without pickle")


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


def _contiguous_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d if d > 1 else 1
    return tuple(reversed(strides))


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():  # read-only arrays: we only ever read from the tensor
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _check_np_dtype(dt: np.dtype, scalar: bool = False) -> str | None:
    """Why ``dt`` cannot be stored, or None (empty strings, np.str_(''), have a zero itemsize)."""
    if dt.hasobject or dt.kind not in _NP_KINDS or dt.fields is not None or dt.subdtype is not None:
        return f"numpy dtype {dt.str!r}"
    if dt.itemsize == 0 and not (scalar and dt.kind in "SU"):
        return f"zero-size numpy dtype {dt.str!r}"
    return None


class _Planner:
    __slots__ = ("entries", "sources", "seen", "cursor")

    def __init__(self) -> None:
        self.entries: list[TensorEntry] = []
        self.sources: list[torch.Tensor] = []
        self.seen: dict[Any, int] = {}
        self.cursor = 0

    def add(self, entry_args: tuple, src: torch.Tensor, nbytes: int) -> int:
        offset = self.cursor
        self.cursor = offset + nbytes + (-nbytes % ALIGNMENT)
        path, dtype, shape, kind, device, requires_grad, np_dtype = entry_args
        self.entries.append(
            TensorEntry(path, offset, nbytes, dtype, shape, kind, device, requires_grad, np_dtype)
        )
        self.sources.append(src)
        return len(self.entries) - 1

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
                raise EncodeError(f"{_where(path)}: argparse.Namespace attribute name {k!r} is not a str")
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
        where = _where(path)
        if t.is_nested:
            raise EncodeError(f"{where}: cannot encode a nested tensor in a flat snapshot")
        if t.layout is not torch.strided:
            raise EncodeError(f"{where}: cannot encode a tensor with layout {t.layout} (only dense tensors)")
        if t.is_quantized:
            raise EncodeError(f"{where}: cannot encode a quantized tensor ({t.dtype}) in a flat snapshot")
        if t.is_meta:
            raise EncodeError(f"{where}: cannot encode a meta tensor (it has no data)")
        dtype = t.dtype
        if dtype not in _STORABLE_DTYPES:
            raise EncodeError(f"{where}: cannot encode a tensor of dtype {dtype}")
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
            idx = self.seen[key] = self.add(args, src, n * dtype.itemsize)
        return {"$": "tensor", "i": idx}

    def enc_ndarray(self, a: np.ndarray, path: str) -> Any:
        dt = a.dtype
        why = _check_np_dtype(dt)
        if why is not None:
            raise EncodeError(f"{_where(path)}: cannot encode an array of {why} without pickle")
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
            if src is None:  # raw bytes (any byte order); the only case that copies during planning
                src = _from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            args = (path, torch.uint8, tuple(a.shape), "ndarray", "cpu", False, dt.str)
            idx = self.seen[key] = self.add(args, src, a.nbytes)
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
                raise EncodeError(f"{_where(path)}: cannot encode a nested tensor in a flat snapshot")
            raise EncodeError(
                f"{_where(path)}: cannot encode tensor subclass {_type_name(obj)} without pickle"
            )
        if isinstance(obj, np.ndarray) and type(obj) is np.memmap:
            return self.enc_ndarray(obj, path)
        if isinstance(obj, np.generic):
            why = _check_np_dtype(obj.dtype, scalar=True)
            if why is not None:
                raise EncodeError(f"{_where(path)}: cannot encode a numpy scalar of {why} without pickle")
            raw = obj.tobytes() if obj.dtype.itemsize else b""  # np.str_('') still gives 4 bytes
            return {"$": "npscalar", "dtype": obj.dtype.str, "b64": base64.b64encode(raw).decode()}
        if isinstance(obj, np.dtype):
            if obj.fields is not None or obj.subdtype is not None:
                raise EncodeError(f"{_where(path)}: cannot encode structured numpy dtype {obj!r}")
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
        raise EncodeError(f"{_where(path)}: cannot encode {what} of type {_type_name(k)} without pickle")


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


def plan_snapshot(items: Any, *, root: str = "") -> SnapshotPlan:
    """Walk ``items`` once and assign every tensor a 64-byte-aligned slot; no tensor bytes are copied.

    ``root`` prefixes the key paths used in :class:`TensorEntry` and error messages; with the default,
    top-level identifier keys are written bare (``state['optimizer'][0]``). Raises :class:`EncodeError` naming
    the key path of the first value that cannot be encoded without pickle.
    """
    planner = _Planner()
    try:
        with _gc_paused():
            tree = planner.enc(items, root)
    except RecursionError:
        raise EncodeError(
            f"{_where(root)}: structure is nested too deeply (or contains a reference cycle)"
        ) from None
    return SnapshotPlan(planner.entries, planner.sources, planner.cursor, tree)


def _check_buffer(buf: Any, need: int, what: str, exc: type[Exception]) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        desc = f"{buf.dtype} tensor of dim {buf.dim()}" if isinstance(buf, torch.Tensor) else _type_name(buf)
        raise TypeError(f"{what} must be a 1-D torch.uint8 tensor, got {desc}")
    if buf.numel() > 1 and buf.stride(0) != 1:
        raise ValueError(f"{what} must be contiguous (stride 1), got stride {buf.stride(0)}")
    if buf.numel() < need:
        raise exc(f"{what} holds {buf.numel()} bytes but the snapshot needs {need}")


def _typed_base(buf: torch.Tensor, total: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    try:
        return buf.narrow(0, 0, total).view(dtype)
    except RuntimeError:
        raise ValueError(
            f"{what} must start at a storage offset that is a multiple of {dtype.itemsize} bytes to hold "
            f"{dtype} data (got storage offset {buf.storage_offset()})"
        ) from None


def _dest_views(plan: SnapshotPlan, dest: torch.Tensor) -> tuple[list, list, list]:
    """Views of ``dest`` typed and shaped like the sources, their non_blocking flags, CUDA devices to sync."""
    key = (dest.data_ptr(), dest.numel(), dest.device)
    cached = plan._views
    if cached is not None and cached[0] == key:
        return cached[1], cached[2], cached[3]
    with _gc_paused():
        plan._views = (key, *_build_views(plan, dest))
    return plan._views[1], plan._views[2], plan._views[3]


def _build_views(plan: SnapshotPlan, dest: torch.Tensor) -> tuple[list, list, list]:
    total = plan.total_bytes
    ddev = dest.device
    bases: dict[torch.dtype, tuple[torch.Tensor, int, int]] = {}
    flags: dict[torch.device, bool] = {}
    views, non_blocking = [], []
    for entry, src in zip(plan.tensors, plan.sources, strict=True):
        dtype = src.dtype
        typed = bases.get(dtype)
        if typed is None:
            base = _typed_base(dest, total, dtype, "copy_into destination")
            typed = bases[dtype] = (base, base.storage_offset(), dtype.itemsize)
        base, start, itemsize = typed
        shape = src.shape
        # A contiguous source's strides differ from the canonical ones only on dims of size <= 1: harmless.
        strides = src.stride() if src.is_contiguous() else _contiguous_strides(shape)
        views.append(base.as_strided(shape, strides, start + entry.offset // itemsize))
        sdev = src.device
        nb = flags.get(sdev)
        if nb is None:  # CPU -> CPU: plain copy; anything involving CUDA: async, one synchronize at the end
            nb = flags[sdev] = sdev.type == "cuda" or ddev.type == "cuda"
        non_blocking.append(nb)
    sync = sorted({d for d in (*flags, ddev) if d.type == "cuda"}, key=str)
    return views, non_blocking, sync


def copy_into(plan: SnapshotPlan, dest: torch.Tensor, *, synchronize: bool = True) -> None:
    """Copy every source of ``plan`` into its slot of ``dest`` (a 1-D uint8 tensor of >= ``total_bytes``).

    CPU -> CPU is a plain ``copy_``; copies involving CUDA are issued with ``non_blocking=True`` and, unless
    ``synchronize=False``, followed by one synchronize per CUDA device involved (so the sources may be
    modified as soon as this returns). ``dest`` must start at a storage offset aligned to the largest element
    size stored (16 bytes covers every dtype).
    """
    _check_buffer(dest, plan.total_bytes, "copy_into destination", ValueError)
    if not plan.sources:
        return
    views, non_blocking, sync = _dest_views(plan, dest)
    with torch.no_grad():
        for view, src, nb in zip(views, plan.sources, non_blocking, strict=True):
            view.copy_(src, non_blocking=nb)
    if synchronize:
        for device in sync:
            torch.cuda.synchronize(device)


# -------------------------------------------------------------------------------------------------- header


def _entry_json(e: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"path": e.path, "kind": e.kind, "offset": e.offset, "nbytes": e.nbytes}
    if e.kind == "ndarray":
        out["np_dtype"] = e.np_dtype
        out["shape"] = list(e.shape)
    elif e.kind == "bytes":
        pass
    else:
        out["dtype"] = _DTYPE_NAME[e.dtype]
        out["shape"] = list(e.shape)
        out["device"] = e.device
        if e.requires_grad:
            out["requires_grad"] = True
    return out


def encode_header(plan: SnapshotPlan) -> bytes:
    """The snapshot header: compact, pure-ASCII JSON (see the module docstring for the format)."""
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "alignment": ALIGNMENT,
        "total_bytes": plan.total_bytes,
        "fingerprint": plan.fingerprint,
        "tensors": [_entry_json(e) for e in plan.tensors],
        "tree": plan.tree,
    }
    with _gc_paused():
        text = json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.encode("ascii")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _get(doc: dict, name: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if name not in doc:
        if default is not ...:
            return default
        raise DecodeError(f"snapshot header: {where} lacks field {name!r}")
    value = doc[name]
    if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise DecodeError(
            f"snapshot header: {where} field {name!r} has the wrong type ({type(value).__name__})"
        )
    return value


def _decode_entry(i: int, raw: Any, total: int, alignment: int) -> TensorEntry:
    where = f"tensor table entry {i}"
    if type(raw) is not dict:
        raise DecodeError(f"snapshot header: {where} is not an object")
    path = _get(raw, "path", str, where)
    kind = _get(raw, "kind", str, where)
    if kind not in _KINDS:
        raise DecodeError(f"snapshot header: {where} has unknown kind {kind!r}")
    offset = _get(raw, "offset", int, where)
    nbytes = _get(raw, "nbytes", int, where)
    if offset < 0 or nbytes < 0:
        raise DecodeError(f"snapshot header: {where} has a negative offset or size ({offset}, {nbytes})")
    if offset % alignment:
        raise DecodeError(f"snapshot header: {where} offset {offset} is not a multiple of {alignment}")
    if offset + nbytes > total:
        raise DecodeError(
            f"snapshot header: {where} ({path}) spans bytes {offset}..{offset + nbytes}, "
            f"beyond total_bytes {total}"
        )
    np_dtype = None
    device = "cpu"
    requires_grad = False
    if kind == "bytes":
        dtype, shape, itemsize = torch.uint8, (nbytes,), 1
    else:
        shape_raw = _get(raw, "shape", list, where)
        if not all(_is_int(d) and d >= 0 for d in shape_raw):
            raise DecodeError(f"snapshot header: {where} has an invalid shape {shape_raw!r}")
        shape = tuple(shape_raw)
        if kind == "ndarray":
            np_dtype = _get(raw, "np_dtype", str, where)
            try:
                dt = np.dtype(np_dtype)
            except (TypeError, ValueError):
                raise DecodeError(
                    f"snapshot header: {where} has an invalid numpy dtype {np_dtype!r}"
                ) from None
            why = _check_np_dtype(dt)
            if why is not None:
                raise DecodeError(f"snapshot header: {where}: unsupported {why}")
            dtype, itemsize = torch.uint8, dt.itemsize
        else:
            name = _get(raw, "dtype", str, where)
            dtype = _DTYPE_BY_NAME.get(name)
            if dtype is None:
                raise DecodeError(f"snapshot header: {where} has unknown dtype {name!r}")
            itemsize = dtype.itemsize
            device = _get(raw, "device", str, where, "cpu")
            requires_grad = _get(raw, "requires_grad", bool, where, False)
            if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
                raise DecodeError(f"snapshot header: {where}: a {name} tensor cannot require grad")
    expected = math.prod(shape) * itemsize
    if nbytes != expected:
        raise DecodeError(
            f"snapshot header: {where} has nbytes {nbytes}, but its shape and dtype need {expected}"
        )
    return TensorEntry(path, offset, nbytes, dtype, shape, kind, device, requires_grad, np_dtype)


def decode_header(data: bytes | bytearray | memoryview | str) -> HeaderInfo:
    """Parse and validate a header made by :func:`encode_header`; raise :class:`DecodeError` if malformed."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"snapshot header is not UTF-8: {e}") from None
    elif isinstance(data, str):
        text = data
    else:
        raise DecodeError(f"snapshot header must be bytes or str, got {_type_name(data)}")
    with _gc_paused():
        return _decode_text(text)


def _decode_text(text: str) -> HeaderInfo:
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise DecodeError(f"snapshot header is not valid JSON: {e}") from None
    if type(doc) is not dict:
        raise DecodeError("snapshot header: the top level is not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise DecodeError(f"snapshot header: format is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = doc.get("version")
    if not _is_int(version) or version != FORMAT_VERSION:
        raise DecodeError(
            f"snapshot header: unsupported version {version!r} (this reader knows {FORMAT_VERSION})"
        )
    alignment = _get(doc, "alignment", int, "the header")
    if alignment != ALIGNMENT:
        raise DecodeError(f"snapshot header: alignment {alignment}, expected {ALIGNMENT}")
    total = _get(doc, "total_bytes", int, "the header")
    if total < 0 or total % alignment:
        raise DecodeError(f"snapshot header: invalid total_bytes {total}")
    fingerprint = _get(doc, "fingerprint", str, "the header")
    table = _get(doc, "tensors", list, "the header")
    if "tree" not in doc:
        raise DecodeError("snapshot header lacks field 'tree'")
    entries = tuple(_decode_entry(i, raw, total, alignment) for i, raw in enumerate(table))
    if _fingerprint(entries, total) != fingerprint:
        raise DecodeError("snapshot header: the fingerprint does not match the tensor table")
    info = HeaderInfo(FORMAT_VERSION, total, alignment, fingerprint, entries, doc["tree"])
    _decode_tree(info, None)  # validate the whole tree now, so restore() cannot fail on its structure
    return info


# ------------------------------------------------------------------------------------------------ decoding


class _NodeError(Exception):
    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg
        self.where: list[str] = []


class _Placeholder:
    """Stands for a buffer-backed value while validating a header without a buffer."""

    __slots__ = ()


_PLACEHOLDER = _Placeholder()


def _field(node: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    try:
        value = node[name]
    except KeyError:
        raise _NodeError(f"node {node.get('$')!r} lacks field {name!r}") from None
    if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _NodeError(f"node {node.get('$')!r} field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _b64(node: dict) -> bytes:
    try:
        return base64.b64decode(_field(node, "b64", str), validate=True)
    except (binascii.Error, ValueError):
        raise _NodeError(f"node {node.get('$')!r} holds invalid base64") from None


def _decode_float(node: Any) -> float:
    if type(node) is float:
        return node
    if type(node) is int and -_MAX_SAFE_INT <= node <= _MAX_SAFE_INT:
        return float(node)
    if type(node) is dict and node.get("$") == "float":
        if "bits" in node:
            bits = _field(node, "bits", str)
            if not re.fullmatch(r"[0-9a-f]{16}", bits):
                raise _NodeError(f"invalid float bits {bits!r}")
            return struct.unpack("<d", struct.pack("<Q", int(bits, 16)))[0]
        try:
            return float.fromhex(_field(node, "hex", str))
        except ValueError:
            raise _NodeError(f"invalid float hex {node.get('hex')!r}") from None
    raise _NodeError(f"expected a float node, got {type(node).__name__}")


def _resolve_enum(module: str, qualname: str, name: str | None, value: Any) -> Any:
    obj: Any = sys.modules.get(module)  # never import: importing runs code
    for part in qualname.split("."):
        if obj is None:
            break
        namespace = getattr(obj, "__dict__", None)
        obj = namespace.get(part) if isinstance(namespace, (dict, type(type.__dict__))) else None
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        member = obj.__members__.get(name) if isinstance(name, str) else None
        if member is not None:
            return member
        if issubclass(obj, enum.Flag):  # composite flag values have no single member name
            try:
                return obj(value)
            except (ValueError, TypeError):
                pass
    return EnumStandIn(module, qualname, name, value)


class _Loader:
    """Builds buffer-backed values (tensors, arrays, blobs) for :func:`restore`, once per slot.

    Every restored tensor gets its *own* storage aliasing its slot (storage offset 0) rather than being a view
    into one big storage: ``torch.save`` of a restored tensor then writes its bytes only (not the whole slot),
    and code that assumes offset 0 works (``torch.set_rng_state`` reads from the storage start).
    """

    def __init__(self, info: HeaderInfo, buffer: torch.Tensor, copy: bool, target: torch.device):
        self.entries = info.tensors
        self.buffer = buffer
        self.copy = copy
        self.target = target
        bdev = buffer.device
        self.same_device = target.type == bdev.type and (target.index is None or target.index == bdev.index)
        self.host = buffer.numpy() if bdev.type == "cpu" else None
        self.cache: dict[int, Any] = {}

    def load(self, i: int) -> Any:
        if i in self.cache:
            return self.cache[i]
        e = self.entries[i]
        if e.kind in _TENSOR_KINDS:
            value = self._tensor(e)
        else:
            if self.host is not None:
                array = self.host[e.offset : e.offset + e.nbytes]
            else:
                array = self.buffer.narrow(0, e.offset, e.nbytes).cpu().numpy()
            if e.kind == "bytes":
                value = array.tobytes()
            else:
                value = array.view(np.dtype(e.np_dtype)).reshape(e.shape)
                if self.copy and self.host is not None:
                    value = value.copy()
        self.cache[i] = value
        return value

    def _slot(self, e: TensorEntry) -> torch.Tensor:
        """The slot's bytes as a uint8 tensor with its own storage, zero-copy."""
        if self.host is not None:
            return _from_numpy(self.host[e.offset : e.offset + e.nbytes])
        raw = self.buffer.narrow(0, e.offset, e.nbytes)
        try:
            return torch.from_dlpack(raw)
        except (RuntimeError, TypeError, BufferError):  # a device without DLPack: a view will do
            return raw

    def _tensor(self, e: TensorEntry) -> torch.Tensor:
        if not e.nbytes:  # nothing to share (and empty slices may carry odd strides)
            t = torch.empty(e.shape, dtype=e.dtype, device=self.target)
            if e.kind == "parameter":
                return torch.nn.Parameter(t, requires_grad=e.requires_grad)
            return t.requires_grad_(e.requires_grad)
        raw = self._slot(e)
        try:
            t = raw.view(e.dtype).view(e.shape)
        except RuntimeError:
            raise ValueError(
                f"restore buffer must start at a storage offset that is a multiple of {e.dtype.itemsize} "
                f"bytes to hold {e.dtype} data (got storage offset {self.buffer.storage_offset()})"
            ) from None
        if not self.same_device:
            t = t.to(self.target, copy=True)
        elif self.copy:
            t = t.clone()
        if e.kind == "parameter":
            return torch.nn.Parameter(t, requires_grad=e.requires_grad)
        if e.requires_grad:
            t = t.detach().requires_grad_(True)
        return t


class _Decoder:
    __slots__ = ("entries", "loader")

    def __init__(self, entries: tuple[TensorEntry, ...], loader: _Loader | None):
        self.entries = entries
        self.loader = loader

    def ref(self, node: dict, kinds: tuple[str, ...]) -> Any:
        i = _field(node, "i", int)
        if not 0 <= i < len(self.entries):
            raise _NodeError(f"node {node['$']!r} refers to tensor table entry {i}, which does not exist")
        if self.entries[i].kind not in kinds:
            raise _NodeError(f"node {node['$']!r} refers to a {self.entries[i].kind!r} entry")
        return _PLACEHOLDER if self.loader is None else self.loader.load(i)

    def seq(self, items: list, key: bool = False) -> list:
        out = []
        for i, v in enumerate(items):
            try:
                out.append(self.key(v) if key else self.node(v))
            except _NodeError as e:
                e.where.append(f"[{i}]")
                raise
        return out

    def node(self, node: Any) -> Any:
        t = type(node)
        if t is str or t is bool or node is None or t is int or t is float:
            return node
        if t is list:
            return self.seq(node)
        if t is not dict:
            raise _NodeError(f"unexpected JSON value of type {t.__name__}")
        tag = node.get("$")
        handler = _DECODERS.get(tag) if type(tag) is str else None
        if handler is None:
            raise _NodeError(f"unknown node tag {tag!r}")
        return handler(self, node)

    def key(self, node: Any) -> Any:
        t = type(node)
        if t is list or (t is dict and node.get("$") not in _KEY_TAGS):
            raise _NodeError(
                f"node {node.get('$') if t is dict else 'list'!r} cannot be a dict key or set element"
            )
        value = self.node(node)
        try:
            hash(value)
        except TypeError:
            raise _NodeError(f"unhashable dict key or set element of type {_type_name(value)}") from None
        return value

    def kv(self, node: dict, cls: type) -> Any:
        out = cls()
        if "kv" in node:
            for k, v in _field(node, "kv", dict).items():
                try:
                    out[k] = self.node(v)
                except _NodeError as e:
                    e.where.append(f"[{k!r}]")
                    raise
            return out
        for i, pair in enumerate(_field(node, "items", list)):
            if type(pair) is not list or len(pair) != 2:
                raise _NodeError(f"item {i} of a {node['$']!r} node is not a [key, value] pair")
            try:
                k = self.key(pair[0])
            except _NodeError as e:
                e.where.append(f"<key {i}>")
                raise
            try:
                out[k] = self.node(pair[1])
            except _NodeError as e:
                e.where.append(f"[{k!r}]")
                raise
        return out

    def d_dict(self, node: dict) -> Any:
        return self.kv(node, dict)

    def d_odict(self, node: dict) -> Any:
        return self.kv(node, collections.OrderedDict)

    def d_namespace(self, node: dict) -> Any:
        ns = argparse.Namespace()
        for k, v in _field(node, "kv", dict).items():
            try:
                setattr(ns, k, self.node(v))
            except _NodeError as e:
                e.where.append(f".{k}")
                raise
        return ns

    def d_tuple(self, node: dict) -> Any:
        return tuple(self.seq(_field(node, "v", list)))

    def d_set(self, node: dict) -> Any:
        return set(self.seq(_field(node, "v", list), key=True))

    def d_frozenset(self, node: dict) -> Any:
        return frozenset(self.seq(_field(node, "v", list), key=True))

    def d_int(self, node: dict) -> Any:
        s = _field(node, "hex", str)
        if not re.fullmatch(r"-?0x[0-9a-f]+", s):
            raise _NodeError(f"invalid int hex {s!r}")
        return int(s, 16)

    def d_float(self, node: dict) -> Any:
        return _decode_float(node)

    def d_complex(self, node: dict) -> Any:
        return complex(_decode_float(node.get("re")), _decode_float(node.get("im")))

    def blob(self, node: dict) -> bytes:
        if "i" in node:
            return self.ref(node, ("bytes",))
        return _b64(node)

    def d_bytes(self, node: dict) -> Any:
        return self.blob(node)

    def d_bytearray(self, node: dict) -> Any:
        data = self.blob(node)
        return data if data is _PLACEHOLDER else bytearray(data)

    def d_bytesio(self, node: dict) -> Any:
        data = self.blob(node)
        return data if data is _PLACEHOLDER else io.BytesIO(data)

    def d_tensor(self, node: dict) -> Any:
        return self.ref(node, _TENSOR_KINDS)

    def d_ndarray(self, node: dict) -> Any:
        return self.ref(node, ("ndarray",))

    def d_npscalar(self, node: dict) -> Any:
        try:
            dt = np.dtype(_field(node, "dtype", str))
        except (TypeError, ValueError):
            raise _NodeError(f"invalid numpy dtype {node.get('dtype')!r}") from None
        why = _check_np_dtype(dt, scalar=True)
        if why is not None:
            raise _NodeError(f"unsupported {why}")
        raw = _b64(node)
        if dt.itemsize == 0 and not raw:
            return dt.type()
        if len(raw) != dt.itemsize:
            raise _NodeError(f"numpy scalar of dtype {dt.str!r} needs {dt.itemsize} bytes, got {len(raw)}")
        return np.frombuffer(raw, dtype=dt)[0]

    def d_npdtype(self, node: dict) -> Any:
        try:
            return np.dtype(_field(node, "v", str))
        except (TypeError, ValueError):
            raise _NodeError(f"invalid numpy dtype {node.get('v')!r}") from None

    def d_dtype(self, node: dict) -> Any:
        name = _field(node, "v", str)
        dtype = _ANY_DTYPE_BY_NAME.get(name)
        if dtype is None:
            raise _NodeError(f"unknown torch dtype {name!r}")
        return dtype

    def d_device(self, node: dict) -> Any:
        try:
            return torch.device(_field(node, "v", str))
        except RuntimeError:
            raise _NodeError(f"invalid torch device {node.get('v')!r}") from None

    def d_size(self, node: dict) -> Any:
        dims = _field(node, "v", list)
        if not all(_is_int(d) for d in dims):
            raise _NodeError("torch.Size node holds a non-integer")
        return torch.Size(dims)

    def d_enum(self, node: dict) -> Any:
        module = _field(node, "module", str)
        qualname = _field(node, "qualname", str)
        name = _field(node, "name", (str, type(None)))
        try:
            value = self.node(node.get("value"))
        except _NodeError as e:
            e.where.append(".value")
            raise
        if self.loader is None:
            return _PLACEHOLDER
        return _resolve_enum(module, qualname, name, value)

    def d_path(self, node: dict) -> Any:
        cls_name = _field(node, "cls", str)
        if cls_name not in _PATH_CLASSES:
            raise _NodeError(f"unknown path class {cls_name!r}")
        text = _field(node, "v", str)
        try:
            return getattr(pathlib, cls_name)(text)
        except (NotImplementedError, OSError):  # a concrete path of another OS: keep the pure flavour
            pure = pathlib.PureWindowsPath if "Windows" in cls_name else pathlib.PurePosixPath
            return pure(text)


_DECODERS: dict[str, Any] = {
    name.removeprefix("d_"): getattr(_Decoder, name) for name in dir(_Decoder) if name.startswith("d_")
}
_KEY_TAGS = frozenset(  # the node tags allowed as dict keys and set elements (hashable values)
    "tuple frozenset int float complex bytes size dtype device enum npscalar npdtype path".split()
)


def _decode_tree(info: HeaderInfo, loader: _Loader | None) -> Any:
    try:
        return _Decoder(info.tensors, loader).node(info.tree)
    except _NodeError as e:
        where = "".join(reversed(e.where)) or "<root>"
        raise DecodeError(f"snapshot header: tree node at {where}: {e.msg}") from None
    except RecursionError:
        raise DecodeError("snapshot header: the tree is nested too deeply") from None


def restore(
    info: HeaderInfo, buffer: torch.Tensor, copy: bool = False, map_location: str | torch.device | None = None
) -> Any:
    """Rebuild the items from a decoded header and the snapshot's buffer (a 1-D uint8 tensor, CPU or device).

    ``copy=False``: tensors share ``buffer``'s memory, zero-copy (numpy arrays too, when ``buffer`` is on the
    CPU), each through its own storage object starting at its slot, so the memory under ``buffer`` (an mmap,
    say) must stay mapped while they are in use; ``copy=True``: every tensor and array owns its memory.
    Tensors land on ``buffer``'s device unless ``map_location`` names another (then they are copies whatever
    ``copy`` says). Tensors stored once are restored as one object. Raises :class:`DecodeError` if ``buffer``
    is smaller than ``info.total_bytes``.
    """
    if not isinstance(info, HeaderInfo):
        raise TypeError(f"restore() needs the HeaderInfo from decode_header(), got {_type_name(info)}")
    _check_buffer(buffer, info.total_bytes, "restore buffer", DecodeError)
    target = buffer.device if map_location is None else torch.device(map_location)
    with _gc_paused():
        return _decode_tree(info, _Loader(info, buffer, copy, target))
