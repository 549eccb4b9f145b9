"""``fsspec``: blobs on anything fsspec can write (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``).

Keys map to ``{root}/{key}`` under the URL's path. How a blob becomes visible in one step depends on the
store:

* **S3** (``s3://``, ``s3a://``, through s3fs): the tier drives the transfers itself with s3fs's client
  (``_call_s3``), see "S3 transfers" below.
* **Other object stores** (gcs, azure, memory, ...): an object appears only when its upload completes, so the
  blob is uploaded to its final name directly. The file is opened with ``autocommit=False`` and committed
  after the last chunk; if the producer fails midway the upload is discarded, and the old object, if any,
  stays. ``capabilities.atomic_rename`` is False.
* **File systems** with a rename (``file://``, and other non-object stores): write a temporary name in the
  same directory, then ``mv`` it over the key. ``capabilities.atomic_rename`` is True.

S3 transfers
------------
A blob that fits in one ``part_size`` is one ``PutObject``. A larger one is a multipart upload: parts of
``part_size`` bytes are uploaded in parallel, at most ``max_concurrency`` at a time, and the upload is
completed only after every part landed; on any failure (a part that keeps failing, the producer raising) the
parts in flight are cancelled and the upload is aborted, so nothing is ever visible under the key and no
parts are left behind. Memory stays bounded: a chunk that holds at least ``max_concurrency`` whole parts is
uploaded straight from the caller's buffer (zero-copy slices; the tier waits for them before asking for the
next chunk, since a producer may reuse its buffer); smaller chunks are gathered into at most
``max_concurrency + 1`` reusable part buffers. ``read_blob`` of an object larger than one part issues
``max_concurrency`` parallel ranged GETs (``If-Match`` the ETag, so a blob replaced mid-read is read again)
straight into one preallocated tensor.

Every HTTP request is tried up to ``request_attempts`` times (short exponential backoff with jitter, logged),
so one throttled part does not restart a 10 GiB upload; what still fails is raised as a
:class:`~tiered_ckpt.errors.TransientTierError` or :class:`~tiered_ckpt.errors.PermanentTierError` for the
engine's per-tier ``retry`` policy (backoff, deadline, ``retry`` events). botocore's and s3fs's own retries
are turned off on the tier's client so that the two layers above are the only ones and stay bounded.
``timeout_s`` sets botocore's connect and read timeouts; each request also has an overall ceiling (the
timeouts plus its size at 1 MiB/s), so an upload whose server stopped reading fails instead of hanging.

Endpoint and credentials come from ``options`` (``endpoint_url``, ``key``, ``secret``, ``token``,
``client_kwargs``, ``config_kwargs``...) or the usual environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), which
botocore reads. They never appear in ``describe()``, ``repr``, log lines or error messages: see
:func:`redact`.

The tier never fsyncs: fsspec streams have no portable fsync, and durability on a shared file system is that
file system's business (use the ``local`` kind for a node-local disk). Missing keys raise
:class:`~tiered_ckpt.errors.BlobNotFoundError`; timeouts, throttling, 5xx answers and connection errors
:class:`~tiered_ckpt.errors.TransientTierError`; full disks and permission errors
:class:`~tiered_ckpt.errors.PermanentTierError`; other errors of the storage library propagate (on S3: as a
:class:`~tiered_ckpt.errors.TierError` with a redacted message, chained to the original) for the retry policy
to classify.

The S3 helpers and the multipart upload live in ``_s3``, the redaction helpers in ``_redact``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from ..crashpoints import crash_point
from ..errors import BlobNotFoundError, ConfigError, PermanentTierError, TierError, TransientTierError
from ..retry import is_transient
from ..validate import PositiveInt, Seconds, Size
from ._files import is_temp_name, remove_empty_dirs, temp_name, tier_error, walk_strict
from ._redact import REDACTED, redact, redacted_options, secret_values
from ._s3 import (
    _BACKOFF_BASE_S,
    _BACKOFF_MAX_S,
    _MIN_RATE,
    _READ_ATTEMPTS,
    _READ_PIECE,
    S3_MAX_PART,
    S3_MIN_PART,
    S3_PROTOCOLS,
    MiB,
    _library_errors,
    _object_size,
    _Replaced,
    _Upload,
    s3_error_code,
)
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

log = logging.getLogger(__name__)

# Stores where an upload becomes visible whole when it completes (and where a rename would be a copy).
OBJECT_STORES = frozenset({
    "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "oci", "oss", "cos",
    "obs", "tos", "r2", "b2", "swift",
})

# ----- options ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class FsspecOptions:
    url: str  # e.g. s3://bucket/run, file:///shared/ckpt, memory://test
    options: dict[str, Any] = field(default_factory=dict)  # storage options for fsspec.url_to_fs
    block_size: Size | None = None  # buffered write/read block of non-S3 stores (None: the backend's default)
    part_size: Size = 64 * MiB  # S3: multipart part size, and the size of each ranged GET on reads
    max_concurrency: PositiveInt = 8  # S3: parts uploaded / ranges read in parallel per blob
    timeout_s: Seconds | None = None  # S3: connect and read timeout of each request (None: s3fs's 5 s / 15 s)
    request_attempts: PositiveInt = 3  # S3: tries of one request before the failure goes to the retry policy

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: expected an fsspec URL such as s3://bucket/path, got an empty string")
        if protocol_of(self.url) in S3_PROTOCOLS and not S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"part_size: expected 5MiB to 5GiB (S3's limits for a multipart part), got "
                             f"{self.part_size} bytes")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive duration, got {self.timeout_s}")

    def __repr__(self) -> str:
        return (f"FsspecOptions(url={redact(self.url)!r}, options={redacted_options(self.options)!r}, "
                f"block_size={self.block_size!r}, part_size={self.part_size!r}, "
                f"max_concurrency={self.max_concurrency!r}, timeout_s={self.timeout_s!r}, "
                f"request_attempts={self.request_attempts!r})")


def protocol_of(url: str) -> str:
    """The protocol that stores the data (the innermost of a chained URL); ``file`` for plain paths."""
    protocol, _ = fsspec.core.split_protocol(url.split("::")[-1])
    return protocol or "file"


def _is_s3_url(url: str) -> bool:
    return "::" not in url and protocol_of(url) in S3_PROTOCOLS


# ----- the tier --------------------------------------------------------------------------------------------
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
        self._secrets = secret_values(options.options)
        self._s3 = _is_s3_url(options.url)
        storage = self._s3_storage_options() if self._s3 else dict(options.options)
        try:
            self.fs, root = fsspec.core.url_to_fs(options.url, **storage)
        except (ImportError, ValueError, TypeError) as exc:
            # fsspec says "Install s3fs to access S3"; our extra brings the version we test with
            hint = " (pip install 'tiered-ckpt[s3]')" if isinstance(exc, ImportError) and self._s3 else ""
            raise ConfigError(redact(f"cannot open {options.url}: {exc}{hint}", self._secrets),
                              key_path=f"tier {name!r}.url") from None
        self.root = root.rstrip("/")
        from fsspec.implementations.local import LocalFileSystem

        self._local_fs = isinstance(self.fs, LocalFileSystem)
        if not self.root.strip("/"):
            raise ConfigError(f"{redact(options.url, self._secrets)} names no directory or bucket; add a path",
                              key_path=f"tier {name!r}.url")
        self.capabilities = self.capabilities_for(options)
        self._rename = self.capabilities.atomic_rename
        self._open_kw = {"block_size": options.block_size} if options.block_size else {}
        self._base_timeout: float | None = None
        if self._s3:
            self.fs.retries = 1  # our own instance (skip_instance_cache): the tier's tries are the only ones
            config = storage["config_kwargs"]
            connect = config.get("connect_timeout", getattr(self.fs, "connect_timeout", 5))
            read = config.get("read_timeout", getattr(self.fs, "read_timeout", 15))
            self._base_timeout = (connect or 0) + (read or 0) if connect and read else None

    def _s3_storage_options(self) -> dict[str, Any]:
        """The storage options for s3fs: the user's, plus the tier's timeouts, pool size and retry policy."""
        opts = self.options
        storage = dict(opts.options)
        storage.setdefault("skip_instance_cache", True)  # settings below must not leak into a shared instance
        storage.setdefault("use_listings_cache", False)  # listings must show what other ranks just wrote
        storage.setdefault("max_concurrency", opts.max_concurrency)
        config = dict(storage.get("config_kwargs") or {})
        if opts.timeout_s is not None:
            config["connect_timeout"] = opts.timeout_s
            config["read_timeout"] = opts.timeout_s
        # One try per botocore call: request_attempts and the engine's retry policy are the retry layers.
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("max_pool_connections", max(10, 2 * opts.max_concurrency))
        storage["config_kwargs"] = config
        return storage

    # ----- helpers -----------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets)

    def _tier_exception(self, exc: BaseException, key: str | None, op: str, path: str,
                        missing_ok: bool = False) -> BaseException | None:
        """The tier error for a storage error of ``op`` (raise it ``from exc``); None: let ``exc`` propagate."""
        if isinstance(exc, TierError) or not isinstance(exc, Exception):
            return None
        where = self._redact(f"{op} {path}")

        def text(detail: Any) -> str:
            return f"{where}: {self._redact(str(detail))}"

        network, credentials = _library_errors() if self._s3 else ((), ())
        if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            if missing_ok:
                return BlobNotFoundError("no such blob", tier=self.name, key=key)
            return PermanentTierError(text(exc), tier=self.name, key=key)
        if isinstance(exc, (TimeoutError, ConnectionError)) or (network and isinstance(exc, network)):
            return TransientTierError(text(f"{type(exc).__name__}: {exc}"), tier=self.name, key=key)
        if isinstance(exc, PermissionError):
            return PermanentTierError(text(f"permission denied: {exc}"), tier=self.name, key=key)
        if credentials and isinstance(exc, credentials):
            return PermanentTierError(text(f"{type(exc).__name__}: {exc} (give key/secret in the tier's options "
                                           "or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"),
                                      tier=self.name, key=key)
        if isinstance(exc, OSError) and exc.errno is not None:
            code = s3_error_code(exc) if self._s3 else None
            detail = exc.strerror or str(exc)
            clean = OSError(exc.errno, self._redact(f"{code}: {detail}" if code and code not in detail else detail))
            return tier_error(clean, tier=self.name, key=key, op=op, path=self._redact(path))
        if self._s3:  # the S3 stack's other errors: a redacted message; the retry policy reads the cause
            return TierError(text(f"{type(exc).__name__}: {exc}"), tier=self.name, key=key)
        return None

    @contextlib.contextmanager
    def _errors(self, key: str | None, op: str, path: str, missing_ok: bool = False) -> Iterator[None]:
        """Storage errors of ``op`` as tier errors (see the module docstring); others pass unchanged."""
        try:
            yield
        except Exception as exc:
            err = self._tier_exception(exc, key, op, path, missing_ok)
            if err is None:
                raise
            raise err from exc

    def _backoff(self, attempt: int) -> float:
        return min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def _log_retry(self, attempt: int, err: BaseException, delay: float) -> None:
        log.warning("%s (try %d of %d; again in %.2f s)", self._redact(str(err)), attempt,
                    self.options.request_attempts, delay)

    def _request(self, op: str, key: str | None, path: str, fn: Callable[[], Any], missing_ok: bool = False) -> Any:
        """``fn()`` with storage errors mapped; on S3, transient ones tried up to ``request_attempts`` times."""
        attempts = self.options.request_attempts if self._s3 else 1
        for attempt in range(1, attempts + 1):
            try:
                with self._errors(key, op, path, missing_ok):
                    return fn()
            except TierError as err:
                if attempt >= attempts or not is_transient(err):
                    raise
                delay = self._backoff(attempt)
                self._log_retry(attempt, err, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    async def _arequest(self, op: str, key: str | None, path: str, call: Callable[[], Awaitable[Any]], *,
                        nbytes: int = 0, missing_ok: bool = False, stop: threading.Event | None = None,
                        attempts: int | None = None) -> Any:
        """One S3 request on the event loop, tried up to ``request_attempts`` times, each under a ceiling."""
        attempts = attempts or self.options.request_attempts
        ceiling = self._ceiling(nbytes)
        for attempt in range(1, attempts + 1):
            try:
                return await asyncio.wait_for(call(), ceiling)
            except (asyncio.CancelledError, _Replaced):
                raise
            except Exception as exc:
                if s3_error_code(exc) == "PreconditionFailed":
                    raise _Replaced() from None
                err = self._tier_exception(exc, key, op, path, missing_ok) or exc
                if isinstance(exc, asyncio.TimeoutError) and not isinstance(err, TierError):
                    err = TransientTierError(self._redact(f"{op} {path}: no answer within {ceiling:.0f} s"),
                                             tier=self.name, key=key)
                if attempt >= attempts or not is_transient(err) or (stop is not None and stop.is_set()):
                    if err is exc:
                        raise
                    raise err from exc
                delay = self._backoff(attempt)
                self._log_retry(attempt, err, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _ceiling(self, nbytes: int) -> float | None:
        """The longest one request moving ``nbytes`` may take: the timeouts plus its bytes at 1 MiB/s."""
        return None if self._base_timeout is None else self._base_timeout + nbytes / _MIN_RATE

    def _sync(self, func: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Run a coroutine function on s3fs's event loop and wait for it."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, func, *args, **kwargs)

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
        if self._s3:
            return self._write_s3(key, path, chunks)
        if self._rename:
            return self._write_renamed(key, path, chunks)
        return self._write_direct(key, path, chunks)

    def _write_s3(self, key: str, path: str, chunks: Iterable[Chunk]) -> int:
        upload = _Upload(self, key, path)
        try:
            for chunk in chunks:  # the producer's exceptions propagate unchanged, after the abort
                upload.feed(as_memoryview(chunk))
            return upload.finish()
        except BaseException:
            upload.abort()
            raise

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
            crash_point("fsspec.temp_written")
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
        if self._s3:
            return self._read_s3(key, path)
        with self._errors(key, "read", path, missing_ok=True):
            if isinstance(self.fs, MemoryFileSystem):  # its open() shares one file position between readers
                return bytes_to_tensor(self.fs.cat_file(path))
            for _attempt in range(_READ_ATTEMPTS):
                try:
                    with self.fs.open(path, "rb", **self._open_kw) as f:
                        out = self._read_all(f)
                except Exception as exc:
                    if type(exc).__name__ != "FileExpired":  # replaced between open and a range GET
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
        if self._s3:
            bucket, obj, _ = self.fs.split_path(path)
            out = bytearray(length)
            try:
                self._sync(self._arequest, "read", key, path,
                           lambda: self._get_into(bucket, obj, None, offset, memoryview(out), True),
                           nbytes=length, missing_ok=True)
            except _Replaced:
                raise TransientTierError("the blob was replaced while being read", tier=self.name,
                                         key=key) from None
            return bytes(out)
        with self._errors(key, "read", path, missing_ok=True):
            return bytes(self.fs.cat_file(path, start=offset, end=offset + length))

    def size(self, key: str) -> int:
        path = self._path(key)
        if self._s3:
            return int(self._head(key, path)["ContentLength"])
        with self._errors(key, "stat", path, missing_ok=True):
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise BlobNotFoundError("no such blob (a directory)", tier=self.name, key=key)
        return int(info["size"])

    def exists(self, key: str) -> bool:
        path = self._path(key)
        if self._s3:  # a HEAD: fsspec's isfile() would answer False on a throttled request
            try:
                self._head(key, path)
            except BlobNotFoundError:
                return False
            return True
        with self._errors(key, "stat", path):
            return bool(self.fs.isfile(path))

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        rel_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self.root}/{rel_dir}" if rel_dir else self.root

        def find() -> list[str]:
            if self._local_fs:  # fsspec's find skips unreadable directories (ENOTDIR, EACCES) as if empty
                return [os.path.join(d, f) for d, _, files in walk_strict(top, self.root) for f in files]
            self.fs.invalidate_cache(top)
            try:
                return self.fs.find(top, detail=False)
            except FileNotFoundError:
                return []

        paths = self._request("list", None, top, find)
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

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except (FileNotFoundError, IsADirectoryError):
                pass

        self._request("delete", key, path, rm)
        self._prune([key])

    def delete_prefix(self, prefix: str) -> None:
        prefix = check_prefix(prefix.rstrip("/") + "/")
        keys = self.list(prefix)
        if not keys:
            return

        def rm() -> None:
            try:
                self.fs.rm([f"{self.root}/{k}" for k in keys])  # one bulk request on object stores
            except FileNotFoundError:  # a concurrent delete; remove what is left one by one
                for k in keys:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(f"{self.root}/{k}")

        self._request("delete", None, f"{self.root}/{prefix}", rm)
        self._prune(keys)

    def temp_files(self) -> list[str]:
        """Keys of temporary files that unfinished writes left (a crash before the rename), for ``gc``."""
        if not self._rename:
            return []  # object stores upload in place: nothing temporary is ever visible

        def find() -> list[str]:
            self.fs.invalidate_cache(self.root)
            try:
                return self.fs.find(self.root, detail=False)
            except FileNotFoundError:
                return []

        paths = (self.fs._strip_protocol(p) for p in self._request("list", None, self.root, find))
        return sorted(p[len(self.root) + 1:] for p in paths if p.startswith(self.root + "/") and is_temp_name(p))

    def remove_temp_file(self, key: str) -> None:
        if not is_temp_name(key):
            raise ValueError(f"{key!r} is not a temporary file")
        path = self._path(key)
        with contextlib.suppress(BlobNotFoundError):
            self._request("delete", key, path, lambda: self.fs.rm_file(path), missing_ok=True)
        self._prune([key])

    def _prune(self, keys: list[str]) -> None:
        """On a local file system, remove directories the deletions left empty (object stores have none)."""
        if isinstance(self.fs, LocalFileSystem):
            for d in sorted({k.rsplit("/", 1)[0] for k in keys if "/" in k}, key=len, reverse=True):
                remove_empty_dirs(self.root, d)

    def describe(self) -> str:
        text = f"fsspec {self.options.url}"
        if self._s3:
            opts = self.options.options
            endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                        or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
            if endpoint:
                text += f" at {endpoint}"
        return self._redact(text)

    # ----- S3 primitives (coroutines on s3fs's loop) -------------------------------------------------------
    def _head(self, key: str, path: str) -> dict[str, Any]:
        bucket, obj, _ = self.fs.split_path(path)
        return self._request("stat", key, path, lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=obj),
                             missing_ok=True)

    async def _get_into(self, bucket: str, obj: str, etag: str | None, offset: int, view: memoryview,
                        ranged: bool) -> None:
        """One GET (a range of it if ``ranged``) read straight into ``view``."""
        n = len(view)
        kw: dict[str, Any] = {"IfMatch": etag} if etag else {}
        if ranged:
            kw["Range"] = f"bytes={offset}-{offset + n - 1}"
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=obj, **kw)
        body = resp["Body"]
        try:
            if int(resp.get("ContentLength", n)) != n:
                raise _Replaced()
            await self._read_body(body, view, obj)
        finally:
            body.close()

    def _read_s3(self, key: str, path: str) -> torch.Tensor:
        bucket, obj, _ = self.fs.split_path(path)
        for _attempt in range(_READ_ATTEMPTS):
            try:
                return self._sync(self._aread_all, key, path, bucket, obj)
            except _Replaced:
                continue
        raise TransientTierError(f"the blob was replaced while being read, {_READ_ATTEMPTS} times in a row",
                                 tier=self.name, key=key)

    async def _aread_all(self, key: str, path: str, bucket: str, obj: str) -> torch.Tensor:
        """The object in ``part_size`` ranges, ``max_concurrency`` at a time, into one tensor.

        The first range's answer tells the size (and is the whole blob when it fits: one atomic GET); the
        other ranges start as soon as its headers arrive, ``If-Match`` its ETag.
        """
        part = self.options.part_size

        def first() -> Awaitable[dict[str, Any]]:
            return self.fs._call_s3("get_object", Bucket=bucket, Key=obj, Range=f"bytes=0-{part - 1}")

        try:
            resp = await self._arequest("read", key, path, first, missing_ok=True)
        except TierError as exc:
            if s3_error_code(exc) == "InvalidRange":  # S3's answer to any range of an empty object
                return torch.empty(0, dtype=torch.uint8)
            raise
        body = resp["Body"]
        try:
            size = _object_size(resp)
            out = torch.empty(size, dtype=torch.uint8)
            if size == 0:
                return out
            view = memoryview(out.numpy())
            head_n = min(part, size)
            if int(resp.get("ContentLength", head_n)) != head_n:
                raise _Replaced()
            etag = resp.get("ETag")
            gate = asyncio.Semaphore(self.options.max_concurrency)

            async def one(off: int, n: int) -> None:
                async with gate:
                    await self._arequest(f"read bytes {off}-{off + n - 1} of", key, path,
                                         lambda: self._get_into(bucket, obj, etag, off, view[off:off + n], True),
                                         nbytes=n, missing_ok=True)

            tasks = [asyncio.ensure_future(one(off, min(part, size - off))) for off in range(part, size, part)]
            try:
                async with gate:
                    try:
                        await asyncio.wait_for(self._read_body(body, view[:head_n], key), self._ceiling(head_n))
                    except (asyncio.CancelledError, _Replaced):
                        raise
                    except Exception:  # the first answer broke off: read that range again like the others
                        head_failed = True
                    else:
                        head_failed = False
                if head_failed:
                    await one(0, head_n)
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            return out
        finally:
            body.close()

    async def _read_body(self, body: Any, view: memoryview, key: str) -> None:
        n, got = len(view), 0
        while got < n:
            k = await body.readinto(view[got:got + _READ_PIECE])
            if not k:
                break
            got += k
        if got != n:
            raise TransientTierError(f"the answer ended after {got} of {n} bytes", tier=self.name, key=key)


__all__ = ["FsspecOptions", "FsspecTier", "REDACTED", "protocol_of", "redact", "redacted_options",
           "s3_error_code", "secret_values"]
