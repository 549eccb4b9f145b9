"""File codecs: how one item becomes the bytes of one file on a file tier, and back.

* ``flat`` — the snapshot's own format: a 16-byte prefix (magic + header length), the JSON header, padding to 64
  bytes, then the tensor bytes exactly as they sit in the memory slot. Writing it is a straight copy of the slot
  (no serialization work), and reading it can map tensors without copying.
* ``torch`` — ``torch.save``'s zip format, for the files Megatron-LM must read (``model_optim_rng.pt``,
  ``distrib_optim.pt``). Loading goes through the restricted unpickler (never arbitrary code); with ``copy=False``
  (bytes the caller owns, such as a file tier's private read) its storages are views of those bytes, not copies.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DecodeError
from ..tiers.base import IO_BLOCK, Chunk, StableChunks, StableStream, as_memoryview
from . import flat
from .byte_grouping import grouped_chunks, ungroup_

FLAT_MAGIC = b"TCKFLAT1"
_PREFIX = struct.Struct("<8sQ")
ALIGN = 64
DATA_ALIGN = IO_BLOCK  # where flat files start their data: a multiple of ALIGN (readers only assume ALIGN)


@dataclass
class ItemSource:
    """One item, ready to be encoded: its flat header and the uint8 view of its tensor bytes (in a slot)."""

    name: str
    header: bytes
    data: torch.Tensor

    def materialize(self, copy: bool = False) -> Any:
        return flat.restore(flat.decode_header(self.header), self.data, copy=copy)


class FileCodec:
    name = "abstract"
    extension = "bin"
    # Only tiered_ckpt reads this format back: a tier may store its files in a form no other program reads as one
    # file (Tier.write_private_blob). False for formats users open with other tools (torch.load).
    private = False
    # The format of a layout's own files (DCP's ``.distcp``): only the layout picks it (Layout.codec_for); a tier's
    # ``codec``/``codecs`` naming it is a configuration error, since the codec needs items that layout builds.
    layout_only = False

    supports_byte_grouping = False

    def encode(self, src: ItemSource, *, byte_grouping: bool = False) -> Iterable[Chunk]:
        raise NotImplementedError

    def decode(self, blob: torch.Tensor, *, copy: bool = True, map_location: Any = None,
               trust_pickles: bool = False, where: str = "", byte_grouping: bool = False) -> Any:
        raise NotImplementedError


class FlatFileCodec(FileCodec):
    name = "flat"
    extension = "flat"
    private = True
    supports_byte_grouping = True

    def encode(self, src: ItemSource, *, byte_grouping: bool = False) -> Iterable[Chunk]:
        # The header is padded with JSON whitespace up to a page boundary, so the tensor bytes (page-aligned in
        # the slot) sit on a block boundary of the file too and an O_DIRECT writer sends them without a copy.
        # Readers need nothing new: the data still starts at the first 64-byte boundary after the header.
        header = src.header + b" " * ((-(_PREFIX.size + len(src.header))) % DATA_ALIGN)
        prefix = _PREFIX.pack(FLAT_MAGIC, len(header)) + header
        if byte_grouping:
            return itertools.chain([prefix], grouped_chunks(flat.decode_header(src.header), src.data))
        # the source's bytes (a pinned slot's or its own buffer) stay as they are until the write returns
        return StableChunks([prefix, src.data])

    @staticmethod
    def split(blob: torch.Tensor, where: str = "") -> tuple[bytes, torch.Tensor]:
        """(header bytes, data view) of a flat file."""
        if blob.numel() < _PREFIX.size:
            raise DecodeError(f"{where}: too short for a flat checkpoint file ({blob.numel()} bytes)")
        magic, hlen = _PREFIX.unpack(bytes(as_memoryview(blob[:_PREFIX.size])))
        if magic != FLAT_MAGIC:
            raise DecodeError(f"{where}: not a flat checkpoint file (magic {magic!r})")
        end = _PREFIX.size + hlen
        if end > blob.numel():
            raise DecodeError(f"{where}: header length {hlen} runs past the end of the file")
        header = bytes(as_memoryview(blob[_PREFIX.size:end]))
        start = end + (-end) % ALIGN
        return header, blob[start:]

    def decode(self, blob: torch.Tensor, *, copy: bool = True, map_location: Any = None,
               trust_pickles: bool = False, where: str = "", byte_grouping: bool = False) -> Any:
        header, data = self.split(blob, where)
        try:
            info = flat.decode_header(header)
        except DecodeError as exc:
            raise DecodeError(f"{where}: {exc}") from None
        if byte_grouping:
            ungroup_(info, data)
        return flat.restore(info, data, copy=copy, map_location=map_location)


class TorchFileCodec(FileCodec):
    name = "torch"
    extension = "pt"

    def encode(self, src: ItemSource, *, byte_grouping: bool = False) -> Iterable[Chunk]:
        # torch.save's exact bytes, streamed tensor by tensor: no whole-file buffer, and zlib's CRC32 instead of
        # torch's slow one. The zip's top directory is named after the file, as torch.save names it.
        from ..megatron.torch_zip import iter_torch_save

        # Large tensors are placed page-congruent with their slot memory so the local tier's O_DIRECT writer sends
        # them without a copy; torch.load reads the padding as it reads torch.save's.
        # Every torch file we write is one Megatron-LM reads: refuse what its weights-only loader would refuse.
        # Its tensors' bytes are views of the source (as stable as the flat codec's, above) and every other piece
        # is a buffer of its own (tensors_only): the stream is stable, so a writer may keep a piece past the next.
        return StableStream(iter_torch_save(src.materialize(), archive=src.name, page_congruent=True,
                                            megatron_loadable=True, tensors_only=True))

    def decode(self, blob: torch.Tensor, *, copy: bool = True, map_location: Any = None,
               trust_pickles: bool = False, where: str = "", byte_grouping: bool = False) -> Any:
        from ..megatron.safe_load import load_bytes, load_views

        if not copy:  # the caller owns these bytes (or wants views): storages are views of blob, no second copy
            return load_views(blob, where=where, map_location=map_location or "cpu", trust_pickles=trust_pickles)
        return load_bytes(as_memoryview(blob), where=where, map_location=map_location or "cpu",
                          trust_pickles=trust_pickles)
