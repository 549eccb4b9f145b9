"""A read-only, seekable file over a memoryview: for APIs that want a file (``torch.load``, botocore request
bodies) when the bytes are already in memory, without copying them into a ``BytesIO`` first."""

from __future__ import annotations

import io
from typing import Any


class MemoryReader(io.RawIOBase):
    def __init__(self, view: memoryview):
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = self._view[self._pos:end].tobytes() if end > self._pos else b""
        self._pos = max(self._pos, end)
        return out

    def __len__(self) -> int:
        return len(self._view)
