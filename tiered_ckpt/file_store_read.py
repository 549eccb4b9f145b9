"""The reading half of :class:`~tiered_ckpt.file_store.FileStore`: which steps a file tier has committed (and
which hold a rank's part, or a Megatron-written checkpoint), their manifests, and each file's bytes read with
retries, checked against the manifest and decoded (docs/architecture.md, "The two protocols")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .checksum import hasher_for
from .codecs.file_codecs import FileCodec
from .compression import decompress_to_tensor
from .errors import BlobNotFoundError, BlobTooLargeError, CorruptionError, DecodeError
from .file_streams import check_entry
from .layouts.base import Layout
from .manifest import CheckpointManifest, FileEntry, RankManifest, load_checkpoint, load_rank
from .parallel import ParallelLayout, RankCoords
from .tiers.base import Tier, as_memoryview

log = logging.getLogger("tiered_ckpt.file_store")

# A manifest lists a step's files (a few hundred bytes each), not its tensors: even a 10,000-rank job's stays far
# below this. A larger file where a manifest should be is not one we wrote, and is never read into memory.
MAX_MANIFEST_BYTES = 64 << 20


class CommittedFiles:
    """Discovering and reading committed steps; :class:`~tiered_ckpt.file_store.FileStore` sets the attributes
    below and provides ``name``, ``_retry`` and ``read_tracker``."""

    tier: Tier
    layout: Layout
    codecs: dict[str, FileCodec]
    _manifests: dict[int, CheckpointManifest]
    _manifest_changes: int
    _manifest_lock: threading.Lock
    _told_unreadable: set[tuple[int, str]]
    name: str
    _retry: Callable[..., Any]
    read_tracker: Callable[[], int | None]

    # ----- discovering and reading -------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        return sorted(self.layout.committed_in(self.tier.list("")))

    def read_manifest(self, step: int, *, cached: bool = False) -> CheckpointManifest:
        if cached and step in self._manifests:
            return self._manifests[step]
        key = self.layout.manifest_key(step)
        changes = self._manifest_changes
        manifest = load_checkpoint(self._manifest_bytes(key), key, self.name)
        with self._manifest_lock:  # a commit of this process since the read began: these bytes may be the old ones
            if self._manifest_changes == changes:
                self._manifests[step] = manifest
        return manifest

    def steps_for_rank(self, coords: RankCoords) -> list[int]:
        """Committed steps that hold this rank's part (a node-local tier's manifest covers only its node).

        Steps saved with another parallel layout are listed too: ``load()`` re-splits them where the format
        allows (DP changes of Megatron's items) or says clearly what changed."""
        rank = coords.rank
        # Transient errors (a throttled object store, EAGAIN) are retried here as on the load path: a listing
        # that gave up at once would hide the tier's newest step from this rank alone.
        steps = self._retry(self.committed_steps, None, rank, "list committed steps")
        for stale in set(self._manifests) - set(steps):
            self._manifests.pop(stale, None)  # a listing of load() may run beside the drain's own
        out = []
        for step in steps:
            try:
                manifest = self._retry(lambda s=step: self.read_manifest(s, cached=True), step, rank,
                                       f"read {self.layout.manifest_key(step)}")
            except BlobNotFoundError:
                continue  # removed since it was listed
            except CorruptionError as exc:
                if (step, str(exc)) not in self._told_unreadable:  # a load lists more than once: said once
                    self._told_unreadable.add((step, str(exc)))
                    log.warning("tier %r lists step %d as committed, but %s", self.name, step, exc)
                out.append(step)  # listed as committed, unreadable: load() reports it (a fallback) if it is chosen
                continue
            same_layout = ParallelLayout.from_dict(manifest.parallel) == coords.layout
            if not same_layout or rank in manifest.extra.get("ranks", range(manifest.world_size)):
                out.append(step)
        return out

    def legacy_step(self) -> int | None:
        """The step a Megatron-written checkpoint on this tier (no manifest) names in its tracker, if any."""
        if self.tier.list(self.layout.tracker) != [self.layout.tracker]:
            return None
        step = self.read_tracker()
        if step is None or self.tier.exists(self.layout.manifest_key(step)):
            return None
        return step if self.tier.list(self.layout.step_dir(step) + "/mp_rank_") else None

    def read_rank_manifest(self, step: int, rank: int) -> RankManifest:
        key = self.layout.rank_manifest_key(step, rank)
        return load_rank(self._manifest_bytes(key), key, self.name)

    def _manifest_bytes(self, key: str) -> bytes:
        # A file far larger than any manifest is refused unread: by the read itself where the kind refuses before
        # reading (every built-in one: one request on an object store, not a HEAD and a GET), else asked first.
        if type(self.tier).read_blob_hashed is Tier.read_blob_hashed:  # the default reads, then checks
            size = self.tier.size(key)
            if size > MAX_MANIFEST_BYTES:
                raise self._not_a_manifest(key, size)
        try:
            return as_memoryview(self.tier.read_blob_hashed(key, None, max_size=MAX_MANIFEST_BYTES)).tobytes()
        except BlobTooLargeError as exc:
            raise self._not_a_manifest(key, exc.size) from None

    def _not_a_manifest(self, key: str, size: int) -> CorruptionError:
        return CorruptionError(f"{size} bytes where a manifest should be (ours stay below {MAX_MANIFEST_BYTES}): "
                               "not a manifest this library wrote (a load falls back to another tier or step; "
                               "look at the file and remove it)", tier=self.name, key=key)

    def verify(self, entry: FileEntry, blob: torch.Tensor, hexdigest: str | None = None) -> None:
        """Raise CorruptionError unless ``blob`` is the file the manifest describes. ``hexdigest``: the blob's
        digest under this build's algorithm, if already computed while reading it."""
        if blob.numel() == entry.size and hexdigest is None and (hasher := hasher_for(entry.checksum)) is not None:
            hasher.update(as_memoryview(blob))
            hexdigest = hasher.hexdigest()
        check_entry(entry, blob.numel(), hexdigest or "", tier=self.name)

    def read_verified(self, entry: FileEntry, step: int | None, rank: int, *, verify: bool = True) -> torch.Tensor:
        """The stored bytes of ``entry`` (with retries), checked against the manifest when ``verify``: a
        :class:`CorruptionError` naming the file otherwise. Nothing of a file that fails the check is returned.

        The checksum is computed while the tier reads (``Tier.read_blob_hashed``: the ``local`` tier hashes its
        parallel pieces as they arrive), not in a second pass over the bytes."""
        hash_it = verify and hasher_for(entry.checksum) is not None

        def attempt() -> tuple[torch.Tensor, str | None]:
            hasher = hasher_for(entry.checksum) if hash_it else None
            blob = self.tier.read_blob_hashed(entry.key, hasher, max_size=entry.size)
            return blob, hasher.hexdigest() if hasher is not None else None

        blob, hexdigest = self._retry(attempt, step, rank, f"read {entry.key}")
        if verify:
            self.verify(entry, blob, hexdigest)
        return blob

    def decode_stored(self, entry: FileEntry, blob: torch.Tensor) -> torch.Tensor:
        if entry.compression is None:
            return blob
        if entry.compression != "zstd":
            raise CorruptionError(f"unknown compression {entry.compression!r}", tier=self.name, key=entry.key)
        if entry.raw_size is None:
            raise CorruptionError("compressed file without raw_size in the manifest", tier=self.name, key=entry.key)
        return decompress_to_tensor(blob, entry.raw_size, where=entry.key, tier=self.name)

    def load_rank(self, manifest: CheckpointManifest, coords: RankCoords, *, verify: bool = True, copy: bool = True,
                  map_location: Any = None, trust_pickles: bool = False) -> dict[str, Any]:
        items: dict[str, Any] = {}
        for entry in self.layout.files_for_rank(manifest.files, manifest.parallel, coords):
            blob = self.read_verified(entry, manifest.step, coords.rank, verify=verify)
            items[entry.item] = self.decode_entry(entry, blob, copy=copy, map_location=map_location,
                                                  trust_pickles=trust_pickles)
        return items

    def decode_entry(self, entry: FileEntry, blob: torch.Tensor, *, copy: bool = True, map_location: Any = None,
                     trust_pickles: bool = False) -> Any:
        """The item in ``entry``'s file, from its bytes as stored (``blob``, already verified)."""
        raw = self.decode_stored(entry, blob)
        if entry.meta.get("byte_grouping") and entry.compression is None:
            raw = raw.clone()  # un-grouping works in place; never on the tier's own bytes
        try:
            codec = self.codecs[entry.codec]
        except KeyError:
            raise CorruptionError(f"unknown codec {entry.codec!r}", tier=self.name, key=entry.key) from None
        try:
            # Bytes read from a file tier are this process's own: views into them are already a copy.
            private = raw is not blob or not self.tier.capabilities.zero_copy_read
            return codec.decode(raw, copy=copy and not private, map_location=map_location,
                                trust_pickles=trust_pickles, where=entry.key,
                                byte_grouping=bool(entry.meta.get("byte_grouping")))
        except DecodeError as exc:
            raise CorruptionError(str(exc), tier=self.name, key=entry.key) from None
