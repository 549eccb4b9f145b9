"""``fsspec``: blobs on anything fsspec can write (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``).

Keys map to ``{root}/{key}`` under the URL's path. How a blob becomes visible in one step depends on the
store:

* **S3** (``s3://``, ``s3a://``, through s3fs): the kind builds an :class:`~tiered_ckpt.tiers.s3.S3Tier`, which
  drives the transfers itself with s3fs's client (parallel multipart uploads, ranged reads, per-request tries);
  see :mod:`tiered_ckpt.tiers.s3`.
* **Other object stores** (gcs, azure, memory, ...): an object appears only when its upload completes, so the
  blob is uploaded to its final name directly. The file is opened with ``autocommit=False`` and committed
  after the last chunk; if the producer fails midway the upload is discarded, and the old object, if any,
  stays. ``capabilities.atomic_rename`` is False.
* **A local path** (``file://``, or a plain path): the files are written, read and listed like the ``local``
  kind's (:class:`~._files.BlobFiles`, without fsync): a temporary name renamed over the key, and no link
  followed nor special file opened below the root (see :mod:`._nofollow`).
* **Other file systems** with a rename (sftp, hdfs, ...): write a temporary name in the same directory, then
  ``mv`` it over the key. ``capabilities.atomic_rename`` is True.

Credentials in ``options`` never appear in ``describe()``, ``repr``, log lines or error messages: see
:func:`redact`.

The tier never fsyncs: fsspec streams have no portable fsync, and durability on a shared file system is that
file system's business (use the ``local`` kind for a node-local disk). Missing keys raise
:class:`~tiered_ckpt.errors.BlobNotFoundError`; timeouts and connection errors
:class:`~tiered_ckpt.errors.TransientTierError`; full disks and permission errors
:class:`~tiered_ckpt.errors.PermanentTierError` (the errno table of :mod:`tiered_ckpt.retry`); other errors of the
storage library propagate for the retry policy to classify. A temporary file that vanished before its rename
(a concurrent ``gc --delete``) fails that write attempt as transient: the engine writes it again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from ..crashpoints import crash_point
from ..errors import (
    BlobNotFoundError,
    ConfigError,
    CorruptionError,
    PermanentTierError,
    TierError,
    TransientTierError,
)
from ..retry import repeat_on
from ..validate import PositiveInt, Seconds, Size
from ._files import BlobFiles, is_temp_name, temp_name, tier_error, vanished_temp
from ._nofollow import check_size
from ._redact import REDACTED, redact, redacted_options, secret_values
from ._s3 import READ_ATTEMPTS, READ_PIECE, S3_MAX_PART, S3_MIN_PART, S3_PROTOCOLS, MiB, s3_error_code
from .base import (
    Capabilities,
    Chunk,
    Tier,
    TierContext,
    as_memoryview,
    bytes_to_tensor,
    check_key,
    check_prefix,
    check_range,
    exception_text,
    file_in_path,
    first_missing_dir,
    not_a_directory,
)
from .local import said_if_parents_made

log = logging.getLogger(__name__)

# Stores where an upload becomes visible whole when it completes (and where a rename would be a copy).
OBJECT_STORES = frozenset({
    "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "wasb", "wasbs", "oci", "oss", "cos",
    "obs", "tos", "r2", "b2", "swift",
})


# ----- options ---------------------------------------------------------------------------------------------
S3_ONLY_KEYS = frozenset({"part_size", "max_concurrency", "timeout_s", "request_attempts"})  # the S3 tier's alone


@dataclass(frozen=True, repr=False)
class FsspecOptions:
    url: str  # e.g. s3://bucket/run, file:///shared/ckpt, memory://test
    options: dict[str, Any] = field(default_factory=dict)  # storage options for fsspec.url_to_fs
    block_size: Size | None = None  # buffered write/read block of non-S3 stores (None: the backend's default)
    part_size: Size = 64 * MiB  # S3: multipart part size, and the size of each ranged GET on reads
    max_concurrency: PositiveInt = 8  # S3: parts uploaded / ranges read in parallel per blob
    timeout_s: Seconds | None = None  # S3: connect and read timeout of each request (None: s3fs's 5 s / 15 s)
    request_attempts: PositiveInt = 3  # S3: tries of one request before the failure goes to the retry policy
    split_blobs: bool = False  # S3: store tiered_ckpt's own files as part-sized objects, not multipart (s3.py)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: expected an fsspec URL such as s3://bucket/path, got an empty string")
        typo = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)(:/(?!/)|//)", self.url)
        if typo and "://" not in self.url and typo.group(1).lower() in fsspec.available_protocols():
            # else fsspec takes it for a relative local path, and writes there
            raise ValueError(f"url: {redact(self.url)!r} looks like a mistyped URL (a scheme needs \"://\": "
                             f"{typo.group(1)}://...); a directory on this machine is kind: local, or file:///path")
        scheme = protocol_of(self.url)
        if scheme != scheme.lower():  # fsspec knows its protocols in lower case only
            raise ValueError(f"url: write the scheme in lower case ({scheme.lower()}://, not {scheme}://)")
        if is_s3_url(self.url) and not S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"part_size: expected 5MiB to 5GiB (S3's limits for a multipart part), got "
                             f"{self.part_size} bytes")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive duration, got {self.timeout_s}")
        if is_s3_url(self.url):
            _check_endpoint(self.options)
        if self.split_blobs and not is_s3_url(self.url):
            raise ValueError(f"split_blobs: only plain S3 URLs (s3://, s3a://, not chained) store blobs split, not "
                             f"{redact(self.url)}: remove split_blobs")
        # A key that would be ignored is refused: a user who tunes it would otherwise believe it works.
        if is_s3_url(self.url):
            if self.block_size is not None:
                raise ValueError(f"block_size: S3 tiers read and write in part_size pieces, {redact(self.url)} "
                                 "ignores block_size: remove it (or set part_size)")
        else:
            for f in fields(self):
                if f.name in S3_ONLY_KEYS and getattr(self, f.name) != f.default:
                    raise ValueError(f"{f.name}: only plain S3 URLs (s3://, s3a://, not chained) use it, not "
                                     f"{redact(self.url)}: remove {f.name}")

    def __repr__(self) -> str:
        return (f"FsspecOptions(url={redact(self.url)!r}, options={redacted_options(self.options)!r}, "
                f"block_size={self.block_size!r}, part_size={self.part_size!r}, "
                f"max_concurrency={self.max_concurrency!r}, timeout_s={self.timeout_s!r}, "
                f"request_attempts={self.request_attempts!r}, split_blobs={self.split_blobs!r})")


def _check_endpoint(options: dict[str, Any]) -> None:
    """An S3 endpoint without its scheme (``127.0.0.1:9000``) passed the configuration and failed every save with
    botocore's "Invalid endpoint" (an S3 user's trial): refused with the fix, as a mistyped key is."""
    client = options.get("client_kwargs")
    for where, value in (("options.endpoint_url", options.get("endpoint_url")),
                         ("options.client_kwargs.endpoint_url",
                          client.get("endpoint_url") if isinstance(client, dict) else None)):
        if value is None or value == "":  # "": the default endpoint (``${S3_ENDPOINT:-}`` unset)
            continue
        parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{where}: {value!r} is not an endpoint URL: write it with its scheme, "
                             f"http://{value if isinstance(value, str) else 'host:port'} (or https://...)")


def protocol_of(url: str) -> str:
    """The protocol that stores the data (the innermost of a chained URL); ``file`` for plain paths."""
    protocol, _ = fsspec.core.split_protocol(url.split("::")[-1])
    return protocol or "file"


def is_s3_url(url: str) -> bool:
    """An S3 URL the :class:`~tiered_ckpt.tiers.s3.S3Tier` serves (a chained URL goes through fsspec as is)."""
    return "::" not in url and protocol_of(url) in S3_PROTOCOLS


# ----- the tier --------------------------------------------------------------------------------------------
BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs")


def missing_bucket(fs: Any, root: str) -> str | None:
    """``"no such bucket 'b'"`` when ``root`` is on an object store whose bucket does not exist; None when it does,
    or the file system has no buckets. Raises what the store raises when it cannot be asked."""
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if protocol not in BUCKET_PROTOCOLS:
        return None
    bucket = root.split("/", 1)[0]
    try:
        if protocol in ("s3", "s3a") and hasattr(fs, "call_s3"):
            fs.call_s3("head_bucket", Bucket=bucket)  # older s3fs's info() of an empty bucket says "not found"
        else:
            fs.info(bucket)
    except FileNotFoundError:
        return f"no such bucket {bucket!r}"
    return None


class FsspecTier(Tier):
    """The ``fsspec`` kind. Built for an S3 URL it is an :class:`~tiered_ckpt.tiers.s3.S3Tier` (a subclass), so
    ``kind: fsspec`` with ``url: s3://...`` and ``FsspecTier(name, FsspecOptions(url="s3://..."))`` both get
    the S3 transfers."""

    kind = "fsspec"
    capabilities = Capabilities(memory=False, node_local=False, survives_process=True,
                                atomic_rename=False, zero_copy_read=False)
    Options = FsspecOptions

    #: Plain (unchained) URL protocols a subclass serves instead of this class: a subclass that names them here
    #: is picked for them by ``FsspecTier(...)`` itself (``tiers/__init__.py`` imports the built-in one, S3).
    url_protocols: tuple[str, ...] = ()
    _by_protocol: dict[str, type[FsspecTier]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for protocol in cls.url_protocols:
            FsspecTier._by_protocol[protocol] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> FsspecTier:
        options = args[1] if len(args) > 1 else kwargs.get("options")
        if cls is FsspecTier and isinstance(options, FsspecOptions) and "::" not in options.url:
            cls = FsspecTier._by_protocol.get(protocol_of(options.url), cls)
        return super().__new__(cls)

    @classmethod
    def capabilities_for(cls, options: FsspecOptions) -> Capabilities:
        protocol = protocol_of(options.url)
        if protocol == "memory":  # one process's dict: a test double, volatile and private
            return Capabilities(node_local=True, survives_process=False,
                                atomic_rename=False)
        return Capabilities(node_local=False, survives_process=True,
                            atomic_rename=protocol not in OBJECT_STORES)

    def __init__(self, name: str, options: FsspecOptions, context: TierContext | None = None):
        super().__init__(name, options, context)
        self._secrets = secret_values(options.options)
        self._storage = self._storage_options()
        try:
            self.fs, root = fsspec.core.url_to_fs(options.url, **self._storage)
        except (ImportError, ValueError, TypeError) as exc:
            hint = self._install_hint if isinstance(exc, ImportError) else ""
            raise ConfigError(redact(f"cannot open {options.url}: {exc}{hint}", self._secrets),
                              key_path=f"tier {name!r}.url") from None
        self.root = root.rstrip("/")
        protocol = protocol_of(options.url)
        if protocol in OBJECT_STORES - {"memory"} and options.url.split("::")[-1].partition("://")[2].startswith("/"):
            # s3:///prefix: s3fs would take "prefix" for the bucket, and the first save would fail on it
            raise ConfigError(f"{redact(options.url, self._secrets)} names no bucket (the first part after "
                              f"{protocol}:// is the bucket): write {protocol}://BUCKET/prefix",
                              key_path=f"tier {name!r}.url")
        if not self.root.strip("/"):
            raise ConfigError(f"{redact(options.url, self._secrets)} names no directory or bucket; add a path",
                              key_path=f"tier {name!r}.url")
        self.capabilities = self.capabilities_for(options)
        self._rename = self.capabilities.atomic_rename
        self._open_kw = {"block_size": options.block_size} if options.block_size else {}
        # A local path: the file tiers' own code (no links followed, no FIFO opened, vanished temp files).
        self.files: BlobFiles | None = None
        blocker = file_in_path(self.root) if isinstance(self.fs, LocalFileSystem) else None
        if blocker is not None:
            raise ConfigError(f"{not_a_directory(self.root, blocker)}: give the tier the directory that holds (or "
                              "will hold) its checkpoints", key_path=f"tier {name!r}.url")
        if isinstance(self.fs, LocalFileSystem):
            self.files = BlobFiles(name, self.root, file_mode=0o666, dir_mode=0o777, fsync=False,
                                   temp_written_point="fsspec.temp_written")  # modes: less the umask, as fsspec

    _install_hint = ""  # appended to "cannot open URL: <ImportError>"
    _permission_hint = ""  # appended to "permission denied: <the store's message>"

    def _storage_options(self) -> dict[str, Any]:
        """The keyword arguments for ``fsspec.url_to_fs`` (subclasses add their store's settings)."""
        return dict(self.options.options)

    # ----- helpers -----------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets)

    def _error_code(self, exc: BaseException) -> str | None:
        """The store's own code for an error (S3: ``SlowDown``...), shown beside the errno's message."""
        return None

    def _tier_exception(self, exc: BaseException, key: str | None, op: str, path: str,
                        missing_ok: bool = False) -> BaseException | None:
        """The tier error for a storage error of ``op`` (raise it ``from exc``); None: let ``exc`` propagate."""
        if isinstance(exc, (TierError, CorruptionError)) or not isinstance(exc, Exception):
            return None
        where = self._redact(f"{op} {path}")

        def text(detail: Any) -> str:
            return f"{where}: {self._redact(str(detail))}"

        if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            if missing_ok:
                return BlobNotFoundError("no such blob", tier=self.name, key=key)
            return PermanentTierError(text(exc), tier=self.name, key=key)
        if isinstance(exc, (TimeoutError, ConnectionError)):
            return TransientTierError(text(exception_text(exc)), tier=self.name, key=key)
        if isinstance(exc, PermissionError):
            detail = str(exc).rstrip(".")
            return PermanentTierError(text(f"permission denied: {detail}") + self._permission_hint, tier=self.name,
                                      key=key)
        if isinstance(exc, OSError) and exc.errno is not None:
            code = self._error_code(exc)
            detail = exc.strerror or str(exc)
            clean = OSError(exc.errno, self._redact(f"{code}: {detail}" if code and code not in detail else detail))
            return tier_error(clean, tier=self.name, key=key, op=op, path=self._redact(path))
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

    def _request(self, op: str, key: str | None, path: str, fn: Any, missing_ok: bool = False) -> Any:
        """``fn()`` with storage errors mapped (one try here: the engine's retry policy tries again; the S3
        tier tries each request ``request_attempts`` times first)."""
        with self._errors(key, op, path, missing_ok):
            return fn()

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
        if self.files is not None:
            top = first_missing_dir(self.root)
            with self._errors(key, "create", self.root):  # made on the first write: reading never creates it
                os.makedirs(self.root, exist_ok=True)
            said_if_parents_made(self.name, self.root, top)
            return self.files.write(check_key(key), chunks)
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
            crash_point("fsspec.temp_written")
            try:
                self.fs.mv(tmp, path)
            except FileNotFoundError as exc:
                raise vanished_temp(self._redact(tmp), self._redact(path), tier=self.name, key=key) from exc
            except Exception as exc:
                err = self._tier_exception(exc, key, "rename into", path)
                if err is None:
                    raise
                raise err from exc
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
        return self.read_blob_hashed(key)

    def read_blob_hashed(self, key: str, hasher: Any = None, max_size: int | None = None) -> torch.Tensor:
        if self.files is not None:
            return self.files.read_into_tensor(key, hasher, max_size)
        path = self._path(key)
        with self._errors(key, "read", path, missing_ok=True):
            if isinstance(self.fs, MemoryFileSystem):  # its open() shares one file position between readers
                size = self._info_size(self.fs.info(path), key, path)
                check_size(size, max_size, self._redact(path), tier=self.name, key=key)
                out = bytes_to_tensor(self.fs.cat_file(path))
            else:
                out = self._read_replaced_again(key, path, max_size)
        if hasher is not None:
            hasher.update(as_memoryview(out))
        return out

    def _read_replaced_again(self, key: str, path: str, max_size: int | None) -> torch.Tensor:
        """Open and read the whole file; a file replaced while being read is read again (READ_ATTEMPTS)."""
        class Replaced(Exception):
            pass

        def once() -> torch.Tensor:
            try:
                with self.fs.open(path, "rb", **self._open_kw) as f:
                    out = self._read_all(f, key, path, max_size)
            except Exception as exc:
                if type(exc).__name__ == "FileExpired":  # replaced between open and a range GET
                    raise Replaced() from exc
                raise
            if out is None:
                raise Replaced()
            return out

        try:
            return repeat_on(Replaced, READ_ATTEMPTS)(once)
        except Replaced:
            raise TransientTierError(f"the blob was replaced while being read, {READ_ATTEMPTS} times in a row",
                                     tier=self.name, key=key) from None

    def _read_all(self, f: Any, key: str, path: str, max_size: int | None) -> torch.Tensor | None:
        """An open file, read to its end into one tensor with ``readinto`` (no intermediate ``bytes``);
        None if it turned out shorter or longer than announced (replaced while being read)."""
        size = getattr(f, "size", None)  # buffered (remote) files know it from the open
        if not isinstance(size, int):
            try:
                size = os.fstat(f.fileno()).st_size
            except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
                # a stream that does not say its size: at most max_size + 1 bytes of it
                data = f.read() if max_size is None else f.read(max_size + 1)
                check_size(len(data), max_size, self._redact(path), tier=self.name, key=key)
                return bytes_to_tensor(data)
        check_size(size, max_size, self._redact(path), tier=self.name, key=key)
        out = torch.empty(size, dtype=torch.uint8)
        mv = memoryview(out.numpy()) if size else memoryview(bytearray())
        pos = 0
        while pos < size:
            n = f.readinto(mv[pos:pos + READ_PIECE])
            if not n:
                break
            pos += n
        if pos != size or f.read(1):
            return None
        return out

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if self.files is not None:
            return self.files.read_range(key, offset, length)
        check_range(offset, length, self.size(key), tier=self.name, key=key)
        if length == 0:
            return b""
        path = self._path(key)
        with self._errors(key, "read", path, missing_ok=True):
            return bytes(self.fs.cat_file(path, start=offset, end=offset + length))

    def size(self, key: str) -> int:
        if self.files is not None:
            return self.files.size(key)
        path = self._path(key)
        with self._errors(key, "stat", path, missing_ok=True):
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise BlobNotFoundError("no such blob (a directory)", tier=self.name, key=key)
        return self._info_size(info, key, path)

    def _info_size(self, info: dict[str, Any], key: str, path: str) -> int:
        """The size in a store's ``info`` answer; one that is not a byte count is a corruption (a load falls
        back to the next tier), never a ``ValueError``."""
        value = info.get("size")
        try:
            size = int(value)
        except (TypeError, ValueError):
            size = -1
        if size < 0 or isinstance(value, bool):
            raise CorruptionError(f"{self._redact(path)}: the store gives no byte count for it (size {value!r})",
                                  tier=self.name, key=key)
        return size

    def exists(self, key: str) -> bool:
        if self.files is not None:
            return self.files.exists(key)
        path = self._path(key)
        with self._errors(key, "stat", path):
            return bool(self.fs.isfile(path))

    def list(self, prefix: str = "") -> list[str]:
        if self.files is not None:
            return self.files.list(prefix)
        return [k for k in self._keys(prefix) if self._listed(k)]

    def _listed(self, key: str) -> bool:
        """Whether ``list()`` shows ``key`` (the S3 tier hides the pieces of split blobs)."""
        return True

    def _keys(self, prefix: str) -> list[str]:
        """Every object under ``prefix`` but temporary files, hidden ones included (``delete_prefix`` removes
        them too)."""
        check_prefix(prefix)
        rel_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = f"{self.root}/{rel_dir}" if rel_dir else self.root
        start = len(self.root) + 1
        keys = []
        for p in self._paths(top):
            if p.startswith(self.root + "/"):
                key = p[start:]
                if key.startswith(prefix) and not is_temp_name(key):
                    keys.append(key)
        return sorted(keys)

    def stored_bytes(self, prefix: str) -> int:
        if self.files is not None:
            return super().stored_bytes(prefix)
        top = f"{self.root}/{check_prefix(prefix.rstrip('/') + '/').rstrip('/')}"
        inside = self.fs._strip_protocol(top) + "/"  # not an object named like the prefix itself
        return sum(size for path, size in self._sizes(top).items()
                   if path.startswith(inside) and not is_temp_name(path))

    # The store's listings and deletes, each a hook: the S3 tier sends them as its own requests, each under a
    # ceiling (a server trickling an answer cannot hold one for ever), where fsspec's calls have only timeouts.
    def _paths(self, top: str) -> list[str]:
        """The path of every object under ``top``, the protocol stripped (none when nothing is there)."""
        return [self.fs._strip_protocol(p) for p in self._request("list", None, top, lambda: self._find(top))]

    def _sizes(self, top: str) -> dict[str, int]:
        """The size of every object under ``top``, by path (the protocol stripped): one listing, hidden objects
        included, not a HEAD per key."""
        def find() -> dict[str, Any]:
            self.fs.invalidate_cache(top)
            try:
                return self.fs.find(top, detail=True)
            except FileNotFoundError:
                return {}

        return {self.fs._strip_protocol(path): int(info.get("size") or 0)
                for path, info in self._request("list", None, top, find).items()}

    def _remove_object(self, key: str, path: str) -> None:
        """Delete the object at ``path`` (``key`` names it in errors); one already gone is not an error."""
        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except (FileNotFoundError, IsADirectoryError):
                pass

        self._request("delete", key, path, rm)

    def _remove_objects(self, keys: list[str], where: str) -> None:
        """Delete the objects of ``keys`` (``where`` names them in errors); those already gone are not errors."""
        def rm() -> None:
            try:
                self.fs.rm([f"{self.root}/{k}" for k in keys])  # one bulk request on object stores
            except FileNotFoundError:  # a concurrent delete; remove what is left one by one
                for k in keys:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(f"{self.root}/{k}")

        self._request("delete", None, where, rm)

    def _find(self, top: str) -> list[str]:
        self.fs.invalidate_cache(top)
        try:
            return self.fs.find(top, detail=False)
        except FileNotFoundError:
            # Nothing under the prefix yet, or no bucket at all (s3fs says the same for both): a bucket that is
            # not there is a tier that cannot be used, never "no checkpoint" (a resume would start afresh)
            why = missing_bucket(self.fs, self.root)
            if why is not None:
                raise PermanentTierError(f"{why} ({self.location}): create it, or correct the tier's url",
                                         tier=self.name) from None
            return []

    def delete(self, key: str) -> None:
        if self.files is not None:
            return self.files.delete(key)
        self._remove_object(key, self._path(key))

    def delete_prefix(self, prefix: str) -> None:
        if self.files is not None:
            return self.files.delete_prefix(prefix)
        prefix = check_prefix(prefix.rstrip("/") + "/")
        keys = self._keys(prefix)
        if keys:
            self._remove_objects(keys, f"{self.root}/{prefix}")

    def temp_files(self) -> list[str]:
        """Keys of temporary files that unfinished writes left (a crash before the rename), for ``gc``."""
        if self.files is not None:
            return self.files.temp_files()
        if not self._rename:
            return []  # object stores upload in place: nothing temporary is ever visible
        return sorted(p[len(self.root) + 1:] for p in self._paths(self.root)
                      if p.startswith(self.root + "/") and is_temp_name(p))

    def remove_temp_file(self, key: str) -> None:
        if self.files is not None:
            return self.files.remove_temp_file(key)
        if not is_temp_name(key):
            raise ValueError(f"{key!r} is not a temporary file")
        self._remove_object(key, self._path(key))

    @property
    def location(self) -> str | None:
        return self._redact(self.options.url)

    def modified(self, key: str) -> float | None:
        """When the blob or temporary file ``key`` last changed; None when it is gone or the store cannot tell."""
        if self.files is not None:
            return self.files.modified(key)
        try:
            return float(self.fs.modified(self._path(key)).timestamp())
        except Exception:  # noqa: BLE001 - gone, not supported by the store, no answer: the age is unknown
            return None

    def describe(self) -> str:
        return self._redact(f"fsspec {self.options.url}")


__all__ = ["FsspecOptions", "FsspecTier", "REDACTED", "is_s3_url", "protocol_of", "redact", "redacted_options",
           "s3_error_code", "secret_values"]
