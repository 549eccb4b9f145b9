"""What the S3 tier (:mod:`tiered_ckpt.tiers.s3`) is built from: S3's transfer limits, the classification of
botocore/S3 errors, and the parallel multipart upload (:class:`Upload`); see :mod:`tiered_ckpt.tiers.s3` for the
behaviour."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from ..crashpoints import crash_point
from ..errors import BlobNotFoundError, CorruptionError, PermanentTierError, TransientTierError
from ..fast_crc import crc32
from ..retry import request_retrying

if TYPE_CHECKING:
    from .s3 import S3Tier

# Same logger as the tier.
log = logging.getLogger(__package__ + ".s3")

MiB = 1 << 20
S3_PROTOCOLS = frozenset({"s3", "s3a"})
S3_MIN_PART = 5 * MiB  # S3 rejects smaller parts (except the last one)
S3_MAX_PART = 5 << 30
S3_MAX_PARTS = 10_000
READ_PIECE = 16 << 20  # bytes per readinto call
READ_ATTEMPTS = 3  # reads of a blob that is being replaced
ABORT_ROUNDS = 3  # aborts of a multipart upload while the store still lists it
MIN_RATE = 1 * MiB  # bytes/s a request must at least achieve before its overall ceiling ends it
#: Stable pieces smaller than this are joined into one small buffer of the part's own, not sent as views: a
#: torch-format file's headers and small tensors would otherwise make parts of thousands of tiny views, each a
#: write of its own on the connection.
JOIN_BELOW = 64 << 10
_CHECKSUM_FIELDS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")

# ----- S3 error helpers --------------------------------------------------------------------------------------
_NETWORK_ERRORS: tuple[type[BaseException], ...] | None = None
_CREDENTIAL_ERRORS: tuple[type[BaseException], ...] = ()


def library_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
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


def _answers(exc: BaseException | None) -> Iterator[dict[str, Any]]:
    """The botocore answers (``response`` dicts) along an exception's chain of causes, nearest first."""
    for _ in range(6):
        if exc is None:
            return
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            yield response
        exc = exc.__cause__ or exc.__context__


def s3_error_code(exc: BaseException | None) -> str | None:
    """The S3 error code (``SlowDown``, ``NoSuchUpload``, ``PreconditionFailed``...) behind an exception."""
    return next((str(code) for answer in _answers(exc) if (code := answer.get("Error", {}).get("Code"))), None)


def s3_http_status(exc: BaseException | None) -> int | None:
    """The HTTP status of the S3 answer behind an exception (502 from a load balancer, 429...), if any."""
    return next((status for answer in _answers(exc)
                 if isinstance(status := answer.get("ResponseMetadata", {}).get("HTTPStatusCode"), int)), None)


async def completed_as(tier: S3Tier, bucket: str, obj: str, parts: Sequence[dict[str, Any]]) -> bool:
    """Whether ``obj`` is the object these parts (in part-number order) complete, by its multipart ETag (False
    where the store's ETags are not MD5s): a completion whose answer was lost."""
    expected = multipart_etag(list(parts))
    if expected is None:
        return False
    try:
        head = await tier.fs._call_s3("head_object", Bucket=bucket, Key=obj)
    except FileNotFoundError:
        return False
    return head.get("ETag") == expected


class Replaced(Exception):
    """The object changed between two requests of one read (its ETag no longer matches)."""


def multipart_etag(parts: list[dict[str, Any]]) -> str | None:
    """The ETag S3 gives an object completed from ``parts`` (MD5 ETags only; None when they are not)."""
    digests = []
    for p in parts:
        tag = str(p.get("ETag", "")).strip('"')
        if not re.fullmatch(r"[0-9a-fA-F]{32}", tag):
            return None
        digests.append(bytes.fromhex(tag))
    return f'"{hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()}-{len(parts)}"'



def object_size(resp: dict[str, Any], *, tier: str, key: str) -> int:
    """The whole object's size from a (ranged) GET answer: ``Content-Range: bytes 0-99/1234`` or its length."""
    content_range = resp.get("ContentRange")
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1].strip()
        if total.isdigit():
            return int(total)
    return content_length(resp, tier=tier, key=key)


def content_length(resp: dict[str, Any], default: int | None = None, *, tier: str, key: str) -> int:
    """An answer's ``ContentLength``. One that is missing or not a byte count is a
    :class:`~tiered_ckpt.errors.CorruptionError` (a load falls back to the next tier), never a ``ValueError``."""
    value = resp.get("ContentLength", default)
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0 or isinstance(value, bool):
        raise CorruptionError(f"the store's answer gives no byte count (ContentLength {value!r}, ContentRange "
                              f"{resp.get('ContentRange')!r})", tier=tier, key=key)
    return n


async def cancel_all(tasks: list[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until each one has ended (a request still sending must not outlive its read or
    upload)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(tasks: list[asyncio.Future]) -> list[Any]:
    """Every task's result, in order; on the first failure the others are cancelled and waited for, then it is
    raised."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_all(tasks)
        raise


def checksum_param(tier: S3Tier, *views: memoryview) -> dict[str, str]:
    """``ChecksumCRC32`` for a ``PutObject`` or ``UploadPart`` of ``views`` (one after the other), computed in the
    calling thread (ISA-L where installed), when request checksums are on (botocore's default). botocore would
    otherwise compute the same CRC-32 on the event loop's one thread, with zlib, for every request in flight: about
    1.4 GB/s on the benchmark machine."""
    if not tier.request_checksums:
        return {}
    value = 0
    for v in views:
        value = crc32(v, value)
    return {"ChecksumCRC32": base64.b64encode(value.to_bytes(4, "big")).decode("ascii")}


class RequestBody:
    """A request body over memory the caller keeps unchanged until the request ends: ``read``/``seek``/``tell``
    for botocore (its parameter check wants a file), and ``__aiter__`` for aiohttp, which then sends slices of
    the views as they are. A file body (``io.IOBase``) would make aiohttp read it in 256 KiB pieces through the
    event loop's thread pool, each a thread hand-off and a copy: on the benchmark machine that doubled the
    client's CPU per byte, taken from the two cores the server shares (docs/object-stores.md). Not an
    ``io.IOBase`` on purpose: aiobotocore would wrap it and aiohttp would take it for a file again."""

    SLICE = 1 << 20  # bytes per transport write: what waits in the transport's buffer stays this small

    def __init__(self, *views: memoryview):
        self._views = [v for v in views if len(v)]
        self._size = sum(len(v) for v in self._views)
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence not in (0, 1, 2):
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _slices(self, start: int, end: int, most: int) -> Iterator[memoryview]:
        """The bytes ``[start, end)`` as views of at most ``most`` bytes."""
        at = 0
        for v in self._views:
            lo, hi = max(start - at, 0), min(end - at, len(v))
            for i in range(lo, hi, most):
                yield v[i:min(i + most, hi)]
            at += len(v)

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        out = b"".join(self._slices(self._pos, end, end)) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return out

    def __aiter__(self) -> AsyncIterator[memoryview]:
        # From where the reader stands when aiohttp starts sending, every time it starts: an aiohttp that sends
        # the body again (its own retry of a dropped keep-alive connection) sends all of it again.
        return self._send(self._pos)

    async def _send(self, start: int) -> AsyncIterator[memoryview]:
        for piece in self._slices(start, self._size, self.SLICE):
            yield piece


Part = tuple[list[memoryview], bytearray | None]  # a part's bytes (views, in order), the buffer it owns if any


class Upload:
    """One blob on S3: a single PUT if it fits in one part, else a parallel multipart upload (module doc)."""

    def __init__(self, tier: S3Tier, key: str, path: str):
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
        # Stable chunks (StableChunks: set by the tier) stay as they are until finish(): parts are views of them,
        # whatever their sizes. Otherwise parts are gathered into owned buffers, and only a window of whole
        # parts is sent straight from one chunk (the tier waits for them before asking for the next chunk).
        self.stable = False
        self.buf: bytearray | None = None  # the part being gathered, copied (chunks not stable)
        self.views: list[memoryview] = []  # the part being gathered, as views of stable chunks
        self.small: list[memoryview] = []  # small stable pieces after the last view, joined before the next one
        self.fill = 0
        self.ready: Part | None = None  # a full part held back until we know more data follows
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
        if self.stable:  # views only: nothing to copy, nothing to wait for
            pos = 0
            while pos < n:
                self._flush_ready()
                pos = self._gather(mv, pos)
            return
        pos = self._gather(mv, 0) if self.buf is not None else 0
        borrowed = []
        whole = self._whole_parts(n - pos)
        if whole >= self.window:  # a full window of parts straight from the caller's buffer
            self._flush_ready()
            for _ in range(whole):
                borrowed.append(self._submit([mv[pos:pos + self.part_size]], None))
                pos += self.part_size
        while pos < n:
            self._flush_ready()
            pos = self._gather(mv, pos)
        for fut in borrowed:  # the producer may reuse this chunk once we ask for the next one
            while fut in self.inflight:
                self._reap(block=True)

    def _whole_parts(self, available: int) -> int:
        """How many whole parts of ``available`` bytes may be sent straight from the caller's buffer."""
        return available // self.part_size

    def finish(self) -> int:
        if self.upload_id is None:
            self._put(self.ready[0] if self.ready is not None else self._take_gathered()[0])
            return self.total
        self._flush_ready()
        if self.fill:
            self._submit(*self._take_gathered())
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
                self.tier.run_sync(self._cancel_parts)
            self.inflight.clear()
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is None:
            return
        try:
            self._abort(upload_id)
        except Exception as exc:
            log.warning("tier %r: could not abort the multipart upload %s of %s (its parts stay invisible but "
                        "billed until a lifecycle rule with AbortIncompleteMultipartUpload removes them): %s",
                        self.tier.name, upload_id, self.tier.redacted(self.path), self.tier.redacted(str(exc)))

    def _gather(self, mv: memoryview, pos: int) -> int:
        """Add ``mv[pos:]`` to the part being gathered, up to a whole part; return the new position."""
        take = min(self.part_size - self.fill, len(mv) - pos)
        if self.stable:
            piece = mv[pos:pos + take]
            if len(piece) < JOIN_BELOW:
                self.small.append(piece)
            else:
                self._join_small()
                self.views.append(piece)
        else:
            if self.buf is None:
                self.buf = self._take_buffer()
            self.buf[self.fill:self.fill + take] = mv[pos:pos + take]
        self.fill += take
        if self.fill == self.part_size:
            self.ready = self._take_gathered()
        return pos + take

    def _join_small(self) -> None:
        if self.small:
            self.views.append(self.small[0] if len(self.small) == 1 else memoryview(b"".join(self.small)))
            self.small = []

    def _take_gathered(self) -> Part:
        """The part gathered so far (perhaps empty), handed over; gathering starts again."""
        if self.stable:
            self._join_small()
            part: Part = (self.views, None)
            self.views = []
        else:
            part = ([memoryview(self.buf)[:self.fill]], self.buf) if self.buf is not None else ([], None)
            self.buf = None
        self.fill = 0
        return part

    def _flush_ready(self) -> None:
        if self.ready is not None:
            part, self.ready = self.ready, None
            self._submit(*part)

    def _take_buffer(self) -> bytearray:
        while True:
            if self.free:
                return self.free.pop()
            if self.allocated <= self.window:  # window parts in flight + the one being gathered
                self.allocated += 1
                return bytearray(self.part_size)  # calloc: pages are touched only when written
            self._reap(block=True)

    def _submit(self, views: list[memoryview], owner: bytearray | None) -> Future:
        if self.upload_id is None:
            self._create()
        if self.next_part > S3_MAX_PARTS:
            raise PermanentTierError(f"more than {S3_MAX_PARTS} parts of {self.part_size} bytes: raise part_size",
                                     tier=self.tier.name, key=self.key)
        while len(self.inflight) >= self.window:
            self._reap(block=True)
        number = self.next_part
        self.next_part += 1
        checksum = checksum_param(self.tier, *views)  # here, in the producer's thread, not on the event loop
        fut = asyncio.run_coroutine_threadsafe(self._send_part(number, views, checksum), self.tier.fs.loop)
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
            crash_point("s3.part_sent")

    # ----- requests ----------------------------------------------------------------------------------------
    def _create(self) -> None:
        tries = [0]

        async def create() -> dict[str, Any]:
            tries[0] += 1
            return await self.tier.fs._call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.obj)

        resp = self.tier.run_sync(self.tier.arequest, "start the multipart upload of", self.key, self.path, create)
        self.upload_id = resp["UploadId"]
        self.checksummed = bool(resp.get("ChecksumAlgorithm"))
        if tries[0] > 1:  # an earlier try may have created an upload whose answer was lost
            with contextlib.suppress(Exception):  # best effort, under one request's ceiling
                self.tier.run_sync(self.tier.arequest, "abort the stray uploads of", self.key, self.path,
                                   self._abort_strays, attempts=1)

    async def _abort_strays(self) -> None:
        resp = await self.tier.fs._call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=self.obj)
        for up in resp.get("Uploads", []):
            if up.get("Key") == self.obj and up.get("UploadId") != self.upload_id:
                with contextlib.suppress(Exception):
                    await self.tier.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.obj,
                                                UploadId=up["UploadId"])

    async def _send_part(self, number: int, views: list[memoryview], checksum: dict[str, str]) -> dict[str, Any]:
        self.tasks.add(asyncio.current_task())  # first, before any await: _cancel_parts finds every part
        upload_id = self.upload_id

        def call() -> Awaitable[dict[str, Any]]:
            return self.tier.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.obj, UploadId=upload_id,
                                         PartNumber=number, Body=RequestBody(*views), **checksum)

        resp = await self.tier.arequest(f"upload part {number} of", self.key, self.path, call,
                                         nbytes=sum(map(len, views)), stop=self.stop)
        entry = {"PartNumber": number, "ETag": resp["ETag"]}
        if self.checksummed:
            entry.update({k: resp[k] for k in _CHECKSUM_FIELDS if resp.get(k)})
        return entry

    async def _cancel_parts(self) -> None:
        await cancel_all([t for t in self.tasks if not t.done()])

    def _put(self, views: list[memoryview], metadata: dict[str, str] | None = None) -> None:
        extra = {"Metadata": metadata} if metadata else {}
        extra.update(checksum_param(self.tier, *views))

        def call() -> Awaitable[Any]:
            return self.tier.fs._call_s3("put_object", Bucket=self.bucket, Key=self.obj, Body=RequestBody(*views),
                                         **extra)

        self.tier.run_sync(self.tier.arequest, "upload", self.key, self.path, call, nbytes=sum(map(len, views)))

    def _complete(self) -> None:
        parts = [self.parts[n] for n in sorted(self.parts)]
        upload_id = self.upload_id
        tries = [0]

        async def complete() -> Any:
            tries[0] += 1
            try:  # the server may assemble the object for a long time before it answers: a patient client
                return await self.tier.patient_fs()._call_s3("complete_multipart_upload", Bucket=self.bucket,
                                                             Key=self.obj, UploadId=upload_id,
                                                             MultipartUpload={"Parts": parts})
            except FileNotFoundError:
                # NoSuchUpload on a second try: the first one completed but its answer was lost?
                if tries[0] > 1 and await completed_as(self.tier, self.bucket, self.obj, parts):
                    return None
                raise

        self.tier.run_sync(self.tier.arequest, "complete the multipart upload of", self.key, self.path, complete,
                           nbytes=self.total)  # its ceiling: the timeouts plus the object's size at 1 MiB/s

    def _abort(self, upload_id: str) -> None:
        """Abort the upload until the store no longer knows it. A part that was in flight when it was cancelled
        may still be landing on the server: S3 then keeps (or re-creates) the upload's storage, so it is aborted
        again after a pause, up to ``_ABORT_ROUNDS`` times. Cleanup gets a few tries even if
        ``request_attempts`` is 1."""
        tier = self.tier
        attempts = max(3, tier.options.request_attempts)
        kw = {"Bucket": self.bucket, "Key": self.obj, "UploadId": upload_id}

        rounds = [0]

        async def abort_once() -> None:
            rounds[0] += 1
            try:
                await tier.arequest("abort the multipart upload of", self.key, self.path,
                                    lambda: tier.fs._call_s3("abort_multipart_upload", **kw), missing_ok=True,
                                    attempts=attempts)
                await tier.arequest("check the abort of", self.key, self.path,
                                    lambda: tier.fs._call_s3("list_parts", **kw), missing_ok=True,
                                    attempts=attempts)
            except BlobNotFoundError:  # NoSuchUpload: gone (perhaps an earlier abort whose answer was lost)
                return
            raise TransientTierError(f"the multipart upload {upload_id} is still there after {rounds[0]} "
                                     f"abort(s)", tier=tier.name, key=self.key)

        async def abort_until_gone() -> None:
            await request_retrying(ABORT_ROUNDS, asynchronous=True)(abort_once)

        tier.run_sync(abort_until_gone)
