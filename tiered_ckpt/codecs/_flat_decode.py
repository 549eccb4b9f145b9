"""The decoding side of the flat snapshot codec: :func:`decode_header` (the fields and tensor table are checked by
:mod:`tiered_ckpt.codecs._flat_header`, the tree here) and rebuilding the tree from a buffer (:func:`restore`)
(public API: :mod:`tiered_ckpt.codecs.flat`; the module map: docs/architecture.md)."""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import enum
import io
import pathlib
import re
import struct
import sys
from typing import Any

import numpy as np
import torch

from tiered_ckpt.codecs._flat_common import (
    _ANY_DTYPE_BY_NAME,
    _MAX_SAFE_INT,
    _PATH_CLASSES,
    _TENSOR_KINDS,
    EnumStandIn,
    HeaderInfo,
    TensorEntry,
    _check_buffer,
    _check_np_dtype,
    _from_numpy,
    _gc_paused,
    _type_name,
)
from tiered_ckpt.codecs._flat_header import _decode_table, _is_int
from tiered_ckpt.errors import DecodeError


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
    info = _decode_table(text)
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


# dtypes numpy has too: a host tensor of these is shaped by numpy's views, several times cheaper than torch's
# (a model may have thousands of tensors).
_NUMPY_VIEWS: dict[torch.dtype, np.dtype] = {
    d: np.dtype(n) for d, n in ((torch.float32, "float32"), (torch.float64, "float64"), (torch.float16, "float16"),
                                (torch.int64, "int64"), (torch.int32, "int32"), (torch.int16, "int16"),
                                (torch.int8, "int8"), (torch.uint8, "uint8"), (torch.bool, "bool"),
                                (torch.complex64, "complex64"), (torch.complex128, "complex128"))
}


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
        # numpy's views where every slot is aligned for its dtype (else torch's, which name the problem)
        self.numpy_views = self.host is not None and self.host.ctypes.data % 16 == 0
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
        npdt = _NUMPY_VIEWS.get(e.dtype) if self.numpy_views else None
        if npdt is not None:
            t = _from_numpy(self.host[e.offset:e.offset + e.nbytes].view(npdt).reshape(e.shape))
        else:
            try:
                t = self._slot(e).view(e.dtype).view(e.shape)
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
