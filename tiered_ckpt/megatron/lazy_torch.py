"""Torch zip files on a tier, opened for range reads: only the pickle is read up front, tensors on demand.

:func:`open_lazy` reads a file's zip directory and ``data.pkl`` (with torch's weights-only unpickler and
Megatron's allow-list: nothing outside it is ever called) and gives the content with every tensor as a
:class:`LazyTensor`; ``t[a:b]`` then reads just those elements with ``Tier.read_range``. :class:`LazyArray` is the
duck type the merge/split code accepts in place of a tensor (:func:`copy_range` copies without a second buffer).
Files must store their records uncompressed, as ``torch.save`` does.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import DecodeError
from ..tiers.base import Tier, bytes_to_tensor
from .torch_records import DICTS, ZIP64_MARKER, itemsize, same_dict

MAX_PICKLE_BYTES = 256 << 20  # a data.pkl larger than this is not a checkpoint we read lazily
READ_PIECE = 16 << 20  # bytes per range read when copying out of a file
READ_AHEAD = 4  # such ranges read at once


class RangeReader:
    """What the lazy reader needs from where a file lives: its size and byte ranges (a Tier and a key)."""

    def __init__(self, tier: Any, key: str, *, where: str | None = None):
        self.tier, self.key = tier, key
        self.where = where or key
        self.bytes_read = 0
        self._count = threading.Lock()  # ranges of one copy are read on several threads

    def size(self) -> int:
        return self.tier.size(self.key)

    @property
    def ranges_at_once(self) -> int:
        """How many ranges a copy may read at once: one where the tier reads a range by reading the whole blob
        (a plugin kind that keeps :class:`~tiered_ckpt.tiers.base.Tier`'s fallback), which would hold that many
        whole files."""
        whole_blob = getattr(type(self.tier), "read_range", None) is Tier.read_range
        return 1 if whole_blob else READ_AHEAD

    def read(self, offset: int, length: int) -> bytes:
        data = self.tier.read_range(self.key, offset, length)
        with self._count:
            self.bytes_read += length
        return data

    def view(self, offset: int, length: int) -> Any:
        """The bytes of a range for a caller that only hashes them (a buffer; no copy where the file is in
        memory)."""
        return self.read(offset, length)


class BytesReader(RangeReader):
    """A file already in memory."""

    def __init__(self, data: memoryview, where: str):
        super().__init__(None, where, where=where)
        self.data = data

    def size(self) -> int:
        return len(self.data)

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.view(offset, length))

    def view(self, offset: int, length: int) -> memoryview:
        self.bytes_read += length
        return self.data[offset:offset + length]


@dataclass
class _Record:
    header_offset: int
    size: int
    data_offset: int | None = None
    crc: int = 0  # the CRC-32 the zip directory gives for the record's bytes


class LazyArray:
    """Something shaped like a 1-D tensor whose elements are read when sliced: ``t[a:b]`` gives a tensor."""

    dtype: torch.dtype
    shape: torch.Size

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __getitem__(self, index: slice) -> torch.Tensor:
        raise NotImplementedError

    def copy_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """``out.copy_(self[start:stop])`` without keeping a second copy of the elements around."""
        out.copy_(self[start:stop])


def copy_range(out: torch.Tensor, src: Any, start: int, stop: int) -> None:
    """``out.copy_(src[start:stop])`` for tensors and lazy arrays (these read straight into ``out``)."""
    if isinstance(src, LazyArray):
        src.copy_into(out, start, stop)
    else:
        out.copy_(src[start:stop])


class LazyTensor(LazyArray):
    """A tensor inside a torch zip file, read when sliced: ``t[a:b]`` reads only those elements.

    Slicing works on the flattened tensor (it must be contiguous in its storage, as every tensor of
    Megatron's and our files is); :meth:`load` reads it whole with its shape.
    """

    def __init__(self, file: LazyTorchFile, record: str, dtype: torch.dtype, shape: tuple[int, ...],
                 stride: tuple[int, ...], storage_offset: int):
        self.file, self.record, self.dtype = file, record, dtype
        self.shape, self._stride, self._offset = torch.Size(shape), stride, storage_offset

    def __repr__(self) -> str:
        return f"LazyTensor({self.file.where}:{self.record}, {self.dtype}, {tuple(self.shape)})"

    def _contiguous(self) -> bool:
        expected, acc = [], 1
        for s in reversed(self.shape):
            expected.append(acc)
            acc *= s
        return all(s == e or n == 1 for s, e, n in zip(self._stride, reversed(expected), self.shape,
                                                        strict=True))

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a LazyTensor supports only contiguous slices t[a:b] of its flattened elements")
        if not self._contiguous():
            raise DecodeError(f"{self.file.where}: {self.record} is not contiguous; load() it instead")
        start, stop, _ = index.indices(self.numel())
        stop = max(start, stop)
        return self.file.read_elements(self.record, self.dtype, self._offset + start, stop - start)

    def copy_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        if not self._contiguous():
            raise DecodeError(f"{self.file.where}: {self.record} is not contiguous; load() it instead")
        self.file.copy_elements(self.record, self.dtype, self._offset + start, stop - start, out)

    def load(self) -> torch.Tensor:
        if self.numel() == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self._stride, strict=True))
        flat = self.file.read_elements(self.record, self.dtype, self._offset, span)
        return flat.as_strided(self.shape, self._stride).clone() if not self._contiguous() else flat.view(
            self.shape)


class LazyTorchFile:
    """A torch zip file opened for range reads: :attr:`obj` is its content with :class:`LazyTensor`s."""

    def __init__(self, reader: RangeReader, *, unpickle: bool = True):
        self.reader = reader
        self.where = reader.where
        self.size = reader.size()
        self.records = self._central_directory()
        pkl_names = [n for n in self.records if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl_names) != 1:
            raise DecodeError(f"{self.where}: not a torch file (no single <archive>/data.pkl record)")
        self.prefix = pkl_names[0].rsplit("/", 1)[0]
        order = self.records.get(f"{self.prefix}/byteorder")
        if order is not None and self._read_record(f"{self.prefix}/byteorder") != b"little":
            raise DecodeError(f"{self.where}: big-endian torch files are not supported")
        self._pkl_name = pkl_names[0]
        if unpickle:
            self.obj  # noqa: B018 - refuse an unsafe or broken pickle when the file is opened

    @functools.cached_property
    def obj(self) -> Any:
        """The content, unpickled with the allow-list (``unpickle=False``: on first use, for callers that only
        look at :meth:`pickle_bytes`)."""
        return self._unpickle(self.pickle_bytes())

    # ----- zip structure ------------------------------------------------------------------------------------
    def _central_directory(self) -> dict[str, _Record]:
        size = self.size
        if size < 22:
            raise DecodeError(f"{self.where}: not a torch file ({size} bytes)")
        tail_len = min(size, (64 << 10) + 22 + 20)
        tail = self.reader.read(size - tail_len, tail_len)
        pos = tail.rfind(b"PK\x05\x06")
        if pos < 0 or pos + 22 > len(tail):
            raise DecodeError(f"{self.where}: not a torch file (no zip end record)")
        _, _, _, _, entries, cd_size, cd_offset, _ = struct.unpack("<IHHHHIIH", tail[pos:pos + 22])
        if pos >= 20 and tail[pos - 20:pos - 16] == b"PK\x06\x07":
            eocd64 = struct.unpack("<IIQI", tail[pos - 20:pos])[2]
            rec = self.reader.read(eocd64, 56)
            if rec[:4] != b"PK\x06\x06":
                raise DecodeError(f"{self.where}: bad zip64 end record")
            entries, cd_size, cd_offset = struct.unpack("<QQQ", rec[32:56])
        if cd_offset + cd_size > size:
            raise DecodeError(f"{self.where}: zip central directory runs past the end of the file")
        cd = self.reader.read(cd_offset, cd_size)
        records: dict[str, _Record] = {}
        p = 0
        for _ in range(entries):
            if cd[p:p + 4] != b"PK\x01\x02":
                raise DecodeError(f"{self.where}: corrupt zip central directory")
            (method, crc, csize, usize, nlen, xlen, clen, hoff) = (
                struct.unpack("<H", cd[p + 10:p + 12])[0], *struct.unpack("<III", cd[p + 16:p + 28]),
                *struct.unpack("<HHH", cd[p + 28:p + 34]), struct.unpack("<I", cd[p + 42:p + 46])[0])
            name = cd[p + 46:p + 46 + nlen].decode("utf-8", "replace")
            extra = cd[p + 46 + nlen:p + 46 + nlen + xlen]
            usize, csize, hoff = _zip64_fields(extra, usize, csize, hoff)
            if method != 0 or csize != usize:
                raise DecodeError(f"{self.where}: record {name} is compressed; torch files store records")
            records[name] = _Record(hoff, usize, crc=crc)
            p += 46 + nlen + xlen + clen
        return records

    def _data_offset(self, name: str) -> _Record:
        rec = self.records[name]
        if rec.data_offset is None:
            head = self.reader.read(rec.header_offset, 30)
            if head[:4] != b"PK\x03\x04":
                raise DecodeError(f"{self.where}: corrupt local header of {name}")
            nlen, xlen = struct.unpack("<HH", head[26:30])
            rec.data_offset = rec.header_offset + 30 + nlen + xlen
            if rec.data_offset + rec.size > self.size:
                raise DecodeError(f"{self.where}: record {name} runs past the end of the file")
        return rec

    @property
    def has_crcs(self) -> bool:
        """False for a file torch wrote without CRC-32s (``torch.utils.serialization.config.save.compute_crc32 =
        False``: every record's is 0)."""
        return any(rec.crc for rec in self.records.values() if rec.size)

    def damaged_records(self, on_bytes: Any = None) -> list[str] | None:
        """:meth:`crc_mismatches`, or None for a file written without CRC-32s (nothing to check against)."""
        return self.crc_mismatches(on_bytes) if self.has_crcs else None

    def crc_mismatches(self, on_bytes: Any = None) -> list[str]:
        """Each record whose bytes do not hash to the CRC-32 the zip directory gives for it (read in pieces of
        :data:`READ_PIECE`; ``on_bytes(n)`` after each), as ``"name: CRC-32 ..."``."""
        from ..fast_crc import crc32

        out = []
        for name in self.records:
            rec = self._data_offset(name)
            crc, done = 0, 0
            while done < rec.size:
                n = min(READ_PIECE, rec.size - done)
                crc = crc32(self.reader.view(rec.data_offset + done, n), crc)
                done += n
                if on_bytes is not None:
                    on_bytes(n)
            if crc != rec.crc:
                out.append(f"{name}: CRC-32 {crc:08x}, the zip directory says {rec.crc:08x}")
        return out

    def pickle_bytes(self, limit: int | None = None) -> bytes:
        """The file's ``data.pkl`` record (its pickle, tensors as persistent ids)."""
        return self._read_record(self._pkl_name, MAX_PICKLE_BYTES if limit is None else limit)

    def _read_record(self, name: str, limit: int | None = None) -> bytes:
        rec = self._data_offset(name)
        if limit is not None and rec.size > limit:
            raise DecodeError(f"{self.where}: {name} is {rec.size} bytes, more than {limit}")
        return self.reader.read(rec.data_offset, rec.size)

    def read_elements(self, record: str, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
        """``count`` elements of ``dtype`` from element ``start`` of a record (a fresh CPU tensor)."""
        item = itemsize(dtype)
        rec = self._data_offset(record)
        if start < 0 or (start + count) * item > rec.size:
            raise DecodeError(f"{self.where}: elements [{start}, {start + count}) outside {record}")
        if count == 0:
            return torch.empty(0, dtype=dtype)
        data = self.reader.read(rec.data_offset + start * item, count * item)
        return bytes_to_tensor(data).view(dtype)

    def copy_elements(self, record: str, dtype: torch.dtype, start: int, count: int, out: torch.Tensor) -> None:
        """:meth:`read_elements` into ``out``, casting, without a second copy of the bytes."""
        item = itemsize(dtype)
        rec = self._data_offset(record)
        if start < 0 or (start + count) * item > rec.size or out.numel() != count:
            raise DecodeError(f"{self.where}: elements [{start}, {start + count}) outside {record}")
        step = max(1, READ_PIECE // item)

        def piece(at: int) -> None:
            n = min(step, count - at)
            data = self.reader.read(rec.data_offset + (start + at) * item, n * item)
            dst = out[at:at + n]
            # On the pool's threads: no torch tensor over the read-only bytes (torch warns, and silencing that
            # with warnings.catch_warnings is not thread-safe: it could leave the filter on for the process).
            if dst.dtype == dtype and dst.device.type == "cpu" and dst.is_contiguous():
                dst.view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            else:  # a cast (or another device): through a writable copy of the piece
                dst.copy_(bytes_to_tensor(data).view(dtype))

        starts = range(0, count, step)  # bounded reads: a bucket's shard can be hundreds of MB
        at_once = self.reader.ranges_at_once
        if len(starts) == 1 or at_once == 1 or isinstance(self.reader, BytesReader):
            for at in starts:
                piece(at)
            return
        # A few ranges in flight: on an object store each is a request of its own, and one at a time leaves the
        # connection idle between them (a reshard from S3 read at one request's speed). At most ``at_once``
        # pieces are held at once.
        with ThreadPoolExecutor(min(at_once, len(starts)), thread_name_prefix="tiered_ckpt-ranges") as pool:
            list(pool.map(piece, starts))

    # ----- the pickle ---------------------------------------------------------------------------------------
    def _unpickle(self, pkl: bytes) -> Any:
        from torch import _weights_only_unpickler

        from .safe_load import allow_megatron_globals

        storages: dict[int, tuple[str, torch.dtype]] = {}
        keep: list[Any] = []

        def persistent_load(pid: Any) -> Any:
            if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
                raise DecodeError(f"{self.where}: unexpected persistent id {pid!r:.80}")
            _, storage_type, key, _location, numel = pid
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            name = f"{self.prefix}/data/{key}"
            if name not in self.records:
                raise DecodeError(f"{self.where}: the pickle refers to a missing record {name}")
            untyped = torch.UntypedStorage(numel * itemsize(dtype), device="meta")
            keep.append(untyped)
            storages[untyped._cdata] = (name, dtype)
            return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

        with allow_megatron_globals():
            unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pkl), encoding="utf-8")
            unpickler.persistent_load = persistent_load
            try:
                obj = unpickler.load()
            except pickle.UnpicklingError as exc:
                raise _refused(self.where, exc, pkl) from None
        return self._lazify(obj, storages)

    def _lazify(self, obj: Any, storages: dict[int, tuple[str, torch.dtype]]) -> Any:
        if isinstance(obj, torch.Tensor):
            name, _ = storages[obj.untyped_storage()._cdata]
            return LazyTensor(self, name, obj.dtype, tuple(obj.shape), tuple(obj.stride()), obj.storage_offset())
        if type(obj) in DICTS:
            return same_dict(obj, ((k, self._lazify(v, storages)) for k, v in obj.items()))
        if type(obj) is list:
            return [self._lazify(v, storages) for v in obj]
        if type(obj) is tuple:
            return tuple(self._lazify(v, storages) for v in obj)
        return obj


def _refused(where: str, exc: Exception, pkl: bytes) -> Exception:
    """:class:`UnsafePickleError` naming the globals outside the allow-list, else :class:`DecodeError`."""
    import pickletools

    from torch import _weights_only_unpickler

    from ..errors import UnsafePickleError
    from .safe_load import allow_list

    allowed = {name for _, name in allow_list()} | set(_weights_only_unpickler._get_allowed_globals())
    try:
        names = sorted({arg.replace(" ", ".").replace("__builtin__.", "builtins.")  # protocol 2's name
                        for op, arg, _ in pickletools.genops(pkl) if op.name == "GLOBAL"})
    except Exception:  # a truncated pickle: the error text is all there is
        names = []
    unknown = [n for n in names if n not in allowed and not n.startswith("torch.")]
    if not unknown or "GLOBAL" not in str(exc):
        return DecodeError(f"{where}: refused by the weights-only unpickler: {exc}")
    err = UnsafePickleError(f"{where}: refusing to unpickle {', '.join(unknown)}: not in the allow-list of Megatron "
                            "checkpoints (unpickling it could run arbitrary code); pass trust_pickles=True only if you "
                            "trust this file")
    err.path, err.globals = where, unknown  # type: ignore[attr-defined]
    return err


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, n = struct.unpack("<HH", extra[p:p + 4])
        if tag == 1:
            body, q = extra[p + 4:p + 4 + n], 0
            if usize == ZIP64_MARKER:
                usize, q = struct.unpack("<Q", body[q:q + 8])[0], q + 8
            if csize == ZIP64_MARKER:
                csize, q = struct.unpack("<Q", body[q:q + 8])[0], q + 8
            if offset == ZIP64_MARKER:
                offset = struct.unpack("<Q", body[q:q + 8])[0]
        p += 4 + n
    return usize, csize, offset


def open_lazy(tier: Any, key: str, *, where: str | None = None, unpickle: bool = True) -> LazyTorchFile:
    """Open ``key`` on ``tier`` (anything with ``size(key)`` and ``read_range(key, offset, length)``)."""
    return LazyTorchFile(RangeReader(tier, key, where=where), unpickle=unpickle)


def zip_crc_mismatches(data: memoryview, where: str) -> list[str] | None:
    """:meth:`LazyTorchFile.crc_mismatches` of a torch file in memory; None when it was written without
    CRC-32s."""
    return LazyTorchFile(BytesReader(data, where), unpickle=False).damaged_records()


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`LazyTensor` read into a real tensor."""
    if isinstance(obj, LazyTensor):
        return obj.load()
    if type(obj) in DICTS:
        return same_dict(obj, ((k, materialize(v)) for k, v in obj.items()))
    if type(obj) is list:
        return [materialize(v) for v in obj]
    if type(obj) is tuple:
        return tuple(materialize(v) for v in obj)
    return obj


def is_tensor_like(t: Any) -> bool:
    return isinstance(t, torch.Tensor | LazyArray)
