"""The flat snapshot header's fields and tensor table, parsed and validated (:func:`_decode_table`); the tree
is validated by :mod:`tiered_ckpt.codecs._flat_decode` (public API: :mod:`tiered_ckpt.codecs.flat`; the module map:
docs/architecture.md)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from tiered_ckpt.codecs._flat_common import (
    _DTYPE_BY_NAME,
    _KINDS,
    ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    HeaderInfo,
    TensorEntry,
    _check_np_dtype,
    _fingerprint,
)
from tiered_ckpt.errors import DecodeError

#: Bounds of every size in a header: beyond them torch and numpy overflow their int64 sizes and strides.
MAX_BYTES = 1 << 62
# numpy's limit, which torch's exceeds: 64 from numpy 2.0, 32 before (numpy 1.24 is our declared floor)
MAX_DIMS = 64 if int(np.__version__.split(".")[0]) >= 2 else 32


def _short(shape: list) -> str:
    text = repr(shape)
    return text if len(text) <= 80 else text[:77] + "..."


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


def _plain_tensor_entry(raw: Any, total: int, alignment: int) -> TensorEntry | None:
    """The common entry (a tensor or parameter, no zero-size dimension) decoded with the checks of
    :func:`_decode_entry`, in a few lines per entry (a model may have thousands); None for anything else,
    valid or not, which :func:`_decode_entry` then decodes or names the fault of."""
    if type(raw) is not dict:
        return None
    get = raw.get
    kind, path, offset, nbytes, shape = get("kind"), get("path"), get("offset"), get("nbytes"), get("shape")
    device, requires_grad = get("device", "cpu"), get("requires_grad", False)
    if ((kind != "tensor" and kind != "parameter") or type(path) is not str or type(offset) is not int
            or type(nbytes) is not int or type(shape) is not list or type(device) is not str
            or type(requires_grad) is not bool or len(shape) > MAX_DIMS):
        return None
    name = get("dtype")
    dtype = _DTYPE_BY_NAME.get(name) if type(name) is str else None
    if dtype is None or (requires_grad and not (dtype.is_floating_point or dtype.is_complex)):
        return None
    if not (0 <= offset <= MAX_BYTES and 0 <= nbytes <= MAX_BYTES and offset % alignment == 0
            and offset + nbytes <= total):
        return None
    count = 1
    for d in shape:
        if type(d) is not int or d <= 0:
            return None
        count *= d
    if count * dtype.itemsize != nbytes:  # nbytes <= MAX_BYTES: so is the shape's size
        return None
    return TensorEntry(path, offset, nbytes, dtype, tuple(shape), kind, device, requires_grad, None)


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
    if offset > MAX_BYTES or nbytes > MAX_BYTES:
        raise DecodeError(f"snapshot header: {where} has an offset or size beyond any buffer's ({MAX_BYTES})")
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
        if len(shape_raw) > MAX_DIMS:
            raise DecodeError(f"snapshot header: {where} has {len(shape_raw)} dimensions (at most {MAX_DIMS})")
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
    # Zero-size tensors too: torch and numpy compute strides and sizes from the other dims, in int64.
    if math.prod(d for d in shape if d) * itemsize > MAX_BYTES:
        raise DecodeError(f"snapshot header: {where} has a shape {_short(list(shape))} beyond any tensor's "
                          f"({MAX_BYTES} bytes)")
    expected = math.prod(shape) * itemsize
    if nbytes != expected:
        raise DecodeError(
            f"snapshot header: {where} has nbytes {nbytes}, but its shape and dtype need {expected}"
        )
    return TensorEntry(path, offset, nbytes, dtype, shape, kind, device, requires_grad, np_dtype)



def _decode_table(text: str) -> HeaderInfo:
    """The header's fields and tensor table, validated; the tree is left to :func:`_flat_decode._decode_tree`."""
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
    if total < 0 or total % alignment or total > MAX_BYTES:
        raise DecodeError(f"snapshot header: invalid total_bytes {total}")
    fingerprint = _get(doc, "fingerprint", str, "the header")
    table = _get(doc, "tensors", list, "the header")
    if "tree" not in doc:
        raise DecodeError("snapshot header lacks field 'tree'")
    entries = tuple(_plain_tensor_entry(raw, total, alignment) or _decode_entry(i, raw, total, alignment)
                    for i, raw in enumerate(table))
    if _fingerprint(entries, total) != fingerprint:
        raise DecodeError("snapshot header: the fingerprint does not match the tensor table")
    return HeaderInfo(FORMAT_VERSION, total, alignment, fingerprint, entries, doc["tree"])
