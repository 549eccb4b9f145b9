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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
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

log = logging.getLogger(__name__)

MiB = 1 << 20
# Stores where an upload becomes visible whole when it completes (and where a rename would be a copy).
OBJECT_STORES = frozenset({
    "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "oci", "oss", "cos",
    "obs", "tos", "r2", "b2", "swift",
})
S3_PROTOCOLS = frozenset({"s3", "s3a"})
S3_MIN_PART = 5 * MiB  # S3 rejects smaller parts (except the last one)
S3_MAX_PART = 5 << 30
S3_MAX_PARTS = 10_000
_READ_PIECE = 16 << 20  # bytes per readinto call
_READ_ATTEMPTS = 3  # reads of a blob that is being replaced
_ABORT_ROUNDS = 3  # aborts of a multipart upload while the store still lists it
_BACKOFF_BASE_S = 0.2  # first wait between two tries of one request; doubles, jittered, up to _BACKOFF_MAX_S
_BACKOFF_MAX_S = 2.0
_MIN_RATE = 1 * MiB  # bytes/s a request must at least achieve before its overall ceiling ends it
_CHECKSUM_FIELDS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")

# ----- redaction -------------------------------------------------------------------------------------------
REDACTED = "***"
# Option names (at any depth: options, client_kwargs, config_kwargs) whose values are credentials.
SECRET_OPTION_NAMES = frozenset({
    "key", "secret", "token", "password", "username", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "session_token", "access_key", "secret_key", "account_key", "sas_token",
    "connection_string", "client_secret", "credentials",
})
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_MIN_SECRET_LEN = 4  # shorter values would blank out ordinary words; real credentials are 16+ characters
_URL_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"]+@")
_QUERY_SECRET = re.compile(
    r"(?i)\b(X-Amz-Credential|X-Amz-Signature|X-Amz-Security-Token|AWSAccessKeyId|Signature|sig)=[^&\s'\"]+")
_AUTH_HEADER = re.compile(r"(?i)\b(authorization['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n]+")
_NAMED_SECRET = re.compile(
    r"(?i)(['\"]?\b(?:aws_access_key_id|aws_secret_access_key|aws_session_token|secret|password|token)"
    r"['\"]?\s*[:=]\s*['\"]?)[^'\"\s,;}&]+")


def secret_values(options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> set[str]:
    """Every credential in ``options`` (nested mappings included) and in the AWS environment variables."""
    found: set[str] = set()

    def walk(mapping: Mapping[str, Any]) -> None:
        for name, value in mapping.items():
            if isinstance(value, Mapping):
                walk(value)
            elif isinstance(value, str) and str(name).lower() in SECRET_OPTION_NAMES:
                found.add(value)

    walk(options or {})
    env = os.environ if env is None else env
    found.update(env[name] for name in SECRET_ENV_VARS if env.get(name))
    return {s for s in found if len(s) >= _MIN_SECRET_LEN}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without credentials: the given secret values, URL user info (``scheme://user:pw@``),
    signed-URL parameters, ``Authorization`` headers and ``secret=...``-style pairs become ``***``."""
    text = str(text)
    for value in sorted(set(secrets), key=len, reverse=True):
        if len(value) >= _MIN_SECRET_LEN:
            text = text.replace(value, REDACTED)
    text = _URL_USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _QUERY_SECRET.sub(rf"\1={REDACTED}", text)
    text = _AUTH_HEADER.sub(rf"\1{REDACTED}", text)
    return _NAMED_SECRET.sub(rf"\1{REDACTED}", text)


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of storage options with every credential value replaced by ``***`` (for display)."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = redacted_options(value)
        elif str(name).lower() in SECRET_OPTION_NAMES and value is not None:
            out[name] = REDACTED
        elif isinstance(value, str):
            out[name] = redact(value)
        else:
            out[name] = value
    return out


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


# ----- S3 error helpers --------------------------------------------------------------------------------------
_NETWORK_ERRORS: tuple[type[BaseException], ...] | None = None
_CREDENTIAL_ERRORS: tuple[type[BaseException], ...] = ()


def _library_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(network/timeouts, missing credentials) exception classes of the S3 stack, imported on first use."""
    global _NETWORK_ERRORS, _CREDENTIAL_ERRORS
    if _NETWORK_ERRORS is None:
        network: list[type[BaseException]] = [asyncio.TimeoutError]
        credentials: list[type[BaseException]] = []
        with contextlib.suppress(ImportError):
            from botocore import exceptions as bx
            from botocore.parsers import ResponseParserError  # truncated XML of a throttled answer

            network += [bx.HTTPClientError, bx.ConnectionError, ResponseParserError]
            credentials += [bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError]
        with contextlib.suppress(ImportError):
            import aiohttp

            network.append(aiohttp.ClientError)
        _NETWORK_ERRORS, _CREDENTIAL_ERRORS = tuple(network), tuple(credentials)
    return _NETWORK_ERRORS, _CREDENTIAL_ERRORS


def s3_error_code(exc: BaseException | None) -> str | None:
    """The S3 error code (``SlowDown``, ``NoSuchUpload``, ``PreconditionFailed``...) behind an exception."""
    for _ in range(6):
        if exc is None:
            return None
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
        exc = exc.__cause__ or exc.__context__
    return None


class _Replaced(Exception):
    """The object changed between two requests of one read (its ETag no longer matches)."""


class _ViewReader(io.RawIOBase):
    """A read-only, seekable file over a memoryview: botocore sends (and checksums) a slice of a buffer
    through it in small pieces, without a copy of the whole part."""

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


def _multipart_etag(parts: list[dict[str, Any]]) -> str | None:
    """The ETag S3 gives an object completed from ``parts`` (MD5 ETags only; None when they are not)."""
    digests = []
    for p in parts:
        tag = str(p.get("ETag", "")).strip('"')
        if not re.fullmatch(r"[0-9a-fA-F]{32}", tag):
            return None
        digests.append(bytes.fromhex(tag))
    return f'"{hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()}-{len(parts)}"'


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
            raise ConfigError(redact(f"cannot open {options.url}: {exc}", self._secrets),
                              key_path=f"tier {name!r}.url") from None
        self.root = root.rstrip("/")
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


def _object_size(resp: dict[str, Any]) -> int:
    """The whole object's size from a (ranged) GET answer: ``Content-Range: bytes 0-99/1234`` or its length."""
    content_range = resp.get("ContentRange")
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1].strip()
        if total.isdigit():
            return int(total)
    return int(resp["ContentLength"])


class _Upload:
    """One blob on S3: a single PUT if it fits in one part, else a parallel multipart upload (module doc)."""

    def __init__(self, tier: FsspecTier, key: str, path: str):
        self.tier = tier
        self.key = key
        self.path = path
        self.bucket, self.obj, _ = tier.fs.split_path(path)
        self.part_size = tier.options.part_size
        self.window = tier.options.max_concurrency
        self.upload_id: str | None = None
        self.checksummed = False  # the upload was created with a checksum algorithm: complete with them
        self.next_part = 1
        self.inflight: dict[Future, tuple[int, bytearray | None]] = {}
        self.parts: dict[int, dict[str, Any]] = {}
        self.free: list[bytearray] = []  # part buffers ready for reuse
        self.allocated = 0
        self.buf: bytearray | None = None  # the part being gathered from small chunks
        self.fill = 0
        self.ready: bytearray | None = None  # a full part held back until we know more data follows
        self.total = 0
        self.stop = threading.Event()
        self.tasks: set[asyncio.Task] = set()

    # ----- producer side (the caller's thread) ------------------------------------------------------------
    def feed(self, mv: memoryview) -> None:
        n = len(mv)
        if not n:
            return
        self.total += n
        self._flush_ready()
        pos = self._gather(mv, 0) if self.buf is not None else 0
        borrowed = []
        whole = (n - pos) // self.part_size
        if whole >= self.window:  # a full window of parts straight from the caller's buffer
            self._flush_ready()
            for _ in range(whole):
                borrowed.append(self._submit(mv[pos:pos + self.part_size], None))
                pos += self.part_size
        while pos < n:
            self._flush_ready()
            pos = self._gather(mv, pos)
        for fut in borrowed:  # the producer may reuse this chunk once we ask for the next one
            while fut in self.inflight:
                self._reap(block=True)

    def finish(self) -> int:
        if self.upload_id is None:
            if self.ready is not None:
                data = memoryview(self.ready)
            else:
                data = memoryview(self.buf)[:self.fill] if self.buf is not None else memoryview(b"")
            self._put(data)
            return self.total
        self._flush_ready()
        if self.buf is not None and self.fill:
            buf, fill, self.buf, self.fill = self.buf, self.fill, None, 0
            self._submit(memoryview(buf)[:fill], buf)
        while self.inflight:
            self._reap(block=True)
        self._complete()
        self.upload_id = None  # completed: nothing left to abort
        return self.total

    def abort(self) -> None:
        """Cancel the parts in flight, then abort the multipart upload. Never raises (the caller's error
        is the one to report); an upload that cannot be aborted is logged with its id."""
        self.stop.set()
        if self.inflight:
            with contextlib.suppress(Exception):
                self.tier._sync(self._cancel_parts)
            self.inflight.clear()
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is None:
            return
        try:
            self._abort(upload_id)
        except Exception as exc:
            log.warning("tier %r: could not abort the multipart upload %s of %s (its parts stay invisible but "
                        "billed until a lifecycle rule with AbortIncompleteMultipartUpload removes them): %s",
                        self.tier.name, upload_id, self.tier._redact(self.path), self.tier._redact(str(exc)))

    def _gather(self, mv: memoryview, pos: int) -> int:
        """Copy from ``mv[pos:]`` into the part being gathered; return the new position."""
        if self.buf is None:
            self.buf, self.fill = self._take_buffer(), 0
        take = min(self.part_size - self.fill, len(mv) - pos)
        self.buf[self.fill:self.fill + take] = mv[pos:pos + take]
        self.fill += take
        if self.fill == self.part_size:
            self.ready, self.buf, self.fill = self.buf, None, 0
        return pos + take

    def _flush_ready(self) -> None:
        if self.ready is not None:
            buf, self.ready = self.ready, None
            self._submit(memoryview(buf), buf)

    def _take_buffer(self) -> bytearray:
        while True:
            if self.free:
                return self.free.pop()
            if self.allocated <= self.window:  # window parts in flight + the one being gathered
                self.allocated += 1
                return bytearray(self.part_size)  # calloc: pages are touched only when written
            self._reap(block=True)

    def _submit(self, view: memoryview, owner: bytearray | None) -> Future:
        if self.upload_id is None:
            self._create()
        if self.next_part > S3_MAX_PARTS:
            raise PermanentTierError(f"more than {S3_MAX_PARTS} parts of {self.part_size} bytes: raise part_size",
                                     tier=self.tier.name, key=self.key)
        while len(self.inflight) >= self.window:
            self._reap(block=True)
        number = self.next_part
        self.next_part += 1
        fut = asyncio.run_coroutine_threadsafe(self._send_part(number, view), self.tier.fs.loop)
        self.inflight[fut] = (number, owner)
        return fut

    def _reap(self, block: bool) -> None:
        """Collect finished parts (waiting for one if ``block``); raise the first part's error."""
        done, _ = wait_futures(list(self.inflight), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in done:
            number, owner = self.inflight.pop(fut)
            if owner is not None:
                self.free.append(owner)
            self.parts[number] = fut.result()

    # ----- requests ----------------------------------------------------------------------------------------
    def _create(self) -> None:
        tries = [0]

        async def create() -> dict[str, Any]:
            tries[0] += 1
            return await self.tier.fs._call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.obj)

        resp = self.tier._sync(self.tier._arequest, "start the multipart upload of", self.key, self.path, create)
        self.upload_id = resp["UploadId"]
        self.checksummed = bool(resp.get("ChecksumAlgorithm"))
        if tries[0] > 1:  # an earlier try may have created an upload whose answer was lost
            with contextlib.suppress(Exception):
                self.tier._sync(self._abort_strays)

    async def _abort_strays(self) -> None:
        resp = await self.tier.fs._call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=self.obj)
        for up in resp.get("Uploads", []):
            if up.get("Key") == self.obj and up.get("UploadId") != self.upload_id:
                with contextlib.suppress(Exception):
                    await self.tier.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.obj,
                                                UploadId=up["UploadId"])

    async def _send_part(self, number: int, view: memoryview) -> dict[str, Any]:
        self.tasks.add(asyncio.current_task())  # first, before any await: _cancel_parts finds every part
        upload_id = self.upload_id

        def call() -> Awaitable[dict[str, Any]]:
            return self.tier.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.obj, UploadId=upload_id,
                                         PartNumber=number, Body=_ViewReader(view))

        resp = await self.tier._arequest(f"upload part {number} of", self.key, self.path, call, nbytes=len(view),
                                         stop=self.stop)
        entry = {"PartNumber": number, "ETag": resp["ETag"]}
        if self.checksummed:
            entry.update({k: resp[k] for k in _CHECKSUM_FIELDS if resp.get(k)})
        return entry

    async def _cancel_parts(self) -> None:
        tasks = [t for t in self.tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _put(self, data: memoryview) -> None:
        def call() -> Awaitable[Any]:
            return self.tier.fs._call_s3("put_object", Bucket=self.bucket, Key=self.obj, Body=_ViewReader(data))

        self.tier._sync(self.tier._arequest, "upload", self.key, self.path, call, nbytes=len(data))

    def _complete(self) -> None:
        parts = [self.parts[n] for n in sorted(self.parts)]
        upload_id = self.upload_id
        tries = [0]

        async def complete() -> Any:
            tries[0] += 1
            try:
                return await self.tier.fs._call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.obj,
                                                   UploadId=upload_id, MultipartUpload={"Parts": parts})
            except FileNotFoundError:
                # NoSuchUpload on a second try: the first one completed but its answer was lost?
                if tries[0] > 1 and await self._completed_as(parts):
                    return None
                raise

        self.tier._sync(self.tier._arequest, "complete the multipart upload of", self.key, self.path, complete)

    async def _completed_as(self, parts: list[dict[str, Any]]) -> bool:
        expected = _multipart_etag(parts)
        if expected is None:
            return False
        try:
            head = await self.tier.fs._call_s3("head_object", Bucket=self.bucket, Key=self.obj)
        except FileNotFoundError:
            return False
        return head.get("ETag") == expected

    def _abort(self, upload_id: str) -> None:
        """Abort the upload until the store no longer knows it. A part that was in flight when it was cancelled
        may still be landing on the server: S3 then keeps (or re-creates) the upload's storage, so it is aborted
        again after a pause, up to ``_ABORT_ROUNDS`` times. Cleanup gets a few tries even if
        ``request_attempts`` is 1."""
        tier = self.tier
        attempts = max(3, tier.options.request_attempts)
        kw = {"Bucket": self.bucket, "Key": self.obj, "UploadId": upload_id}

        async def abort_until_gone() -> None:
            for round_ in range(1, _ABORT_ROUNDS + 1):
                try:
                    await tier._arequest("abort the multipart upload of", self.key, self.path,
                                         lambda: tier.fs._call_s3("abort_multipart_upload", **kw),
                                         missing_ok=True, attempts=attempts)
                except BlobNotFoundError:  # NoSuchUpload: gone (an earlier abort whose answer was lost)
                    return
                try:
                    await tier._arequest("check the abort of", self.key, self.path,
                                         lambda: tier.fs._call_s3("list_parts", **kw), missing_ok=True,
                                         attempts=attempts)
                except BlobNotFoundError:
                    return
                if round_ < _ABORT_ROUNDS:
                    await asyncio.sleep(tier._backoff(round_))
            raise TransientTierError(f"the multipart upload {upload_id} is still there after {_ABORT_ROUNDS} aborts",
                                     tier=tier.name, key=self.key)

        tier._sync(abort_until_gone)


__all__ = ["FsspecOptions", "FsspecTier", "REDACTED", "protocol_of", "redact", "redacted_options",
           "s3_error_code", "secret_values"]

