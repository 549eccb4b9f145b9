"""DCP's on-disk format, byte for byte: the ``.distcp`` data files and the pickled ``.metadata``.

A ``.distcp`` file is what DCP's ``FileSystemWriter`` writes for one rank: its BYTE_IO items as raw bytes, each
tensor as the bytes of ``torch.save(tensor)``, one after the other; ``.metadata`` maps every item to its
``_StorageInfo(relative_path, offset, length)``. ``torch.save``'s length depends only on the tensor's dtype and
shape, so the offsets are known when the plan is (before the drain writes a byte): :func:`torch_save_length`
computes them, and the codec checks each one while it writes (a difference is an error, never a wrong file).
``.metadata``'s allow-list reader (:func:`load_metadata`, re-exported here) and the merge of a save on a cached plan
live in :mod:`._metadata`, which the ``dcp`` layout imports too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..codecs.file_codecs import FileCodec, ItemSource
from ..errors import DecodeError, EncodeError
from ..layouts.dcp import DATA_ITEM, METADATA_FILE, METADATA_ITEM  # noqa: F401 - the names, in one place
from ..megatron import torch_zip
from ..tiers.base import as_memoryview
from ._metadata import load_metadata  # noqa: F401 - where readers of .metadata take it

ARCHIVE = "archive"  # torch.save's top directory for a buffer


def data_file(rank: int) -> str:
    """DCP's name of a rank's only data file (``FileSystemWriter`` with one thread: ``__{rank}_0.distcp``)."""
    return f"__{rank}_0.distcp"


def parse_data_file(name: str) -> int | None:
    """The rank of ``__{rank}_{i}.distcp``, or None."""
    if not (name.startswith("__") and name.endswith(".distcp")):
        return None
    rank, _, index = name[2:-len(".distcp")].partition("_")
    return int(rank) if rank.isdigit() and index.isdigit() else None


def _record_sizes(pkl_len: int, nbytes: int, sid_len: int) -> list[tuple[str, int]]:
    # the records of torch_zip._records, in its order
    return [("data.pkl", pkl_len), (".format_version", 1), (".storage_alignment", 2), ("byteorder", 6),
            ("data/0", nbytes), ("version", 2), (".data/serialization_id", sid_len)]


def _zip_length(records: list[tuple[str, int]]) -> int:
    """The length of torch_zip's zip of these (name, size) records (no page-congruent padding)."""
    offset = 0
    central = 0
    for name, size in records:
        full = len(f"{ARCHIVE}/{name}".encode())
        big_size, big_offset = size >= torch_zip.ZIP64_FROM, offset >= torch_zip.ZIP64_FROM
        fields = (16 if big_size else 0) + (8 if big_offset else 0)
        zip64 = 4 + fields if fields else 0
        start = offset + 30 + full + zip64 + 4
        pad = -start % torch_zip.ALIGNMENT
        tail = (24 if big_size else 16) if size else 0
        central += 46 + full + (4 + fields if fields else 0)
        offset += 30 + full + zip64 + 4 + pad + size + tail
    return offset + central + 56 + 20 + 22  # zip64 end record, its locator, the end record


@functools.lru_cache(maxsize=65536)  # (dtype, shape) pairs: models repeat them
def torch_save_length(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """``len(torch.save(t))`` for a contiguous CPU tensor ``t`` of ``dtype`` and ``shape``."""
    stream = torch_zip.StreamedTensor(dtype, tuple(shape), lambda: [])
    pkl, _ = torch_zip.pickle_with_streams(stream)
    names = [n for n, _ in _record_sizes(0, 0, 0)][:-1]
    sid = torch_zip.serialization_id(names, [0] * len(names))
    return _zip_length(_record_sizes(len(pkl), stream.nbytes, len(sid.encode())))


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in C order, as a 1-D uint8 CPU tensor (a view where ``t`` is contiguous on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def iter_tensor_record(t: torch.Tensor) -> Iterator[Any]:
    """``torch.save(t)``'s bytes as chunks, the tensor's bytes streamed from where they are (no copy)."""
    data = tensor_bytes(t)
    stream = torch_zip.StreamedTensor(t.dtype, tuple(t.shape), lambda: [data])
    return torch_zip.iter_torch_save(stream, archive=ARCHIVE)


class DistcpCodec(FileCodec):
    """A rank's ``dcp`` item as its ``.distcp`` file; the ``dcp_metadata`` item as the pickled Metadata's bytes.

    The item (see :mod:`tiered_ckpt.dcp.writer`) holds ``entries`` (tensors; BYTE_IO data as uint8 tensors) and
    ``index`` (per entry its kind, offset and length in the file, as the plan's WriteResults announced them)."""

    name = "distcp"
    extension = "distcp"
    layout_only = True  # it encodes the items the dcp layout's writer builds, nothing a user saves

    def encode(self, src: ItemSource, *, byte_grouping: bool = False) -> Iterable[Any]:
        state = src.materialize(copy=False)
        if "metadata" in state:
            yield state["metadata"]
            return
        offset = 0
        for i, (entry, info) in enumerate(zip(state["entries"], state["index"], strict=True)):
            if info["offset"] != offset:
                raise EncodeError(f"item {src.name!r} entry {i} ({info.get('fqn')!r}): planned at byte "
                                  f"{info['offset']} of the .distcp file, would be written at {offset}")
            if info["kind"] == "bytes":
                chunks: Iterable[Any] = [entry]
            else:
                chunks = iter_tensor_record(entry)
            n = 0
            for chunk in chunks:
                n += len(as_memoryview(chunk))
                yield chunk
            if n != info["length"]:
                raise EncodeError(f"item {src.name!r} entry {i} ({info.get('fqn')!r}): {n} bytes written, the "
                                  f"plan announced {info['length']} (shape {tuple(entry.shape)}, {entry.dtype})")
            offset += n

    def decode(self, blob: torch.Tensor, *, copy: bool = True, map_location: Any = None,
               trust_pickles: bool = False, where: str = "", byte_grouping: bool = False) -> Any:
        raise DecodeError(f"{where}: a DCP file is read through DCP: dcp.load(state_dict, storage_reader="
                          "tiered_ckpt.dcp.TieredStorageReader(engine)), or DCP's FileSystemReader on the step "
                          "directory")
