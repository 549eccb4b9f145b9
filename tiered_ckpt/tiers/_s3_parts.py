"""One S3 object uploaded in parts by several processes: the S3 tier's :meth:`~.s3.S3Tier.shared_parts`.

The ``megatron`` layout's ranks write their own byte ranges of Megatron's ``distrib_optim.pt`` as parts of one
multipart upload (:mod:`tiered_ckpt.megatron.inplace_parts`): one process creates the upload, the others learn
its id from a small object, every process uploads the part numbers the plan gives it, and the committing rank
completes the upload with every rank's part list. Nothing is visible under the key until then; an upload that is
not completed is aborted by :meth:`SharedParts.abort`.

Every request goes through the tier's :meth:`~.s3.S3Tier.arequest` (its tries, ceilings and error mapping), as
the tier's own uploads do (:class:`~._s3.Upload`).

The object that publishes an upload's id (:meth:`SharedParts.publish`) is named as a temporary file whose name
ends in ``.upload.tmp-<16 hex>`` (:func:`is_upload_token`): ``gc`` lists it among the tier's temporary files, and
removing it (:meth:`~.s3.S3Tier.remove_temp_file`) aborts the upload it names first, so a job that died mid-upload
leaves no parts behind once ``gc`` has run.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import BlobNotFoundError, CorruptionError
from ._s3 import (
    _CHECKSUM_FIELDS,
    S3_MAX_PART,
    S3_MAX_PARTS,
    S3_MIN_PART,
    RequestBody,
    checksum_param,
    completed_as,
    gather_or_cancel,
)

if TYPE_CHECKING:
    from .s3 import S3Tier

UPLOAD_TOKEN = "upload"  # the ``<what>`` of ``.<name>.<what>.tmp-<16 hex>``: an object naming a shared upload
_TOKEN_RE = re.compile(r"^\..+\." + UPLOAD_TOKEN + r"\.tmp-[0-9a-f]{16}$")


def is_upload_token(key: str) -> bool:
    """Whether ``key`` names an object :meth:`SharedParts.publish` writes."""
    return bool(_TOKEN_RE.match(key.rsplit("/", 1)[-1]))


class SharedParts:
    """Multipart uploads whose parts several processes send (module doc). ``part_size`` is the tier's: the size
    a planner cuts long ranges into; ``min_part``/``max_part``/``max_parts`` are S3's limits."""

    min_part = S3_MIN_PART
    max_part = S3_MAX_PART
    max_parts = S3_MAX_PARTS

    def __init__(self, tier: S3Tier):
        self.tier = tier
        self.part_size = tier.options.part_size

    def _where(self, key: str) -> tuple[str, str, str]:
        path = self.tier._path(key)
        bucket, obj, _ = self.tier.fs.split_path(path)
        return path, bucket, obj

    def create(self, key: str) -> str:
        """Start a multipart upload of ``key``; its id."""
        path, bucket, obj = self._where(key)

        def call() -> Any:
            return self.tier.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=obj)

        resp = self.tier.run_sync(self.tier.arequest, "start the shared multipart upload of", key, path, call)
        return str(resp["UploadId"])

    def alive(self, key: str, upload_id: str) -> bool:
        """Whether the store still knows the upload (neither completed nor aborted). Asked of the uploads in
        progress under the key, not of the upload's parts: a part being uploaded is never read (moto computes a
        listed part's ETag from its stored bytes without a lock, racing the upload that writes them)."""
        return self._in_progress(key, upload_id) is not None

    def _in_progress(self, key: str, upload_id: str) -> dict[str, Any] | None:
        """The store's entry of the upload among those in progress under ``key`` (None: not there); the pages
        after the one naming it are not asked for."""
        path, bucket, obj = self._where(key)
        uploads = self.tier._listed_pages("look up the multipart uploads of", path, "list_multipart_uploads",
                                          {"Bucket": bucket, "Prefix": obj}, "Uploads",
                                          ("NextKeyMarker", "KeyMarker"), ("NextUploadIdMarker", "UploadIdMarker"))
        return next((dict(u) for u in uploads if u.get("Key") == obj and u.get("UploadId") == upload_id), None)

    def upload(self, key: str, upload_id: str,
               parts: Sequence[tuple[int, memoryview | Callable[[], memoryview]]]) -> list[dict[str, Any]]:
        """Upload ``(number, bytes)`` parts, ``max_concurrency`` at a time (a sliding window: a slow part holds
        one connection, not the others); each one's completion entry (``PartNumber``, ``ETag`` and any checksum
        the store returned), in the order given. ``bytes`` may be a function that makes them: it is called on a
        worker thread once the part has a connection, so at most ``max_concurrency`` made parts exist at once."""
        path, bucket, obj = self._where(key)
        tier = self.tier

        # Parts are made on threads of their own: making one may wait for another process (seconds), and the
        # event loop's default executor is shared with the S3 client (address lookups) and other tiers.
        makers = ThreadPoolExecutor(tier.options.max_concurrency, thread_name_prefix="tiered_ckpt-parts")

        async def send_all() -> list[dict[str, Any]]:
            window = asyncio.Semaphore(tier.options.max_concurrency)
            loop = asyncio.get_running_loop()

            def made(body: memoryview | Callable[[], memoryview]) -> tuple[memoryview, dict[str, str]]:
                view = body if isinstance(body, memoryview) else body()
                return view, checksum_param(tier, view)  # here, not on the event loop (checksum_param)

            async def send(number: int, body: memoryview | Callable[[], memoryview]) -> dict[str, Any]:
                async with window:
                    view, extra = await loop.run_in_executor(makers, made, body)
                    resp = await tier.arequest(
                        f"upload part {number} of", key, path,
                        lambda: tier.fs._call_s3("upload_part", Bucket=bucket, Key=obj, UploadId=upload_id,
                                                 PartNumber=number, Body=RequestBody(view), **extra),
                        nbytes=len(view))
                entry = {"PartNumber": number, "ETag": resp["ETag"]}
                entry.update({k: resp[k] for k in _CHECKSUM_FIELDS if resp.get(k)})
                return entry

            # the first failure ends the upload: the parts not yet sent are not started
            return await gather_or_cancel([asyncio.ensure_future(send(n, b)) for n, b in parts])

        try:
            return tier.run_sync(send_all)
        finally:
            makers.shutdown(wait=True, cancel_futures=True)

    def complete(self, key: str, upload_id: str, parts: Sequence[dict[str, Any]], nbytes: int) -> None:
        """Complete the upload from every part's entry (in part-number order). The parts' checksums go with
        them only where the upload was created with a checksum algorithm (S3 refuses them otherwise), which the
        process that created it may not be."""
        path, bucket, obj = self._where(key)
        tier = self.tier
        entry = self._in_progress(key, upload_id) or {}
        keep = ("PartNumber", "ETag", *(_CHECKSUM_FIELDS if entry.get("ChecksumAlgorithm") else ()))
        ordered = [{k: p[k] for k in keep if k in p} for p in sorted(parts, key=lambda p: p["PartNumber"])]

        tries = [0]

        async def call() -> Any:  # the server may assemble the object for long before it answers: the patient client
            tries[0] += 1
            try:
                return await tier.patient_fs()._call_s3("complete_multipart_upload", Bucket=bucket, Key=obj,
                                                        UploadId=upload_id, MultipartUpload={"Parts": ordered})
            except FileNotFoundError:
                # NoSuchUpload on a second try: the first one completed, its answer lost (the store forgot the
                # upload since)? Then the object is there, made of these very parts.
                if tries[0] > 1 and await completed_as(tier, bucket, obj, ordered):
                    return None
                raise

        tier.run_sync(tier.arequest, "complete the shared multipart upload of", key, path, call, nbytes=nbytes)

    def completed_as(self, key: str, parts: Sequence[dict[str, Any]]) -> bool:
        """Whether ``key`` is the object these parts complete (its multipart ETag; False where the store's ETags
        are not MD5s): an earlier completion whose answer was lost."""
        path, bucket, obj = self._where(key)
        ordered = sorted(parts, key=lambda p: p["PartNumber"])
        return self.tier.run_sync(self.tier.arequest, "look up", key, path,
                                  lambda: completed_as(self.tier, bucket, obj, ordered))

    def publish(self, token: str, key: str, upload_id: str, **facts: Any) -> None:
        """Write the object ``token`` (an :func:`is_upload_token` name) saying which upload of ``key`` is shared,
        with ``facts`` the other processes check (JSON values)."""
        if not is_upload_token(token):
            raise ValueError(f"{token!r} is not an upload token's name (.<name>.{UPLOAD_TOKEN}.tmp-<16 hex>)")
        self.tier.write_blob(token, [json.dumps({**facts, "key": key, "upload": upload_id}).encode()])

    def published(self, token: str) -> dict[str, Any] | None:
        """What ``token`` says (``key``, ``upload`` and the publisher's facts); None when there is no such
        object."""
        try:
            raw = self.tier.read_blob(token).numpy().tobytes()
        except BlobNotFoundError:
            return None
        try:
            facts = json.loads(raw)
            str(facts["key"]), str(facts["upload"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"not an upload token ({exc}): remove it with gc", tier=self.tier.name,
                                  key=token) from None
        return dict(facts)

    def abort_published(self, token: str) -> None:
        """Abort the upload ``token`` names (if it is still open) and remove ``token``: what ``gc`` does with the
        token a dead job left."""
        try:
            named = self.published(token)
        except CorruptionError:
            named = None  # not ours to abort: the object alone goes
        if named is not None:
            self.abort(named["key"], named["upload"])
        path, _, _ = self._where(token)
        self.tier._remove_object(token, path)

    def abort(self, key: str, upload_id: str) -> None:
        """Abort the upload (an unknown one is not an error)."""
        self.tier.abort_multipart("abort the shared multipart upload of", key, upload_id)
