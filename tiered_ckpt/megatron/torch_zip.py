"""``torch.save``'s zip format, written as a stream, so that no file is ever held whole in memory.

Megatron's ``distrib_optim.pt`` holds one tensor per state key for a whole model-parallel shard, and ``torch.save``
needs every tensor in memory before it writes a byte. Here a tensor may be a :class:`StreamedTensor` whose bytes are
produced piece by piece (one bucket at a time) while the file is written: :func:`iter_torch_save` yields the file
as chunks for ``Tier.write_blob``. (:mod:`.lazy_torch` reads such files range by range.)

The output is ``torch.save``'s byte for byte (checked against Megatron's own files, whose sha256 are in
``tests/data/megatron``): records ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``,
``data/<i>``, ``version``, ``.data/serialization_id``; every record stored, its data aligned to 64 bytes by an
``FB`` extra field, CRC32 and sizes in a data descriptor after the data (what miniz's streaming writer emits, so
one pass suffices), zip64 end records always, zip64 extra fields from 4 GiB on; the pickle memoizes as torch's
does (shared storages written once). The serialization id mirrors PyTorch's (a hash of the record names in
``std::unordered_set`` order, and of the CRCs); it is informational, PyTorch never checks it.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import pickle_by_name
from ..errors import EncodeError
from ..fast_crc import crc32  # ISA-L: on a 2 GiB file zlib's CRC-32 is most of the cost above a raw write
from ..pickle_by_name import StandInDetector
from ..tiers.base import IO_BLOCK, as_memoryview
from .loadable import explain, refused_globals
from .naming import DISTRIB_OPTIM_FILENAME, MODEL_FILENAME
from .torch_records import DICTS, ZIP64_MARKER, itemsize, same_dict

ALIGNMENT = 64
PICKLE_PROTOCOL = 2  # torch.save's default
ZIP64_FROM = 0xFFFFFFFF  # sizes and offsets from here on go to zip64 extra fields (lowered in tests)
_TAIL = 4096
_CRC_ASYNC_MIN = 1 << 20  # smaller pieces: the thread hand-off costs more than the CRC
CONGRUENT_MIN = 256 << 10  # smaller tensors keep torch's 64-byte padding: < 4 KiB more per tensor is not worth it


# ------------------------------------------------------------------------------------------------------------
# tensors whose bytes come later


@dataclass
class StreamedTensor:
    """A tensor to write: dtype, shape and a producer of its bytes.

    ``produce()`` yields CPU tensors (or byte buffers) whose bytes, concatenated, are the tensor's
    ``numel * itemsize`` bytes in C order. It is called once, when the writer reaches this tensor's record.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[Any]]
    address: int | None = None  # where the bytes sit in memory, when they do (see iter_torch_save's page_congruent)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def __reduce_ex__(self, protocol: int) -> Any:
        raise pickle.PicklingError("StreamedTensor is written by iter_torch_save only")


class _StorageRef:
    """A storage's persistent id, and the tensor dtype to rebuild with where the storage is untyped."""

    __slots__ = ("pid", "untyped_dtype")

    def __init__(self, pid: tuple, untyped_dtype: torch.dtype | None = None):
        self.pid, self.untyped_dtype = pid, untyped_dtype


class _TensorReduce:
    """What ``Tensor.__reduce_ex__`` emits for a plain CPU tensor: ``_rebuild_tensor_v2(storage, offset, size,
    stride, False, OrderedDict())``."""

    __slots__ = ("ref", "shape", "stride", "offset")

    def __init__(self, ref: _StorageRef, shape: tuple[int, ...], stride: tuple[int, ...] | None = None,
                 offset: int = 0):
        self.ref, self.shape, self.offset = ref, shape, offset
        self.stride = _contiguous_strides(shape) if stride is None else stride

    def __reduce_ex__(self, protocol: int) -> Any:
        args = (self.ref, self.offset, tuple(self.shape), tuple(self.stride), False, collections.OrderedDict())
        if self.ref.untyped_dtype is not None:  # torch.save's form for dtypes without a typed storage class
            return (torch._utils._rebuild_tensor_v3, (*args, self.ref.untyped_dtype))
        return (torch._utils._rebuild_tensor_v2, args)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


_STORAGE, _CPU = "storage", "cpu"


def _storage_ref(dtype: torch.dtype, key: str, numel: int) -> _StorageRef:
    """torch.save's persistent id of a storage of ``numel`` elements of ``dtype``: its typed storage class where
    the dtype has one; otherwise (float8 kinds, uint16/32/64) an ``UntypedStorage`` counted in bytes, the tensor
    rebuilt with its dtype (``_rebuild_tensor_v3``), as torch.save writes them."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    if name is not None:
        return _StorageRef((_STORAGE, getattr(torch, name), key, _CPU, numel))
    return _StorageRef((_STORAGE, torch.storage.UntypedStorage, key, _CPU, numel * itemsize(dtype)), dtype)


class _Storages:
    """Storage keys in first-seen order, as torch.save numbers them; a storage shared by several real tensors
    is written once (torch.save's behaviour, so re-saving a loaded file gives the same bytes)."""

    def __init__(self, tensors_only: bool = False) -> None:
        self.streams: list[StreamedTensor] = []
        self._keys: dict[int, tuple[str, torch.dtype, Any]] = {}
        self._tensors_only = tensors_only

    def ref(self, stream: StreamedTensor) -> _StorageRef:
        if self._tensors_only:  # its producer may reuse a buffer: not what a stable stream may send
            raise EncodeError("a StreamedTensor cannot be written where the stream is promised stable (tensors "
                              "only)")
        key = str(len(self.streams))
        self.streams.append(stream)
        return _storage_ref(stream.dtype, key, stream.numel)

    def tensor(self, t: torch.Tensor) -> _TensorReduce:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        storage = t.untyped_storage()
        item = t.element_size()
        found = self._keys.get(storage._cdata)
        if found is None:
            numel = storage.nbytes() // item
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            self.streams.append(StreamedTensor(t.dtype, (numel,), lambda raw=raw: [raw], storage.data_ptr()))
            found = self._keys[storage._cdata] = (str(len(self.streams) - 1), t.dtype, storage)
        key, dtype, _ = found
        if dtype != t.dtype:
            raise pickle.PicklingError("cannot save tensors that view the same storage as different dtypes")
        return _TensorReduce(_storage_ref(dtype, key, storage.nbytes() // item), tuple(t.shape), tuple(t.stride()),
                             t.storage_offset())


def _prepare(obj: Any, st: _Storages, memo: dict[int, Any] | None = None) -> Any:
    """``obj`` with every tensor replaced by its pickled form. Containers without tensors are kept as the very
    same objects, and an object seen twice maps to one copy, so the pickle memoizes as torch.save's does."""
    kind = type(obj)
    tensor = isinstance(obj, torch.Tensor | StreamedTensor)
    if not tensor and kind not in DICTS and kind is not list and kind is not tuple:
        return obj
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out: Any = st.tensor(obj)
    elif isinstance(obj, StreamedTensor):
        out = _TensorReduce(st.ref(obj), obj.shape)
    elif kind in DICTS:
        items = [(k, _prepare(v, st, memo)) for k, v in obj.items()]
        changed = any(new is not old for (_, new), old in zip(items, obj.values(), strict=True))
        out = same_dict(obj, items) if changed else obj
    else:
        values = [_prepare(v, st, memo) for v in obj]
        changed = any(new is not old for new, old in zip(values, obj, strict=True))
        out = kind(values) if changed else obj
    memo[id(obj)] = out
    return out


class _Pickler(StandInDetector):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _StorageRef) else None


def pickle_with_streams(obj: Any, tensors_only: bool = False) -> tuple[bytes, list[StreamedTensor]]:
    """``data.pkl`` of ``obj`` and the tensors in storage order. Containers are dicts, lists and tuples (the
    rest is pickled as is, so anything torch.save accepts without tensors inside custom objects).
    ``tensors_only``: refuse a :class:`StreamedTensor` in ``obj`` (:class:`~tiered_ckpt.errors.EncodeError`)."""
    st = _Storages(tensors_only)
    prepared = _prepare(obj, st)
    # Stand-ins of classes not imported here (Megatron's enums in a drain worker) are written under their
    # original global names, as the real objects pickle: see tiered_ckpt.pickle_by_name.
    return pickle_by_name.dumps(prepared, protocol=PICKLE_PROTOCOL, pickler=_Pickler), st.streams


# ------------------------------------------------------------------------------------------------------------
# the writer


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int


@dataclass
class _ZipStream:
    archive: str
    offset: int = 0
    entries: list[_Entry] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = None

    def _crc_async(self, mv: memoryview, crc: int) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-crc")
        return self._pool.submit(crc32, mv, crc)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def record(self, name: str, chunks: Iterable[Any], size: int, address: int | None = None) -> Iterator[Any]:
        """One zip record. ``address``: place the data at a file offset congruent to it modulo a page (the
        padding grows from < 64 bytes to < 4 KiB), so that an O_DIRECT writer can send it without a copy."""
        full = f"{self.archive}/{name}".encode()
        head = local_header(full, size, self.offset, address)
        yield head
        crc, n = 0, 0
        for chunk in chunks:
            mv = as_memoryview(chunk)
            n += len(mv)
            if n > size:
                raise ValueError(f"record {name}: more than the announced {size} bytes")
            # A large piece's CRC runs on a helper thread while the consumer writes the piece (both release the
            # GIL); it is awaited before the producer is asked for the next piece, which may reuse this buffer.
            pending = self._crc_async(mv, crc) if len(mv) >= _CRC_ASYNC_MIN else None
            if pending is None:
                crc = crc32(mv, crc)
            if len(mv) > _TAIL:
                # Whoever writes the stream keeps the last chunk it got at least until it gets the next one (a
                # writer of a stable stream, longer): end each piece with a small copy, so that holding it does
                # not keep the whole piece alive while the producer makes the next (peak memory: one piece, not
                # two).
                yield mv[:-_TAIL]
                yield bytes(mv[-_TAIL:])
            elif len(mv):
                yield mv
            if pending is not None:
                crc = pending.result()
            del chunk, mv, pending  # let the producer free its piece before making the next one
        if n != size:
            raise ValueError(f"record {name}: {n} bytes produced, {size} announced")
        tail = descriptor(crc, size)
        if tail:
            yield tail
        self.entries.append(_Entry(full, self.offset, size, crc))
        self.offset += len(head) + size + len(tail)

    def finish(self) -> bytes:
        return central_directory(self.entries, self.offset)


def local_header(full: bytes, size: int, offset: int, address: int | None = None) -> bytes:
    """A record's local header (name and padding included) at file offset ``offset``: its data starts right
    after it, 64-byte aligned (``address``: page-congruent to it, see :func:`iter_torch_save`)."""
    big_size, big_offset = size >= ZIP64_FROM, offset >= ZIP64_FROM
    zip64 = b""
    if big_size or big_offset:
        fields = (struct.pack("<QQ", size, size) if big_size else b"") + (
            struct.pack("<Q", offset) if big_offset else b"")
        zip64 = struct.pack("<HH", 1, len(fields)) + fields
    start = offset + 30 + len(full) + len(zip64) + 4
    pad = -start % ALIGNMENT if address is None or address % ALIGNMENT else (address - start) % IO_BLOCK
    extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    # miniz streams data (descriptor after it, flag bit 3) except for empty records
    flags = 0x0808 if size else 0x0800
    head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
    return head + full + extra


def descriptor(crc: int, size: int) -> bytes:
    """The data descriptor after a record's data (none for an empty record)."""
    if not size:
        return b""
    return struct.pack("<IIQQ" if size >= ZIP64_FROM else "<IIII", 0x08074B50, crc, size, size)


def central_directory(entries: list[_Entry], offset: int) -> bytes:
    """The central directory and the zip64 end records, written at ``offset`` (the end of the last record)."""
    out = io.BytesIO()
    for e in entries:
        big_size, big_offset = e.size >= ZIP64_FROM, e.offset >= ZIP64_FROM
        fields = (struct.pack("<QQ", e.size, e.size) if big_size else b"") + (
            struct.pack("<Q", e.offset) if big_offset else b"")
        extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
        size32 = ZIP64_MARKER if big_size else e.size
        flags = 0x0808 if e.size else 0x0800
        out.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, 0, 0, e.crc, size32, size32,
                              len(e.name), len(extra), 0, 0, 0, 0, ZIP64_MARKER if big_offset else e.offset))
        out.write(e.name + extra)
    cd_size, cd_offset, n = out.tell(), offset, len(entries)
    eocd64 = offset + cd_size
    out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, cd_offset))
    out.write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                          min(cd_size, ZIP64_MARKER), min(cd_offset, ZIP64_MARKER), 0))
    return out.getvalue()


def iter_torch_save(obj: Any, *, archive: str = "archive", page_congruent: bool = False,
                    megatron_loadable: bool = False, tensors_only: bool = False) -> Iterator[Any]:
    """The bytes of ``torch.save(obj, f)`` as a stream of chunks, tensors' data produced as it is written.

    ``archive`` is the zip's top directory: torch.save names it after the file (``distrib_optim`` for
    ``distrib_optim.pt``) or ``archive`` for a buffer. Pass a writer of chunks (``Tier.write_blob``) the
    result; peak memory is the largest piece a :class:`StreamedTensor` yields.

    ``page_congruent``: every tensor of at least ``CONGRUENT_MIN`` bytes whose memory address is known starts at
    a file offset equal to that address modulo 4 KiB (torch.save pads to 64 bytes; this pads more, in the same
    padding field, so ``torch.load`` reads the file as it reads torch.save's). An O_DIRECT writer then sends the
    tensors straight from their memory. Off, the bytes are exactly torch.save's.

    ``megatron_loadable``: refuse (:class:`~tiered_ckpt.errors.EncodeError`, before the first byte) an object
    whose pickle names a global that Megatron's weights-only loader rejects, rather than write a file that
    Megatron-LM cannot load.

    ``tensors_only``: refuse a :class:`StreamedTensor` in ``obj`` (:class:`~tiered_ckpt.errors.EncodeError`,
    before the first byte). Every piece is then a fresh buffer or a view of one of ``obj``'s tensors (a CUDA
    tensor's is a host copy of its own): a stream as stable as those tensors' memory
    (:class:`~tiered_ckpt.tiers.base.StableStream`).
    """
    if sys.byteorder != "little":  # pragma: no cover - we only run on little-endian hosts
        raise RuntimeError("only little-endian hosts are supported")
    pkl, streams = pickle_with_streams(obj, tensors_only)
    if megatron_loadable:
        _check_megatron_loadable(pkl, archive)
    z = _ZipStream(archive)
    try:
        yield from _records(z, pkl, streams, page_congruent)
    finally:
        z.close()


def _check_megatron_loadable(pkl: bytes, archive: str) -> None:
    refused = refused_globals(pkl)
    if not refused:
        return
    fix = ": keep such objects out of the checkpoint, or turn them into plain values (str, int, dict) before saving"
    if f"{archive}.pt" in (MODEL_FILENAME, DISTRIB_OPTIM_FILENAME):
        raise EncodeError(explain(f"{archive}.pt", refused) + fix)
    # Another item in torch format: loaded with the same allow-list (tiered_ckpt never unpickles code)
    raise EncodeError(f"item {archive!r} (codec torch): {', '.join(refused)} would not load back: torch files are "
                      f"read with torch's weights-only loader and Megatron-LM's safe globals (as {MODEL_FILENAME} "
                      f"is){fix}, or save the item with the default codec (flat), which keeps them")


def _records(z: _ZipStream, pkl: bytes, streams: list[StreamedTensor], page_congruent: bool) -> Iterator[Any]:
    records = [("data.pkl", [pkl], len(pkl)), (".format_version", [b"1"], 1),
               (".storage_alignment", [str(ALIGNMENT).encode()], 2), ("byteorder", [b"little"], 6)]
    for name, chunks, size in records:
        yield from z.record(name, chunks, size)
    for i, s in enumerate(streams):
        address = s.address if page_congruent and s.nbytes >= CONGRUENT_MIN else None
        yield from z.record(f"data/{i}", _lazy(s.produce), s.nbytes, address)
    yield from z.record("version", [b"3\n"], 2)
    written = [e.name.decode().split("/", 1)[1] for e in z.entries]
    # torch combines the CRCs it sees in data descriptors: empty records have none
    sid = serialization_id(written, [e.crc for e in z.entries if e.size]).encode()
    yield from z.record(".data/serialization_id", [sid], len(sid))
    yield z.finish()


def _lazy(produce: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    yield from produce()


# PyTorch's serialization id: the record names hashed with libstdc++'s std::hash (MurmurHash64A-like, seed
# 0xc70f6907) and combined with c10::hash_combine in the iteration order of the std::unordered_set holding
# them; then the CRCs combined in write order. Printed as two zero-padded 20-digit numbers.
_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
# libstdc++'s bucket counts as the set doubles (checked against torch.save up to 1200 records).
_PRIME_BUCKETS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043)


def _std_hash(data: bytes) -> int:
    def mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (0xC70F6907 ^ (n * _MUL)) & _M64
    aligned = n & ~7
    for i in range(0, aligned, 8):
        h ^= (mix((int.from_bytes(data[i:i + 8], "little") * _MUL) & _M64) * _MUL) & _M64
        h = (h * _MUL) & _M64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _M64
    return mix((mix(h) * _MUL) & _M64)


def _combine(seed: int, value: int) -> int:
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64


def _unordered_set_order(names: list[str]) -> list[str]:
    """Iteration order of a libstdc++ ``std::unordered_set<std::string>`` after inserting ``names``."""
    nbuckets, next_resize = 1, 0
    runs: list[list[tuple[int, str]]] = []  # the node list as runs of equal bucket, first run first

    def place(nodes: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
        out: list[list[tuple[int, str]]] = []
        where: dict[int, list[tuple[int, str]]] = {}
        for node in nodes:
            b = node[0] % nbuckets
            if b in where:
                where[b].insert(0, node)
            else:
                where[b] = [node]
                out.insert(0, where[b])
        return out

    count = 0
    for name in names:
        h = _std_hash(name.encode())
        if count + 1 > next_resize:
            wanted = max(count + 1, 0 if next_resize else 11)
            if wanted >= nbuckets:
                target = max(wanted + 1, nbuckets * 2)
                if target < len(_FAST_BUCKETS):
                    nbuckets = _FAST_BUCKETS[target]
                else:
                    nbuckets = next((p for p in _PRIME_BUCKETS if p >= target), 0)
                    if not nbuckets:
                        raise OverflowError("too many records to mirror torch's serialization id")
                next_resize = nbuckets
                runs = place([node for run in runs for node in run])
            else:
                next_resize = nbuckets
        b = h % nbuckets
        for run in runs:
            if run[0][0] % nbuckets == b:
                run.insert(0, (h, name))
                break
        else:
            runs.insert(0, [(h, name)])
        count += 1
    return [name for run in runs for _, name in run]


def serialization_id(names: list[str], crcs: list[int]) -> str:
    """PyTorch's ``.data/serialization_id`` for records ``names`` (in write order) with CRCs ``crcs``."""
    try:
        ordered = _unordered_set_order(names)
    except OverflowError:
        ordered = sorted(names)  # still a deterministic id; torch never checks it
    h = 0
    for name in ordered:
        h = _combine(h, _std_hash(name.encode()))
    c = 0
    for crc in crcs:
        c = _combine(c, crc)
    return f"{h:020d}{c:020d}"
