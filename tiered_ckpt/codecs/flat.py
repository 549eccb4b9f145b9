"""Flat snapshot codec: a nested state dict <-> one contiguous byte buffer plus a JSON header (never pickle).

This is what the memory tiers (``shm``, ``gpu``) hold and what the engine's blocking ``save()`` copies into,
so the copy runs at memory speed: :func:`plan_snapshot` walks the structure once (no tensor bytes touched),
and :func:`copy_into` moves each tensor straight into its slot of the destination buffer (host to host on every
core, :mod:`tiered_ckpt.memcopy`; ``Tensor.copy_`` where CUDA or a non-contiguous source is involved).

Buffer
    Every tensor (and numpy array, and large ``bytes`` blob) gets a slot at an offset that is a multiple of
    :data:`ALIGNMENT` (64) bytes, in the order the walk meets them; ``total_bytes`` is rounded up to 64 too.
    A placement given to :func:`plan_snapshot` may ask for a tensor's offset modulo :data:`PLACEMENT_MODULUS`
    (a page): the tensor then starts after a gap of less than a page. Readers take every offset from the header.
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

from tiered_ckpt import cuda_streams, memcopy
from tiered_ckpt.codecs._flat_common import (
    _DTYPE_NAME,
    ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    INLINE_BYTES_MAX,
    PLACEMENT_MODULUS,
    EnumStandIn,
    HeaderInfo,
    PlanMemo,
    SnapshotPlan,
    TensorEntry,
    _check_buffer,
    _gc_paused,
)
from tiered_ckpt.codecs._flat_decode import decode_header, restore
from tiered_ckpt.codecs._flat_encode import plan_snapshot

__all__ = [
    "ALIGNMENT",
    "PLACEMENT_MODULUS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INLINE_BYTES_MAX",
    "EnumStandIn",
    "HeaderInfo",
    "PlanMemo",
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


_MEMO_DESTINATIONS = 4  # copy lists a plan memo keeps: one per slot the item is copied into (two by default)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass may define what its bytes are: it gets ``copy_``


class _Copies:
    """How one plan's sources go into one destination: byte spans moved on every core (contiguous CPU -> CPU
    sources whose bytes are their values), and typed views of ``dest`` for the rest (``copy_``)."""

    __slots__ = ("spans", "views", "sources", "non_blocking", "sync", "_pieces")

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int]] = []  # (destination address, source address, bytes)
        self._pieces: tuple[int, list[list[tuple[int, int, int]]]] | None = None  # (threads, the spans cut)
        self.views: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.non_blocking: list[bool] = []
        self.sync: list[torch.device] = []


def _dest_copies(plan: SnapshotPlan, dest: torch.Tensor) -> _Copies:
    key = (dest.data_ptr(), dest.numel(), dest.device)
    cached = plan._views
    if cached is not None and cached[0] == key:
        return cached[1]
    memo = plan.memo
    copies = memo.copies.get(key)
    if copies is None:
        with _gc_paused():
            copies = _build_copies(plan, dest)
        if not copies.views:  # byte spans only: addresses, no tensor kept alive
            if len(memo.copies) >= _MEMO_DESTINATIONS:  # a tier that maps its slots anew: keep the newest
                del memo.copies[next(iter(memo.copies))]
            memo.copies[key] = copies
    plan._views = (key, copies)
    return copies


def _build_copies(plan: SnapshotPlan, dest: torch.Tensor) -> _Copies:
    total = plan.total_bytes
    ddev = dest.device
    dest_cpu = ddev.type == "cpu"
    dest_addr = dest.data_ptr()
    bases: dict[torch.dtype, tuple[torch.Tensor, int, int]] = {}
    flags: dict[torch.device, bool] = {}
    out = _Copies()
    for entry, src in zip(plan.tensors, plan.sources, strict=True):
        dtype = src.dtype
        typed = bases.get(dtype)
        if typed is None:  # also for byte spans: the slot must be aligned for a restore's typed views
            base = _typed_base(dest, total, dtype, "copy_into destination")
            typed = bases[dtype] = (base, base.storage_offset(), dtype.itemsize)
        contiguous = src.is_contiguous()
        sdev = src.device
        if dest_cpu and type(src) in _PLAIN and memcopy.plain_bytes(src):
            nbytes = src.numel() * src.element_size()
            if nbytes:
                out.spans.append((dest_addr + entry.offset, src.data_ptr(), nbytes))
            continue
        base, start, itemsize = typed
        shape = src.shape
        # A contiguous source's strides differ from the canonical ones only on dims of size <= 1: harmless.
        strides = src.stride() if contiguous else _contiguous_strides(shape)
        out.views.append(base.as_strided(shape, strides, start + entry.offset // itemsize))
        out.sources.append(src)
        nb = flags.get(sdev)
        if nb is None:  # CPU -> CPU: plain copy; anything involving CUDA: async on a side stream, one wait at the end
            nb = flags[sdev] = sdev.type == "cuda" or ddev.type == "cuda"
        out.non_blocking.append(nb)
    out.sync = sorted({d for d in (*flags, ddev) if d.type == "cuda"}, key=str)
    return out


def copy_into(plan: SnapshotPlan, dest: torch.Tensor, *, synchronize: bool = True) -> None:
    """Copy every source of ``plan`` into its slot of ``dest`` (a 1-D uint8 tensor of >= ``total_bytes``).

    CPU -> CPU: the bytes of contiguous sources are moved on every core torch uses (:mod:`tiered_ckpt.memcopy`:
    pieces that every thread takes in turn, one ``memmove`` each); a non-contiguous source (or one with a
    conjugate or negative bit) is a ``copy_`` into a typed view. Copies involving CUDA are issued with
    ``non_blocking=True`` on a side stream per CUDA device involved (:mod:`tiered_ckpt.cuda_streams`), after the
    work already queued on the current stream (the tensors' producers). Unless ``synchronize=False`` this then
    waits for those copies only (an event, not a device-wide synchronize that would also wait for the training
    kernels queued since), so the sources may be modified as soon as this returns. With ``synchronize=False``
    the current streams are made to wait for the copies instead: later work queued there is ordered after them,
    but the host must synchronize before it reads ``dest`` or changes a source itself. ``dest`` must start at a
    storage offset aligned to the largest element size stored (16 bytes covers every dtype).
    """
    _check_buffer(dest, plan.total_bytes, "copy_into destination", ValueError)
    if not plan.sources:
        return
    copies = _dest_copies(plan, dest)
    if copies.spans:
        n = memcopy.threads()
        if copies._pieces is None or copies._pieces[0] != n:
            copies._pieces = (n, memcopy.split_spans(copies.spans, n))
        memcopy.copy_pieces(copies._pieces[1], n)
    if not copies.views:
        return
    # One context per call, none per tensor: the CPU -> CPU path costs what it did before side streams.
    sync = copies.sync
    streams = cuda_streams.on_side_streams(sync, synchronize=synchronize) if sync else contextlib.nullcontext()
    with torch.no_grad(), streams:
        for view, src, nb in zip(copies.views, copies.sources, copies.non_blocking, strict=True):
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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def encode_header(plan: SnapshotPlan) -> bytes:
    """The snapshot header: compact, pure-ASCII JSON (see the module docstring for the format). The tensor
    table is encoded once per layout (kept in the plan's memo); the tree, which holds the values that change
    from save to save, every time."""
    head = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "alignment": ALIGNMENT,
        "total_bytes": plan.total_bytes,
        "fingerprint": plan.fingerprint,
    }
    memo = plan.memo
    with _gc_paused():
        tensors = memo.tensors_json
        if tensors is None:
            tensors = memo.tensors_json = _dumps([_entry_json(e) for e in plan.tensors])
        # The same bytes as one dump of {**head, "tensors": ..., "tree": ...}: keys in that order.
        text = f'{_dumps(head)[:-1]},"tensors":{tensors},"tree":{_dumps(plan.tree)}}}'
    return text.encode("ascii")
