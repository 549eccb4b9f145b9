"""S3 (``s3://``, ``s3a://`` through s3fs): the class the ``fsspec`` kind builds for an S3 URL.

Configured as ``kind: fsspec`` with an S3 ``url`` (the options are :class:`~.fsspec_tier.FsspecOptions`);
``FsspecTier(name, FsspecOptions(url="s3://..."))`` builds one too. The tier drives the transfers itself with
s3fs's client:

A blob that fits in one ``part_size`` is one ``PutObject``. A larger one is a multipart upload: parts of
``part_size`` bytes are uploaded in parallel, at most ``max_concurrency`` at a time, and the upload is
completed only after every part landed; on any failure (a part that keeps failing, the producer raising) the
parts in flight are cancelled and the upload is aborted, so nothing is ever visible under the key and no
parts are left behind. Memory stays bounded: stable chunks (:func:`~.base.chunks_stable`: the engine's own
files, views of a pinned slot) are sent as views, parts spanning chunks as several views; otherwise a chunk that
holds at least ``max_concurrency`` whole parts is uploaded straight from the caller's buffer (zero-copy slices;
the tier waits for them before asking for the next chunk, since a producer may reuse its buffer), and smaller
chunks are gathered into at most ``max_concurrency + 1`` reusable part buffers (:class:`~._s3.Upload`). Bodies go
to aiohttp as memory, not as files (:class:`~._s3.RequestBody`). ``read_blob`` of an object larger than
one part issues ``max_concurrency`` parallel ranged GETs (``If-Match`` the ETag, so a blob replaced mid-read is
read again) straight into one preallocated tensor; a read given the manifest's size (``max_size``) refuses a
larger object from the first answer's ``Content-Range``, before allocating for it.

Every HTTP request is tried up to ``request_attempts`` times (:func:`tiered_ckpt.retry.request_retrying`: short
exponential backoff with jitter, logged), so one throttled part does not restart a 10 GiB upload; what still
fails is raised as a :class:`~tiered_ckpt.errors.TransientTierError` or
:class:`~tiered_ckpt.errors.PermanentTierError` for the engine's per-tier ``retry`` policy (backoff, deadline,
``retry`` events). botocore's and s3fs's own retries are turned off on the tier's client so that these two
layers are the only ones and stay bounded. ``timeout_s`` sets botocore's connect and read timeouts; each request
also has an overall ceiling (the timeouts plus its size at 1 MiB/s), so an upload whose server stopped reading
fails instead of hanging. ``CompleteMultipartUpload`` alone goes through a client without a read timeout
(:meth:`S3Tier.patient_fs`), under a ceiling counted with the object's size: a server may assemble a large object
for longer than the read timeout before it answers, and a timed-out completion would be sent again while the
first is still at work.

Endpoint and credentials come from ``options`` (``endpoint_url``, ``key``, ``secret``, ``token``,
``client_kwargs``, ``config_kwargs``...) or the usual environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), which
botocore reads. They never appear in ``describe()``, ``repr``, log lines or error messages. Errors of the S3
stack that are neither a network error nor an ``OSError`` are raised as a
:class:`~tiered_ckpt.errors.TierError` with a redacted message, chained to the original, for the retry policy to
classify.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import fsspec
import torch

from ..errors import BlobNotFoundError, ConfigError, CorruptionError, PermanentTierError, TierError, TransientTierError
from ..hostmem import populating_empty
from ..retry import repeat_on, request_retrying
from ..validate import suggest
from ._files import is_temp_name
from ._nofollow import check_size
from ._s3 import (
    MIN_RATE,
    READ_ATTEMPTS,
    READ_PIECE,
    S3_PROTOCOLS,
    Replaced,
    Upload,
    cancel_all,
    content_length,
    gather_or_cancel,
    library_errors,
    object_size,
    s3_error_code,
    s3_http_status,
)
from ._s3_parts import SharedParts, is_upload_token
from ._s3_split import PieceMissing, Split, SplitUpload, drop_pieces, is_piece_name, piece_name
from .base import (
    Chunk,
    TierContext,
    UnfinishedUpload,
    as_memoryview,
    check_key,
    check_prefix,
    check_range,
    chunks_stable,
    exception_text,
)
from .fsspec_tier import FsspecOptions, FsspecTier

log = logging.getLogger(__name__)

PATIENT_READ_TIMEOUT = 24 * 3600.0  # botocore's read timeout on patient_fs: the request's own ceiling ends it first


def _aiohttp_content(body: Any) -> Any:
    """The aiohttp stream under an aiobotocore body, or None (another HTTP backend, such as httpx)."""
    try:
        import aiohttp
    except ImportError:
        return None
    raw = getattr(body, "raw_stream", None)
    return raw.content if isinstance(raw, aiohttp.ClientResponse) else None


def _check_option_names(options: dict[str, Any]) -> None:
    """s3fs hands every option it does not know to aiobotocore's session, which refuses it at the first request,
    in the drain: a misspelt option is a ConfigError at the tier's ``options`` here instead."""
    import inspect

    import s3fs
    from aiobotocore.session import AioSession

    known = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    for fn in (s3fs.S3FileSystem.__init__, AioSession.__init__):
        known |= {n for n, p in inspect.signature(fn).parameters.items()
                  if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise ConfigError(f"unknown s3fs option {unknown[0]!r}{suggest(unknown[0], known)} (the options are "
                          "s3fs.S3FileSystem's arguments, and aiobotocore's session's)", key_path="options")


#: HTTP answers worth another try when they carry no S3 error code (not 501 Not Implemented, 505, 507 full).
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class S3Tier(FsspecTier):
    """The ``fsspec`` kind on S3 (module docstring)."""

    url_protocols = tuple(sorted(S3_PROTOCOLS))  # FsspecTier(...) and kind fsspec pick this class for them
    _install_hint = " (pip install 'tiered-ckpt[s3]')"  # fsspec says "Install s3fs"; our extra pins a tested one

    def __init__(self, name: str, options: FsspecOptions, context: TierContext | None = None):
        super().__init__(name, options, context)  # first: a missing s3fs is named there, with our extra
        _check_option_names(options.options)
        self.fs.retries = 1  # our own instance (skip_instance_cache): the tier's tries are the only ones
        config = self._storage["config_kwargs"]
        connect = config.get("connect_timeout", getattr(self.fs, "connect_timeout", 5))
        read = config.get("read_timeout", getattr(self.fs, "read_timeout", 15))
        self._base_timeout: float | None = (connect or 0) + (read or 0) if connect and read else None
        self._patient: Any = None  # the client for slow answers (patient_fs)
        self._request_checksums: bool | None = None

    def patient_fs(self) -> Any:
        """A second s3fs instance, with the tier's settings but no read timeout, for requests whose answer may be
        long in coming: ``CompleteMultipartUpload`` of a large object, which a server may assemble for many
        seconds before it says anything (real S3 sends blanks meanwhile; moto and others send nothing, and the
        tier's read timeout would cut it and send the request again while the first one is still at work). Each
        such request is still bounded by its ceiling, scaled to the object's size (``arequest(nbytes=...)``)."""
        if self._patient is None:
            config = {**self._storage["config_kwargs"], "read_timeout": PATIENT_READ_TIMEOUT}
            fs, _ = fsspec.core.url_to_fs(self.options.url, **{**self._storage, "config_kwargs": config},
                                          loop=self.fs.loop)  # the same event loop: used from the tier's coroutines
            fs.retries = 1
            self._patient = fs
        return self._patient

    def _storage_options(self) -> dict[str, Any]:
        """The storage options for s3fs: the user's, plus the tier's timeouts, pool size and retry policy."""
        opts = self.options
        storage = dict(opts.options)
        if storage.get("endpoint_url") == "":  # "${S3_ENDPOINT:-}" left empty: AWS itself (or AWS_ENDPOINT_URL_S3)
            del storage["endpoint_url"]
        client = storage.get("client_kwargs")
        if isinstance(client, dict) and client.get("endpoint_url") == "":
            storage["client_kwargs"] = {k: v for k, v in client.items() if k != "endpoint_url"}
        storage.setdefault("skip_instance_cache", True)  # settings below must not leak into a shared instance
        storage.setdefault("use_listings_cache", False)  # listings must show what other ranks just wrote
        storage.setdefault("max_concurrency", opts.max_concurrency)
        config = dict(storage.get("config_kwargs") or {})
        if opts.timeout_s is not None:
            config["connect_timeout"] = opts.timeout_s
            config["read_timeout"] = opts.timeout_s
        # One try per botocore call: request_attempts and the engine's retry policy are the retry layers.
        config.setdefault("retries", {"total_max_attempts": 1})
        # No SHA-256 of every body for the signature: it runs on the event loop's one thread. (botocore skips it
        # over HTTPS only when it adds a checksum itself; the tier hands it one, checksum_param.) The bodies still
        # carry a CRC-32 and every file its own checksum in the manifest, checked on load.
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
        config.setdefault("max_pool_connections", max(10, 2 * opts.max_concurrency))
        storage["config_kwargs"] = config
        return storage

    @property
    def request_checksums(self) -> bool:
        """Whether requests carry a CRC-32: botocore's ``request_checksum_calculation`` as the tier's client
        resolved it (``config_kwargs``, ``AWS_REQUEST_CHECKSUM_CALCULATION``, the AWS config file's profile); on
        unless ``when_required``. Not to be asked on the event loop's thread."""
        if self._request_checksums is None:
            setting = self._storage["config_kwargs"].get("request_checksum_calculation")
            if setting is None:
                try:
                    client = self.run_sync(self.fs.set_session)  # builds the client; sends nothing
                    setting = client.meta.config.request_checksum_calculation
                except Exception:  # noqa: BLE001 - no client yet (bad credentials...): the request will say
                    setting = os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION")
            self._request_checksums = str(setting or "when_supported").lower() != "when_required"
        return self._request_checksums

    # ----- errors and tries ----------------------------------------------------------------------------------
    def redacted(self, text: str) -> str:
        """``text`` without the tier's credentials (for the upload's log lines)."""
        return self._redact(text)

    def _error_code(self, exc: BaseException) -> str | None:
        return s3_error_code(exc)

    # a HEAD's 403 has no body: "Forbidden" alone (an S3 user's trial, with a key the store did not know)
    _permission_hint = (" (the store refused these credentials for this key: check the tier's key/secret or "
                        "AWS_ACCESS_KEY_ID, and that they may read and write the bucket)")

    def _tier_exception(self, exc: BaseException, key: str | None, op: str, path: str,
                        missing_ok: bool = False) -> BaseException | None:
        if isinstance(exc, (TierError, CorruptionError)) or not isinstance(exc, Exception):
            return None
        network, credentials = library_errors()
        where = self._redact(f"{op} {path}")
        if isinstance(exc, network) and not isinstance(exc, (FileNotFoundError, PermissionError)):
            return TransientTierError(f"{where}: {self._redact(exception_text(exc))}", tier=self.name,
                                      key=key)
        if credentials and isinstance(exc, credentials):
            return PermanentTierError(f"{where}: {self._redact(exception_text(exc))} (give key/secret "
                                      "in the tier's options or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)",
                                      tier=self.name, key=key)
        if s3_error_code(exc) == "NoSuchBucket":  # "The specified bucket does not exist": which, and what to do
            return PermanentTierError(f"{where}: no such bucket {self.root.split('/', 1)[0]!r}: create it, or "
                                      "correct the tier's url", tier=self.name, key=key)
        err = super()._tier_exception(exc, key, op, path, missing_ok)
        if err is None:  # the S3 stack's other errors: a redacted message; the retry policy reads the cause
            err = TierError(f"{where}: {self._redact(exception_text(exc))}", tier=self.name, key=key)
        status = s3_http_status(exc)
        code = s3_error_code(exc)
        if isinstance(err, PermanentTierError) and code in (None, str(status)) and status in _RETRY_STATUSES:
            # an answer with no S3 error code (a load balancer's HTML 502/504, a 429; botocore then names the
            # status as the code): s3fs makes it an OSError(EIO), which would pass for a permanent failure
            return TransientTierError(f"{where}: HTTP {status}: {self._redact(str(exc))}", tier=self.name, key=key)
        return err

    def _log_retry(self, attempt: int, err: BaseException, delay: float, *, tries: int | None = None) -> None:
        # the request layer (request_attempts), under the engine's per-tier `retry` policy: say which (the last
        # try's failure goes to that policy, which says so itself)
        log.warning("%s (request try %d of %d failed, request_attempts; trying again in %.2f s)",
                    self._redact(str(err)), attempt, tries or self.options.request_attempts, delay)

    def _request(self, op: str, key: str | None, path: str, fn: Callable[[], Any], missing_ok: bool = False) -> Any:
        """``fn()`` with storage errors mapped, transient ones tried up to ``request_attempts`` times."""
        def once() -> Any:
            with self._errors(key, op, path, missing_ok):
                return fn()

        return request_retrying(self.options.request_attempts, on_retry=self._log_retry)(once)

    async def arequest(self, op: str, key: str | None, path: str, call: Callable[[], Awaitable[Any]], *,
                       nbytes: int = 0, missing_ok: bool = False, stop: threading.Event | None = None,
                       attempts: int | None = None) -> Any:
        """One S3 request on the event loop, tried up to ``request_attempts`` times (or ``attempts``), each under
        a ceiling; a set ``stop`` (an upload being aborted) gives up at the next failure. ``PreconditionFailed``
        (``If-Match``: the object changed) raises :class:`~._s3.Replaced` at once."""
        ceiling = self._ceiling(nbytes)

        async def once() -> Any:
            try:
                return await asyncio.wait_for(call(), ceiling)
            except (asyncio.CancelledError, Replaced):
                raise
            except Exception as exc:
                if s3_error_code(exc) == "PreconditionFailed":
                    raise Replaced() from None
                err = self._tier_exception(exc, key, op, path, missing_ok) or exc
                if isinstance(exc, asyncio.TimeoutError) and not isinstance(err, TierError):
                    err = TransientTierError(self._redact(f"{op} {path}: no answer within {ceiling:.0f} s"),
                                             tier=self.name, key=key)
                if err is exc:
                    raise
                raise err from exc

        tries = attempts or self.options.request_attempts
        retrying = request_retrying(tries, on_retry=functools.partial(self._log_retry, tries=tries),
                                    give_up=stop.is_set if stop is not None else None, asynchronous=True)
        return await retrying(once)

    def _ceiling(self, nbytes: int) -> float | None:
        """The longest one request moving ``nbytes`` may take: the timeouts plus its bytes at 1 MiB/s."""
        return None if self._base_timeout is None else self._base_timeout + nbytes / MIN_RATE

    def run_sync(self, func: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Run a coroutine function on s3fs's event loop and wait for it."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, func, *args, **kwargs)

    # ----- blob primitives ---------------------------------------------------------------------------------
    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        return self._upload(Upload(self, key, self._path(key)), chunks)

    def write_private_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        if not self.options.split_blobs:
            return self.write_blob(key, chunks)
        return self._upload(SplitUpload(self, key, self._path(key)), chunks)

    def _upload(self, upload: Upload, chunks: Iterable[Chunk]) -> int:
        upload.stable = chunks_stable(chunks)
        try:
            for chunk in chunks:  # the producer's exceptions propagate unchanged, after the abort
                upload.feed(as_memoryview(chunk))
            return upload.finish()
        except BaseException:
            upload.abort()
            raise

    def read_blob_hashed(self, key: str, hasher: Any = None, max_size: int | None = None) -> torch.Tensor:
        path = self._path(key)
        bucket, obj, _ = self.fs.split_path(path)

        def once() -> torch.Tensor:
            try:
                return self.run_sync(self._aread_all, key, path, bucket, obj, max_size)
            except PieceMissing as gone:
                self._piece_missing(key, path, gone.split, gone.number)  # raises Replaced or CorruptionError
                raise

        try:
            out = repeat_on(Replaced, READ_ATTEMPTS)(once)
        except Replaced:
            raise TransientTierError(f"the blob was replaced while being read, {READ_ATTEMPTS} times in a row",
                                     tier=self.name, key=key) from None
        if hasher is not None:
            hasher.update(as_memoryview(out))
        return out

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)
        head = self._head(key, path)
        split = self._split_of(head, key)
        check_range(offset, length, split.total if split else content_length(head, tier=self.name, key=key),
                    tier=self.name, key=key)
        if length == 0:
            return b""
        bucket, obj, _ = self.fs.split_path(path)
        out = bytearray(length)
        view = memoryview(out)
        spans = split.spans(offset, length) if split else [(0, offset, length, 0)]
        # a split blob's own object must still be the one described (pieces never change: their token pins them)
        etag = head.get("ETag") if split is not None else None
        for number, at, n, pos in spans:
            own = split is None or number == split.parts
            name, tag = (obj, etag) if own else (piece_name(obj, split.token, number), None)
            try:
                self.run_sync(self.arequest, "read", key, path,
                              lambda o=name, t=tag, a=at, v=view[pos:pos + n]: self._get_into(bucket, o, t, a, v, True),
                              nbytes=n, missing_ok=True)
            except Replaced:
                raise TransientTierError("the blob was replaced while being read", tier=self.name, key=key) from None
            except BlobNotFoundError:
                if own:
                    raise
                try:
                    self._piece_missing(key, path, split, number)
                except Replaced:
                    raise TransientTierError("the blob was replaced while being read", tier=self.name,
                                             key=key) from None
        return bytes(out)

    def _piece_missing(self, key: str, path: str, split: Split, number: int) -> None:
        """A piece of a split blob was not found: the key was written again meanwhile (its old pieces are removed
        after the new ones are in place: read again), or the piece was lost."""
        try:
            now = self._split_of(self._head(key, path), key)
        except BlobNotFoundError:
            raise TransientTierError("the blob was deleted while being read", tier=self.name, key=key) from None
        if now is None or now.token != split.token:
            raise Replaced()
        raise CorruptionError(f"piece {number} of {split.parts} of the split blob is missing "
                              f"({piece_name(key, split.token, number)})", tier=self.name, key=key)

    def shared_parts(self) -> SharedParts:
        return SharedParts(self)

    def temp_files(self, prefix: str = "") -> list[str]:
        """The side objects of uploads several processes share (:mod:`._s3_parts`), named as temporary files:
        what a job that died mid-upload leaves (an upload in place leaves nothing else visible). ``prefix``: those
        under it only."""
        top = f"{self.root}/{prefix}".rstrip("/")
        return sorted(p[len(self.root) + 1:] for p in self._paths(top) if p.startswith(top + "/") and is_temp_name(p))

    def delete_prefix(self, prefix: str) -> None:
        """Everything under ``prefix``, the side objects of shared uploads too (their uploads aborted first)."""
        for key in self.temp_files(check_prefix(prefix.rstrip("/") + "/")):
            self.remove_temp_file(key)
        super().delete_prefix(prefix)

    def remove_temp_file(self, key: str) -> None:
        """Remove a side object; an upload token's upload is aborted first (its parts would stay, billed)."""
        if is_upload_token(key):
            return SharedParts(self).abort_published(key)
        return super().remove_temp_file(key)

    def unfinished_uploads(self, min_age_s: float = 0.0,
                           keys: Callable[[str], bool] | None = None) -> list[UnfinishedUpload]:
        """The multipart uploads in progress under the tier's root, each with the bytes and the time of the parts
        the store holds: a job killed mid-upload leaves them invisible and billed (module doc of ``_s3``). Those
        started less than ``min_age_s`` ago, or whose key ``keys`` refuses, are left out unasked. Needs the
        ``s3:ListBucketMultipartUploads`` and ``s3:ListMultipartUploadParts`` permissions."""
        bucket, top, _ = self.fs.split_path(self.root)
        prefix = f"{top}/" if top else ""
        now = time.time()
        out = []
        for up in self._listed_pages("list the multipart uploads under", self.root, "list_multipart_uploads",
                                     {"Bucket": bucket, "Prefix": prefix}, "Uploads",
                                     ("NextKeyMarker", "KeyMarker"), ("NextUploadIdMarker", "UploadIdMarker")):
            obj, upload_id = up.get("Key", ""), up.get("UploadId", "")
            try:
                key = check_key(obj[len(prefix):]) if obj.startswith(prefix) and upload_id else None
            except ValueError:  # a name no key of ours has ("a//b", "dir/"): not ours to abort
                key = None
            if key is None or (keys is not None and not keys(key)):
                continue
            times = [w.timestamp() for w in (up.get("Initiated"),) if hasattr(w, "timestamp")]
            if times and now - times[0] < min_age_s:
                continue
            nbytes = 0
            try:
                for part in self._listed_pages("list the parts of the multipart upload of", f"{bucket}/{obj}",
                                               "list_parts", {"Bucket": bucket, "Key": obj, "UploadId": upload_id},
                                               "Parts", ("NextPartNumberMarker", "PartNumberMarker"),
                                               missing_ok=True):
                    nbytes += int(part.get("Size", 0))
                    times += [w.timestamp() for w in (part.get("LastModified"),) if hasattr(w, "timestamp")]
            except BlobNotFoundError:  # NoSuchUpload: completed or aborted since it was listed
                continue
            out.append(UnfinishedUpload(key, upload_id, nbytes, max(times, default=None)))
        return out

    def _listed_pages(self, op: str, path: str, call: str, params: dict[str, Any], field: str,
                      *markers: tuple[str, str], missing_ok: bool = False) -> list[dict[str, Any]]:
        """:meth:`apages`, from a thread other than the event loop's."""
        return self.run_sync(self.apages, op, path, call, params, field, *markers, missing_ok=missing_ok)

    async def apages(self, op: str, path: str, call: str, params: dict[str, Any], field: str,
                     *markers: tuple[str, str], missing_ok: bool = False) -> list[dict[str, Any]]:
        """Every entry of ``field`` over the pages of a paginated S3 listing, each page one request under
        :meth:`arequest` (``markers``: the answer's field naming the next page, and the request's parameter asking
        for it). ``missing_ok``: a listing of something gone raises :class:`BlobNotFoundError`."""
        entries: list[dict[str, Any]] = []
        page = dict(params)
        while True:
            resp = await self.arequest(op, None, path, lambda p=dict(page): self.fs._call_s3(call, **p),
                                       missing_ok=missing_ok)
            entries += resp.get(field) or []
            if not resp.get("IsTruncated"):
                return entries
            following = {**params, **{ask: resp[got] for got, ask in markers if resp.get(got) is not None}}
            if following == page or all(resp.get(got) is None for got, _ in markers):
                # a truncated answer that names no next page: asking again (or from the first page) would loop
                raise TransientTierError(self._redact(f"{op} {path}: the store says there is more, and not where"),
                                         tier=self.name)
            page = following

    async def aobjects(self, op: str, bucket: str, prefix: str, missing_ok: bool = False) -> list[dict[str, Any]]:
        """The entries (``Key``, ``Size``...) of every object of ``bucket`` whose name starts with ``prefix``;
        ``missing_ok``: no bucket raises :class:`BlobNotFoundError`."""
        return await self.apages(op, f"{bucket}/{prefix}", "list_objects_v2", {"Bucket": bucket, "Prefix": prefix},
                                 "Contents", ("NextContinuationToken", "ContinuationToken"), missing_ok=missing_ok)

    async def adelete_objects(self, op: str, path: str, bucket: str, names: list[str]) -> None:
        """Delete the objects ``names`` of ``bucket``, 1000 to a request (DeleteObjects' limit); those already
        gone are not errors. ``op`` and ``path`` name them in errors."""
        for i in range(0, len(names), 1000):
            batch = {"Objects": [{"Key": k} for k in names[i:i + 1000]], "Quiet": True}
            resp = await self.arequest(op, None, path,
                                       lambda b=batch: self.fs._call_s3("delete_objects", Bucket=bucket, Delete=b))
            failed = [e for e in (resp or {}).get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise TransientTierError(self._redact(
                    f"{op} {path}: {len(failed)} of {len(batch['Objects'])} not deleted, e.g. {failed[0].get('Key')}: "
                    f"{failed[0].get('Code')} {failed[0].get('Message', '')}".rstrip()), tier=self.name)

    # Listings and deletes as the tier's own requests, each under a ceiling (the module docstring), where
    # s3fs's find/rm have botocore's read timeout only: a server trickling an answer would hold them for ever.
    def _objects(self, top: str) -> list[tuple[str, int]]:
        """(path, size) of every object under the directory ``top``."""
        bucket, obj, _ = self.fs.split_path(top)
        prefix = f"{obj.rstrip('/')}/" if obj else ""
        try:
            entries = self.run_sync(self.aobjects, "list", bucket, prefix, missing_ok=True)
        except BlobNotFoundError:  # NoSuchBucket: a tier that cannot be used, never "no checkpoint"
            raise PermanentTierError(f"no such bucket {bucket!r} ({self.location}): create it, or correct the "
                                     "tier's url", tier=self.name) from None
        # a name ending in "/" is a folder marker some tools write, not an object of ours
        return [(f"{bucket}/{e['Key']}", int(e.get("Size") or 0)) for e in entries if not e["Key"].endswith("/")]

    def _paths(self, top: str) -> list[str]:
        return [path for path, _ in self._objects(top)]

    def _sizes(self, top: str) -> dict[str, int]:
        return dict(self._objects(top))

    def _remove_object(self, key: str, path: str) -> None:
        bucket, obj, _ = self.fs.split_path(path)
        # S3 answers a delete of a missing key as a success; a missing bucket is an error
        self.run_sync(self.arequest, "delete", key, path,
                      lambda: self.fs._call_s3("delete_object", Bucket=bucket, Key=obj))

    def _remove_objects(self, keys: list[str], where: str) -> None:
        bucket, top, _ = self.fs.split_path(self.root)
        names = [f"{top}/{k}" if top else k for k in keys]
        self.run_sync(self.adelete_objects, "delete", where, bucket, names)

    def abort_upload(self, upload: UnfinishedUpload) -> None:
        """Abort a multipart upload :meth:`unfinished_uploads` listed (one already gone is not an error). Needs the
        ``s3:AbortMultipartUpload`` permission."""
        self.abort_multipart("abort (s3:AbortMultipartUpload) the multipart upload of", upload.key, upload.upload_id)

    def abort_multipart(self, op: str, key: str, upload_id: str) -> None:
        """Abort the multipart upload ``upload_id`` of ``key`` (an unknown one is not an error); ``op`` names it
        in errors."""
        path = self._path(key)
        bucket, obj, _ = self.fs.split_path(path)

        def call() -> Awaitable[Any]:
            return self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id)

        try:
            self.run_sync(self.arequest, op, key, path, call, missing_ok=True)
        except BlobNotFoundError:  # NoSuchUpload: already gone
            pass

    def size(self, key: str) -> int:
        head = self._head(key, self._path(key))
        split = self._split_of(head, key)
        return split.total if split else content_length(head, tier=self.name, key=key)

    def _split_of(self, resp: dict[str, Any], key: str) -> Split | None:
        """How the object answering ``resp`` stores its blob: split (``split_blobs``, :mod:`._s3_split`) or None."""
        try:
            return Split.from_metadata(resp.get("Metadata"))
        except ValueError as exc:
            raise CorruptionError(f"{exc} (written by a newer tiered_ckpt?)", tier=self.name, key=key) from None

    def _listed(self, key: str) -> bool:
        return not is_piece_name(key)

    def delete(self, key: str) -> None:
        super().delete(key)
        if self.options.split_blobs:  # a split blob's pieces go with it (without the option: with their step)
            bucket, obj, _ = self.fs.split_path(self._path(key))
            self.run_sync(drop_pieces, self, bucket, obj)

    def exists(self, key: str) -> bool:
        try:  # a HEAD: fsspec's isfile() would answer False on a throttled request
            self._head(key, self._path(key))
        except BlobNotFoundError:
            return False
        return True

    def modified(self, key: str) -> float | None:
        try:
            when = self._head(key, self._path(key)).get("LastModified")
        except TierError:
            return None
        return float(when.timestamp()) if hasattr(when, "timestamp") else None

    def describe(self) -> str:
        text = f"fsspec {self.options.url}"
        opts = self.options.options
        endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        if endpoint:
            text += f" at {endpoint}"
        return self._redact(text)

    # ----- S3 primitives (coroutines on s3fs's loop) -------------------------------------------------------
    def _head(self, key: str, path: str) -> dict[str, Any]:
        bucket, obj, _ = self.fs.split_path(path)
        return self.run_sync(self.arequest, "stat", key, path,
                             lambda: self.fs._call_s3("head_object", Bucket=bucket, Key=obj), missing_ok=True)

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
            if content_length(resp, n, tier=self.name, key=obj) != n:
                raise Replaced()
            await self._read_body(body, view, obj)
        finally:
            body.close()

    async def _aread_all(self, key: str, path: str, bucket: str, obj: str,
                         max_size: int | None = None) -> torch.Tensor:
        """The object in ``part_size`` ranges, ``max_concurrency`` at a time, into one tensor.

        The first range's answer tells the size (and is the whole blob when it fits: one atomic GET); the
        other ranges start as soon as its headers arrive, ``If-Match`` its ETag.
        """
        part = self.options.part_size

        def first() -> Awaitable[dict[str, Any]]:
            return self.fs._call_s3("get_object", Bucket=bucket, Key=obj, Range=f"bytes=0-{part - 1}")

        try:
            resp = await self.arequest("read", key, path, first, missing_ok=True)
        except TierError as exc:
            if s3_error_code(exc) == "InvalidRange":  # S3's answer to any range of an empty object
                return torch.empty(0, dtype=torch.uint8)
            raise
        body = resp["Body"]
        try:
            split = self._split_of(resp, key)
            if split is not None:
                return await self._aread_split(key, path, bucket, obj, resp, split, max_size)
            size = object_size(resp, tier=self.name, key=key)
            check_size(size, max_size, self._redact(path), tier=self.name, key=key)
            out = populating_empty(size)  # the event loop fills it: page faults on another thread, ahead of it
            if size == 0:
                return out
            view = memoryview(out.numpy())
            head_n = min(part, size)
            if content_length(resp, head_n, tier=self.name, key=key) != head_n:
                raise Replaced()
            etag = resp.get("ETag")
            gate = asyncio.Semaphore(self.options.max_concurrency)

            async def one(off: int, n: int) -> None:
                async with gate:
                    await self.arequest(f"read bytes {off}-{off + n - 1} of", key, path,
                                        lambda: self._get_into(bucket, obj, etag, off, view[off:off + n], True),
                                        nbytes=n, missing_ok=True)

            tasks = [asyncio.ensure_future(one(off, min(part, size - off))) for off in range(part, size, part)]
            try:
                async with gate:
                    try:
                        await asyncio.wait_for(self._read_body(body, view[:head_n], key), self._ceiling(head_n))
                    except (asyncio.CancelledError, Replaced):
                        raise
                    except Exception:  # the first answer broke off: read that range again like the others
                        head_failed = True
                    else:
                        head_failed = False
                if head_failed:
                    await one(0, head_n)
                await asyncio.gather(*tasks)
            except BaseException:
                await cancel_all(tasks)
                raise
            return out
        finally:
            body.close()

    async def _aread_split(self, key: str, path: str, bucket: str, obj: str, resp: dict[str, Any], split: Split,
                           max_size: int | None) -> torch.Tensor:
        """A split blob (:mod:`._s3_split`) into one tensor: its pieces as whole GETs, ``max_concurrency`` at a
        time, and its last part from the key's own object (the first answer's body when it holds all of it)."""
        check_size(split.total, max_size, self._redact(path), tier=self.name, key=key)
        out = populating_empty(split.total)  # the event loop fills it: page faults on another thread, ahead of it
        view = memoryview(out.numpy())
        last = view[split.last_offset:]
        etag = resp.get("ETag")
        gate = asyncio.Semaphore(self.options.max_concurrency)

        async def own() -> None:
            async with gate:
                whole = (object_size(resp, tier=self.name, key=key) == len(last)
                         and content_length(resp, len(last), tier=self.name, key=key) == len(last))
                if whole:
                    try:
                        await asyncio.wait_for(self._read_body(resp["Body"], last, key), self._ceiling(len(last)))
                        return
                    except (asyncio.CancelledError, Replaced):
                        raise
                    except Exception:  # noqa: BLE001 - the first answer broke off: ask again below
                        pass
                await self.arequest("read", key, path, lambda: self._get_into(bucket, obj, etag, 0, last, False),
                                    nbytes=len(last), missing_ok=True)

        async def piece(number: int) -> None:
            at = (number - 1) * split.piece_size
            async with gate:
                try:
                    await self.arequest(f"read piece {number} of", key, path, lambda: self._get_into(
                        bucket, piece_name(obj, split.token, number), None, 0, view[at:at + split.piece_size], False),
                        nbytes=split.piece_size, missing_ok=True)
                except BlobNotFoundError:
                    raise PieceMissing(split, number) from None
                except Replaced:  # a piece never changes: one of another size is damaged, not being replaced
                    raise CorruptionError(f"piece {number} of {split.parts} of the split blob is not "
                                          f"{split.piece_size} bytes", tier=self.name, key=key) from None

        await gather_or_cancel([asyncio.ensure_future(own())]
                               + [asyncio.ensure_future(piece(n)) for n in range(1, split.parts)])
        return out

    async def _read_body(self, body: Any, view: memoryview, key: str) -> None:
        n, got = len(view), 0
        content = _aiohttp_content(body)
        if content is not None:
            # aiohttp: each chunk as it arrives, copied once (readinto joins the buffered chunks first, then
            # copies: about a fifth slower per GET on loopback)
            async for chunk in content.iter_any():
                k = len(chunk)
                if got + k > n:
                    raise TransientTierError(f"the answer holds more than the {n} bytes it announced", tier=self.name,
                                             key=key)
                view[got:got + k] = chunk
                got += k
        else:
            while got < n:
                k = await body.readinto(view[got:got + READ_PIECE])
                if not k:
                    break
                got += k
        if got != n:
            raise TransientTierError(f"the answer ended after {got} of {n} bytes", tier=self.name, key=key)
