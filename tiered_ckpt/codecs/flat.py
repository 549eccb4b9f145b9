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

This module is the public API; the walk lives in ``_flat_encode``, the header's fields and tensor table are
checked in ``_flat_header``, the tree and restoring in ``_flat_decode``, and what they share in ``_flat_common``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch

from tiered_ckpt import cuda_streams
from tiered_ckpt.codecs._flat_common import (
    _DTYPE_NAME,
    ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    INLINE_BYTES_MAX,
    EnumStandIn,
    HeaderInfo,
    SnapshotPlan,
    TensorEntry,
    _check_buffer,
    _gc_paused,
)
from tiered_ckpt.codecs._flat_decode import decode_header, restore
from tiered_ckpt.codecs._flat_encode import plan_snapshot

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

# ------------------------------------------------------------------------------------------------ encoding


def _contiguous_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d if d > 1 else 1
    return tuple(reversed(strides))


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
        if nb is None:  # CPU -> CPU: plain copy; anything involving CUDA: async on a side stream, one wait at the end
            nb = flags[sdev] = sdev.type == "cuda" or ddev.type == "cuda"
        non_blocking.append(nb)
    sync = sorted({d for d in (*flags, ddev) if d.type == "cuda"}, key=str)
    return views, non_blocking, sync


def copy_into(plan: SnapshotPlan, dest: torch.Tensor, *, synchronize: bool = True) -> None:
    """Copy every source of ``plan`` into its slot of ``dest`` (a 1-D uint8 tensor of >= ``total_bytes``).

    CPU -> CPU is a plain ``copy_``. Copies involving CUDA are issued with ``non_blocking=True`` on a side stream
    per CUDA device involved (:mod:`tiered_ckpt.cuda_streams`), after the work already queued on the current
    stream (the tensors' producers). Unless ``synchronize=False`` this then waits for those copies only (an
    event, not a device-wide synchronize that would also wait for the training kernels queued since), so the
    sources may be modified as soon as this returns. With ``synchronize=False`` the current streams are made to
    wait for the copies instead: later work queued there is ordered after them, but the host must synchronize
    before it reads ``dest`` or changes a source itself. ``dest`` must start at a storage offset aligned to the
    largest element size stored (16 bytes covers every dtype).
    """
    _check_buffer(dest, plan.total_bytes, "copy_into destination", ValueError)
    if not plan.sources:
        return
    views, non_blocking, sync = _dest_views(plan, dest)
    # One context per call, none per tensor: the CPU -> CPU path costs what it did before side streams.
    streams = cuda_streams.on_side_streams(sync, synchronize=synchronize) if sync else contextlib.nullcontext()
    with torch.no_grad(), streams:
        for view, src, nb in zip(views, plan.sources, non_blocking, strict=True):
            view.copy_(src, non_blocking=nb)


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
