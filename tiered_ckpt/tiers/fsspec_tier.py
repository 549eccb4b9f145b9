"""``fsspec``: blobs on anything fsspec can write (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``).

Keys map to ``{root}/{key}`` under the URL's path. How a blob becomes visible in one step depends on the
store:

* **Object stores** (s3, gcs, azure, memory, ...): an object appears only when its upload completes, so the
  blob is uploaded to its final name directly. The file is opened with ``autocommit=False`` and committed
  after the last chunk (s3fs completes the multipart upload then); if the producer fails midway the upload is
  discarded, and the old object, if any, stays. ``capabilities.atomic_rename`` is False.
* **File systems** with a rename (``file://``, and other non-object stores): write a temporary name in the
  same directory, then ``mv`` it over the key. ``capabilities.atomic_rename`` is True.

The tier never fsyncs: fsspec streams have no portable fsync, and durability on a shared file system is that
file system's business (use the ``local`` kind for a node-local disk). Missing keys raise
:class:`~tiered_ckpt.errors.BlobNotFoundError`; timeouts and connection errors
:class:`~tiered_ckpt.errors.TransientTierError`; full disks and permission errors
:class:`~tiered_ckpt.errors.PermanentTierError`; other errors of the storage library propagate for the retry
policy to classify.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from ..errors import BlobNotFoundError, ConfigError, PermanentTierError, TierError, TransientTierError
from ..validate import Size
from ._files import is_temp_name, remove_empty_dirs, temp_name, tier_error
from .base import (
    Capabilities,
    Chunk,
    Tier,
    TierContext,
    as_memoryview,
    bytes_to_tensor,
    check_key,
    check_prefix,
)

# Stores where an upload becomes visible whole when it completes (and where a rename would be a copy).
OBJECT_STORES = frozenset({
    "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "oci", "oss", "cos",
    "obs", "tos", "r2", "b2", "swift",
})
_READ_PIECE = 16 << 20  # bytes per readinto call
_READ_ATTEMPTS = 3  # reads of a blob that is being replaced


@dataclass(frozen=True)
class FsspecOptions:
    url: str  # e.g. s3://bucket/run, file:///shared/ckpt, memory://test
    options: dict[str, Any] = field(default_factory=dict)  # storage options for fsspec.url_to_fs
    block_size: Size | None = None  # upload part / read block size (None: the backend's default)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: expected an fsspec URL such as s3://bucket/path, got an empty string")


def protocol_of(url: str) -> str:
    """The protocol that stores the data (the innermost of a chained URL); ``file`` for plain paths."""
    protocol, _ = fsspec.core.split_protocol(url.split("::")[-1])
    return protocol or "file"


class FsspecTier(Tier):
    kind = "fsspec"
    capabilities = Capabilities(memory=False, node_local=False, survives_process=True, survives_node=True,
                                atomic_rename=False, zero_copy_read=False)
    Options = FsspecOptions

    @classmethod
    def capabilities_for(cls, options: FsspecOptions) -> Capabilities:
        protocol = protocol_of(options.url)
        if protocol == "memory":  # one process's dict: a test double, volatile and private
            return Capabilities(node_local=True, survives_process=False, survives_node=False,
                                atomic_rename=False)
        return Capabilities(node_local=False, survives_process=True, survives_node=True,
                            atomic_rename=protocol not in OBJECT_STORES)

    def __init__(self, name: str, options: FsspecOptions, context: TierContext | None = None):
        super().__init__(name, options, context)
        try:
            self.fs, root = fsspec.core.url_to_fs(options.url, **dict(options.options))
        except (ImportError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot open {options.url}: {exc}", key_path=f"tier {name!r}.url") from exc
        self.root = root.rstrip("/")
        if not self.root.strip("/"):
            raise ConfigError(f"{options.url} names no directory or bucket; add a path",
                              key_path=f"tier {name!r}.url")
        self.capabilities = self.capabilities_for(options)
        self._rename = self.capabilities.atomic_rename
        self._open_kw = {"block_size": options.block_size} if options.block_size else {}

    # ----- helpers -----------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    @contextlib.contextmanager
    def _errors(self, key: str | None, op: str, path: str, missing_ok: bool = False) -> Iterator[None]:
        """Storage errors of ``op`` as tier errors (see the module docstring); others pass unchanged."""
        try:
            yield
        except TierError:
            raise
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            if missing_ok:
                raise BlobNotFoundError("no such blob", tier=self.name, key=key) from exc
            raise PermanentTierError(f"{op} {path}: {exc}", tier=self.name, key=key) from exc
        except (TimeoutError, ConnectionError) as exc:
            raise TransientTierError(f"{op} {path}: {exc!r}", tier=self.name, key=key) from exc
        except PermissionError as exc:
            raise PermanentTierError(f"{op} {path}: permission denied: {exc}", tier=self.name,
                                     key=key) from exc
        except OSError as exc:
            if exc.errno is None:
                raise
            raise tier_error(exc, tier=self.name, key=key, op=op, path=path) from exc

    def _write_stream(self, f: Any, key: str, path: str, chunks: Iterable[Chunk]) -> int:
        """Write every chunk to an open file; large ones in block-sized pieces (buffered files copy)."""
        piece = getattr(f, "blocksize", None) if not isinstance(f, MemoryFile) else None
        total = 0
        for chunk in chunks:  # the producer's exceptions propagate unchanged
            mv = as_memoryview(chunk)
            with self._errors(key, "write", path):
                if piece and len(mv) > piece:
                    for off in range(0, len(mv), piece):
                        f.write(mv[off:off + piece])
                elif len(mv):
                    f.write(mv)
            total += len(mv)
        return total

    # ----- blob primitives ---------------------------------------------------------------------------------
    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        path = self._path(key)
        if self._rename:
            return self._write_renamed(key, path, chunks)
        return self._write_direct(key, path, chunks)

    def _write_renamed(self, key: str, path: str, chunks: Iterable[Chunk]) -> int:
        parent, base = path.rsplit("/", 1)
        tmp = f"{parent}/{temp_name(base)}"
        with self._errors(key, "create", tmp):
            self.fs.makedirs(parent, exist_ok=True)
            f = self.fs.open(tmp, "wb", **self._open_kw)
        try:
            try:
                total = self._write_stream(f, key, tmp, chunks)
            finally:
                with self._errors(key, "close", tmp):
                    f.close()
            with self._errors(key, "rename into", path):
                self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise
        return total

    def _write_direct(self, key: str, path: str, chunks: Iterable[Chunk]) -> int:
        with self._errors(key, "create", path):
            if isinstance(self.fs, MemoryFileSystem):
                # MemoryFileSystem.open() publishes the file when opened; build it aside, commit at the end
                f = MemoryFile(self.fs, self.fs._strip_protocol(path))
            else:
                # autocommit=False: nothing is visible until commit(). _open, not open: open() also queues
                # the file on the filesystem's shared transaction object, which never forgets it.
                f = self.fs._open(path, mode="wb", autocommit=False, **self._open_kw)
        try:
            total = self._write_stream(f, key, path, chunks)
            with self._errors(key, "upload", path):
                f.close()
                f.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            with contextlib.suppress(Exception):
                f.closed = True  # or the file's __del__ would close() it, which may still upload what it has
            raise
        return total

    def read_blob(self, key: str) -> torch.Tensor:
        path = self._path(key)
        with self._errors(key, "read", path, missing_ok=True):
            if isinstance(self.fs, MemoryFileSystem):  # its open() shares one file position between readers
                return bytes_to_tensor(self.fs.cat_file(path))
            for _attempt in range(_READ_ATTEMPTS):
                try:
                    with self.fs.open(path, "rb", **self._open_kw) as f:
                        out = self._read_all(f)
                except Exception as exc:
                    if type(exc).__name__ != "FileExpired":  # s3fs: replaced between open and a range GET
                        raise
                    continue
                if out is not None:
                    return out
        raise TransientTierError(f"the blob was replaced while being read, {_READ_ATTEMPTS} times in a row",
                                 tier=self.name, key=key)

    def _read_all(self, f: Any) -> torch.Tensor | None:
        """An open file, read to its end into one tensor with ``readinto`` (no intermediate ``bytes``);
        None if it turned out shorter or longer than announced (replaced while being read)."""
        size = getattr(f, "size", None)  # buffered (remote) files know it from the open
        if not isinstance(size, int):
            try:
                size = os.fstat(f.fileno()).st_size  # local files: the size of the inode we opened
            except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
                return bytes_to_tensor(f.read())
        out = torch.empty(size, dtype=torch.uint8)
        mv = memoryview(out.numpy()) if size else memoryview(bytearray())
        pos = 0
        while pos < size:
            n = f.readinto(mv[pos:pos + _READ_PIECE])
            if not n:
                break
            pos += n
        if pos != size or f.read(1):
            return None
        return out

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        size = self.size(key)
        if offset < 0 or length < 0 or offset + length > size:
            raise TierError(f"range {offset}+{length} is outside the blob of {size} bytes", tier=self.name,
                            key=key)
        if length == 0:
            return b""
        path = self._path(key)
        with self._errors(key, "read", path, missing_ok=True):
            return bytes(self.fs.cat_file(path, start=offset, end=offset + length))

    def size(self, key: str) -> int:
        path = self._path(key)
        with self._errors(key, "stat", path, missing_ok=True):
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise BlobNotFoundError("no such blob (a directory)", tier=self.name, key=key)
        return int(info["size"])

    def exists(self, key: str) -> bool:
        path = self._path(key)
        with self._errors(key, "stat", path):
            return bool(self.fs.isfile(path))

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        rel_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self.root}/{rel_dir}" if rel_dir else self.root
        with self._errors(None, "list", top):
            self.fs.invalidate_cache(top)
            try:
                paths = self.fs.find(top, detail=False)
            except FileNotFoundError:
                paths = []
        start = len(self.root) + 1
        keys = []
        for p in paths:
            p = self.fs._strip_protocol(p)
            if p.startswith(self.root + "/"):
                key = p[start:]
                if key.startswith(prefix) and not is_temp_name(key):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._errors(key, "delete", path):
            try:
                self.fs.rm_file(path)
            except (FileNotFoundError, IsADirectoryError):
                return
        self._prune([key])

    def delete_prefix(self, prefix: str) -> None:
        prefix = check_prefix(prefix.rstrip("/") + "/")
        keys = self.list(prefix)
        if not keys:
            return
        with self._errors(None, "delete", f"{self.root}/{prefix}"):
            try:
                self.fs.rm([f"{self.root}/{k}" for k in keys])  # one bulk request on object stores
            except FileNotFoundError:  # a concurrent delete; remove what is left one by one
                for k in keys:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(f"{self.root}/{k}")
        self._prune(keys)

    def _prune(self, keys: list[str]) -> None:
        """On a local file system, remove directories the deletions left empty (object stores have none)."""
        if isinstance(self.fs, LocalFileSystem):
            for d in sorted({k.rsplit("/", 1)[0] for k in keys if "/" in k}, key=len, reverse=True):
                remove_empty_dirs(self.root, d)

    def describe(self) -> str:
        return f"fsspec {self.options.url}"

