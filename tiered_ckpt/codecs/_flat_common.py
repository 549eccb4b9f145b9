"""Shared pieces of the flat snapshot codec (:mod:`tiered_ckpt.codecs.flat`): format constants, dtype tables,
the plan/header types and the small helpers both the encoding and the decoding side use."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import pickle
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..pickle_by_name import NamedReduce

FORMAT_NAME = "tiered_ckpt.flat"
FORMAT_VERSION = 1
ALIGNMENT = 64
#: A placement (:func:`~tiered_ckpt.codecs.flat.plan_snapshot`) asks for a tensor's offset modulo this: a page,
#: what a direct write needs of memory and file offset alike.
PLACEMENT_MODULUS = 4096
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

    def __reduce_by_name__(self) -> NamedReduce:
        return NamedReduce(self.module, self.qualname, (self.value,))  # what Enum.__reduce_ex__ gives

    def __reduce_ex__(self, protocol: int) -> Any:
        # Any other pickler would write a tiered_ckpt global that no reader of the file knows.
        raise pickle.PicklingError(
            f"{self!r} stands in for {self.module}.{self.qualname}, which was not imported when the snapshot was "
            f"restored: import {self.module} before loading, or write the file with tiered_ckpt's torch writer "
            "(tiered_ckpt.megatron.torch_zip), which emits the original global")

    def __copy__(self) -> EnumStandIn:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> EnumStandIn:
        return self


class PlanMemo:
    """What planning one item learned, kept for planning the same item at the next save.

    A training job saves the same structure at every step: with thousands of tensors, deriving the layout's
    fingerprint, the header's tensor table and the copy lists again is most of a save's blocking time. The
    caller (the engine, one memo per item) hands the last plan's memo to :func:`plan_snapshot`; while the walk
    meets the same entries in the same order, it reuses them, and when every entry matched, the fingerprint
    and the tensor table too; when every source is also the same memory, the copy lists. The memo holds no
    tensor: only each entry's facts (``args``) and its source's address, strides and type (``source_keys``),
    so it never keeps a state's memory alive."""

    __slots__ = ("args", "source_keys", "entries", "total_bytes", "fingerprint", "tensors_json", "copies")

    def __init__(self, args: list[tuple], source_keys: list[Any], entries: list[TensorEntry], total_bytes: int):
        self.args = args
        self.source_keys = source_keys
        self.entries = entries
        self.total_bytes = total_bytes
        self.fingerprint: str | None = None
        self.tensors_json: str | None = None  # the header's "tensors" array, encoded
        self.copies: dict[Any, Any] = {}  # destination -> its copy lists (flat._Copies), while the sources hold


class SnapshotPlan:
    """The result of :func:`plan_snapshot`: where every tensor goes, and the header tree. ``memo``: what the
    next plan of the same structure may reuse (:class:`PlanMemo`)."""

    __slots__ = ("tensors", "sources", "total_bytes", "tree", "_views", "memo")

    def __init__(self, tensors: list[TensorEntry], sources: list[torch.Tensor], total_bytes: int, tree: Any,
                 memo: PlanMemo):
        self.tensors = tensors
        self.sources = sources
        self.total_bytes = total_bytes
        self.tree = tree
        self._views: tuple[Any, ...] | None = None
        self.memo = memo

    @property
    def fingerprint(self) -> str:
        """Hash of the buffer layout (paths, kinds, dtypes, shapes, offsets). Equal => identical offsets."""
        if self.memo.fingerprint is None:  # computed once per layout: a memo that matched carries it over
            self.memo.fingerprint = _fingerprint(self.tensors, self.total_bytes)
        return self.memo.fingerprint

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


def _check_buffer(buf: Any, need: int, what: str, exc: type[Exception]) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        desc = f"{buf.dtype} tensor of dim {buf.dim()}" if isinstance(buf, torch.Tensor) else _type_name(buf)
        raise TypeError(f"{what} must be a 1-D torch.uint8 tensor, got {desc}")
    if buf.numel() > 1 and buf.stride(0) != 1:
        raise ValueError(f"{what} must be contiguous (stride 1), got stride {buf.stride(0)}")
    if buf.numel() < need:
        raise exc(f"{what} holds {buf.numel()} bytes but the snapshot needs {need}")
