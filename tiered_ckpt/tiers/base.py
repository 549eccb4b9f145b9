"""The tier contract: a handful of storage primitives. Everything else is written once above them.

A tier stores *blobs* under *keys*: relative, ``/``-separated paths such as
``iter_0000010/mp_rank_00/model_optim_rng.pt``. The commit protocol, retention, checksums, compression and
retries live in the engine and call only these primitives, so a new kind of storage is one small class (and
``tiered_ckpt.testing`` checks it).

Semantics every tier guarantees (the contract suite tests each):

* ``write_blob(key, chunks)`` stores the concatenation of ``chunks`` under ``key``, replacing any previous
  blob. A reader never sees a partially written blob under ``key``: either the old one, the new one or (on
  failure) nothing new. Returns the number of bytes written. ``chunks`` is consumed in order and each chunk is
  written (or copied) before the next one is requested, so a producer may reuse one buffer for every chunk. An
  exception raised by the producer propagates unchanged, after the tier removed what it had written.
* ``read_blob(key)`` returns the whole blob as a 1-D ``torch.uint8`` tensor (on the tier's device). Tiers
  whose ``capabilities.zero_copy_read`` is true return a view of the stored bytes instead of a copy. A tensor
  returned by ``read_blob`` is not changed by a later ``write_blob``/``publish`` of the same key (they replace
  the blob); writes into a *slot* (below) are visible through zero-copy views of it.
* ``read_range(key, offset, length)`` returns ``bytes`` of one part of the blob; a range outside the blob is a
  :class:`~tiered_ckpt.errors.TierError`.
* ``size``, ``exists``, ``list(prefix)``, ``delete`` (a missing key is not an error) and ``delete_prefix``.
  ``list(prefix)`` returns every key that starts with ``prefix``, as a plain string prefix the way object
  stores list (``list("iter_")`` matches ``iter_0000010/x.pt``; end the prefix with ``/`` to list one
  directory), recursively and sorted. Temporary names of writes in progress are never listed.
* ``publish(key, data)`` stores a small object atomically (manifests, trackers): same visibility rule as
  ``write_blob``; separate because some media have a cheaper path for small objects.
* Missing keys raise :class:`~tiered_ckpt.errors.BlobNotFoundError`; transient failures
  :class:`~tiered_ckpt.errors.TransientTierError` (or an exception the retry policy classifies as transient);
  anything else is permanent.

Memory tiers (``capabilities.memory``) also hold *slots*: buffers allocated and pre-faulted once, then reused
by every save (``allocate_slot``), so the blocking copy never pays for page faults.

Capabilities may depend on the options (an ``fsspec`` tier on ``memory://`` is volatile, one on ``s3://`` is
not): ``Tier.capabilities_for(options)`` answers for a configuration, ``tier.capabilities`` for a constructed
tier.
"""

from __future__ import annotations

import getpass
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import BlobNotFoundError, BlobTooLargeError, RangeError, TierError

Chunk = Any  # bytes, bytearray, memoryview, numpy array or a 1-D uint8 torch tensor (any device)


class StableChunks(list):
    """Chunks whose memory stays valid and unchanged until the write consuming them returns (a snapshot's views
    of its pinned slot, a blob just read from a tier above). A tier may keep views of them past the next chunk: S3
    sends its parts straight from them, with no copy and no wait at each chunk's end. The chunks of any other
    iterable belong to their producer again once the next one is asked for. Streams that hand chunks on unchanged
    say so with a ``stable`` attribute of their own (:func:`chunks_stable`)."""

    stable = True


class StableStream:
    """Chunks made one at a time with the promise of :class:`StableChunks`: each is a view of memory that stays
    as it is until the write consuming them returns, or a buffer of its own that nothing reuses."""

    stable = True

    def __init__(self, chunks: Iterable[Chunk]):
        self._chunks = chunks

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self._chunks)


def chunks_stable(chunks: Iterable[Chunk]) -> bool:
    """Whether ``chunks`` (a :class:`StableChunks` or a stream passing one on) promises stable memory."""
    return bool(getattr(chunks, "stable", False))

# The block O_DIRECT writes are aligned to (it covers the logical block size of every device we meet). Slots place
# items, and the flat and torch codecs place tensors, on it, so the ``local`` tier writes them without a copy.
IO_BLOCK = 4096


@dataclass(frozen=True)
class Capabilities:
    memory: bool = False  # holds snapshot slots (gpu, shm)
    node_local: bool = True  # each node sees its own copy (False: one shared store for the whole job)
    survives_process: bool = True  # a blob outlives the process that wrote it
    atomic_rename: bool = True  # write_blob/publish use rename (False: object stores, where puts are atomic)
    zero_copy_read: bool = False


def exception_text(exc: BaseException) -> str:
    """``Type: message`` of a store's exception; one without a message (a timeout of asyncio's, of a socket's)
    says so instead of ending in a bare colon (an S3 user's trial: "TimeoutError: ")."""
    detail = str(exc) or ("no answer within the timeout" if isinstance(exc, TimeoutError) else "no detail given")
    return f"{type(exc).__name__}: {detail}"


def worker_source(caps: Sequence[Capabilities]) -> int | None:
    """Where a drain worker process (``drain.mode: process``) reads its snapshots, for tiers of these capabilities
    in pipeline order: the index of the first memory tier whose slots outlive the process. None when the drain
    must run in the training process: no such tier, or a tier after it keeps its blobs in the memory of the
    process that writes them (``survives_process=False``, fsspec's ``memory://``): a worker would write them into
    its own memory, to vanish with it, after reporting them committed (a plugin author's trial)."""
    shared = next((i for i, c in enumerate(caps) if c.memory and c.survives_process), None)
    if shared is None or any(not c.survives_process for c in caps[shared + 1:]):
        return None
    return shared


@dataclass(frozen=True)
class TierContext:
    """Who is using the tier: used to namespace memory tiers and lock files."""

    run_id: str = "default"
    rank: int = 0
    local_rank: int = 0
    user: str = field(default_factory=lambda: _user_name())
    host: str = field(default_factory=socket.gethostname)


def _user_name() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return f"uid{os.getuid()}"


@dataclass(frozen=True)
class UnfinishedUpload:
    """An upload a store keeps neither completed nor aborted (an S3 multipart upload whose process died): not a
    key :meth:`Tier.list` returns, yet its parts take space (S3 bills them) until it is aborted."""

    key: str  # the key it was going to create, relative to the tier
    upload_id: str
    nbytes: int  # the bytes of its parts on the store
    modified: float | None  # when its newest part arrived (its start if none), seconds since the epoch; None: unknown


@dataclass(frozen=True)
class NoOptions:
    """For kinds that take no options of their own."""


def first_missing_dir(path: str) -> str | None:
    """The outermost directory of ``path`` (absolute) that does not exist (``path`` itself when only it is
    missing), or None when ``path`` exists."""
    missing = None
    here = path
    while not os.path.lexists(here):
        missing, parent = here, os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return missing


def file_in_path(path: str) -> str | None:
    """The file that stands where ``path`` (absolute) or one of its parents must be a directory, or None: a tier
    told to use ``/data/ckpt`` where ``/data`` is a file fails at its configuration's key, not in a drain."""
    missing = first_missing_dir(path)
    here = path if missing is None else os.path.dirname(missing)
    if here == missing:  # nothing of it exists, not even its root
        return None
    return None if os.path.isdir(here) else here


def not_a_directory(path: str, blocker: str) -> str:
    """The start of the error for :func:`file_in_path`'s answer."""
    return f"{blocker} is a file, not a directory" + ("" if blocker == path else f" (in the tier's path {path})")


def check_key(key: str) -> str:
    """Keys are relative ``/`` paths without ``..``, empty or absolute parts (manifests are data, not code).
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid key {key!r}: expected a non-empty relative path")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid key {key!r}: absolute paths, backslashes and NUL are not allowed")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"invalid key {key!r}: empty, '.' and '..' path components are not allowed")
    return key


def check_prefix(prefix: str) -> str:
    """A prefix is empty (everything) or a key, optionally ending in ``/``."""
    if prefix == "":
        return prefix
    check_key(prefix.rstrip("/"))
    return prefix



def check_range(offset: int, length: int, size: int, *, tier: str | None, key: str) -> None:
    """The bounds every ``read_range`` checks: ``offset + length`` within a blob of ``size`` bytes."""
    if offset < 0 or length < 0 or offset + length > size:
        raise RangeError(f"range {offset}+{length} is outside the blob of {size} bytes", tier=tier, key=key)

def as_memoryview(chunk: Chunk) -> memoryview:
    """A flat byte view of a host chunk, without copying."""
    if isinstance(chunk, torch.Tensor):
        if chunk.device.type != "cpu":
            chunk = chunk.cpu()
        # reshape before view: a 0-d tensor cannot be viewed as bytes of another element size
        chunk = chunk.detach().contiguous().reshape(-1).view(torch.uint8)
        if chunk.numel() == 0:
            return memoryview(b"")
        return memoryview(chunk.numpy()).cast("B")
    mv = memoryview(chunk)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise ValueError(f"a chunk must be C-contiguous to be written without a copy, got a "
                         f"{type(chunk).__name__} with strides {mv.strides}")
    return mv.cast("B")


def bytes_to_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``data`` (zero-copy for writable buffers; read-only ones are copied once)."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8)


class Tier(ABC):
    """Base class of every tier kind. Subclasses set ``kind``, ``capabilities`` and ``Options``."""

    kind: ClassVar[str] = "abstract"
    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type] = NoOptions

    def __init__(self, name: str, options: Any = None, context: TierContext | None = None):
        self.name = name
        self.options = options if options is not None else self.Options()
        self.context = context or TierContext()

    @classmethod
    def capabilities_for(cls, options: Any) -> Capabilities:
        """The capabilities of a tier of this kind built with ``options`` (default: the class's).

        Kinds whose capabilities depend on the options override this and set ``self.capabilities`` to the same
        value in ``__init__``; code holding a tier reads ``tier.capabilities``.
        """
        return cls.capabilities

    # ----- blob primitives ---------------------------------------------------------------------------------
    @abstractmethod
    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        """Store the chunks, in order, as the blob ``key``; the number of bytes. A chunk is the producer's again
        once the next one is asked for, unless :func:`chunks_stable` says they all stay until this returns."""

    def write_private_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        """``write_blob`` for a blob only tiered_ckpt reads back (files of the ``flat`` codec): the tier may store
        it in a form other programs would not read as one file, if that is faster (S3 with ``split_blobs``). Every
        other primitive still sees one blob under ``key``. Default: ``write_blob``."""
        return self.write_blob(key, chunks)

    @abstractmethod
    def read_blob(self, key: str) -> torch.Tensor:
        """The blob's bytes as a 1-D uint8 tensor that does not change while the caller holds it (a new buffer, or a
        mapping of a file that is only ever replaced, never rewritten in place): a copy of the blob to another tier
        sends views of it (:class:`StableChunks`)."""

    def read_blob_hashed(self, key: str, hasher: Any = None, max_size: int | None = None) -> torch.Tensor:
        """``read_blob``, feeding the bytes to ``hasher.update`` (if given) in order.

        ``max_size``: the size the manifest records. A larger blob is a
        :class:`~tiered_ckpt.errors.CorruptionError`; the built-in kinds refuse it before reading a byte (a
        file far larger than it should be is never read whole), this default after reading. Tiers that can hash
        while they read (``local``: pieces hashed as they arrive) override it; this default hashes after reading.
        """
        blob = self.read_blob(key)
        if max_size is not None and blob.numel() > max_size:
            raise BlobTooLargeError(f"the blob is {blob.numel()} bytes, more than the {max_size} bytes its "
                                    "manifest records", size=blob.numel(), max_size=max_size, tier=self.name, key=key)
        if hasher is not None:
            hasher.update(as_memoryview(blob))
        return blob

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        data = self.read_blob(key)
        check_range(offset, length, data.numel(), tier=self.name, key=key)
        return bytes(as_memoryview(data[offset:offset + length]))

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (a directory-like prefix; a trailing ``/`` is implied)."""
        prefix = check_prefix(prefix.rstrip("/") + "/")
        for key in self.list(prefix):
            self.delete(key)

    def publish(self, key: str, data: bytes) -> None:
        self.write_blob(key, [data])

    def stored_bytes(self, prefix: str) -> int:
        """Bytes the tier holds under ``prefix`` (a directory-like prefix), for what ``ls`` and ``gc`` report of a
        partial step: whatever the tier stores for those keys (the S3 tier's pieces of split blobs, even of a
        blob never finished). Default: the sizes of ``list(prefix)``, less keys deleted meanwhile."""
        total = 0
        for key in self.list(check_prefix(prefix.rstrip("/") + "/")):
            try:
                total += self.size(key)
            except BlobNotFoundError:
                pass
        return total

    # ----- memory tiers ------------------------------------------------------------------------------------
    def allocate_slot(self, key: str, nbytes: int) -> torch.Tensor:
        """A writable, pre-faulted 1-D uint8 buffer of at least ``nbytes`` stored as blob ``key``.

        An existing slot of sufficient size is reused (the same memory; its content is unspecified), a smaller
        one replaced. The returned tensor is the whole slot, so ``size(key)`` equals its ``numel()``, which
        may exceed ``nbytes`` after a reuse. Writes into it are visible to ``read_blob(key)`` without another
        call. A ``write_blob``/``publish``/``delete`` of ``key`` detaches the slot (the old buffer stays valid
        for whoever holds it). Fails with :class:`~tiered_ckpt.errors.CapacityError` before allocating when
        there is no room. Only memory tiers implement this.
        """
        raise TierError(f"kind {self.kind!r} holds no slots", tier=self.name, key=key)

    def blob_identity(self, key: str) -> tuple | None:
        """Something that changes whenever ``key`` is replaced or resized (None: unknown). Readers that map a
        blob may keep a mapping while the identity holds (the drain worker re-reads each slot every save)."""
        return None

    # ----- what the engine, gc and the CLI ask of every kind (docs/plugins.md; the contract suite checks it) -----
    @classmethod
    def resolve_enabled(cls, enabled: bool | str, options: Any, *, name: str = "") -> bool:
        """Whether a tier configured with ``enabled`` (``True``, ``False`` or ``"auto"``) runs on this machine.

        Default: off only for ``False``. A kind that needs something the machine may lack (the ``gpu`` kind: a
        device) overrides it: ``"auto"`` without it is ``False`` (say why in one INFO line), ``True`` without it a
        :class:`~tiered_ckpt.errors.ConfigError` whose ``key_path`` is ``"enabled"``.
        """
        return enabled is not False

    @classmethod
    def check_usable(cls, options: Any) -> None:
        """What only this machine can tell about ``options``, checked when an engine is built (before any save):
        raise :class:`~tiered_ckpt.errors.ConfigError` with the option's name as ``key_path``. Default: nothing."""
        return None

    @classmethod
    def staging_options(cls) -> Any | None:
        """Options for a tier of this kind that stages saves in this process's host memory (used when the first
        configured tier is a file tier, so a save still blocks only for a memory copy), or None when the kind
        cannot: it must then be a memory tier that does not outlive the process. Default: None."""
        return None

    @property
    def location(self) -> str | None:
        """Where the blobs are, as a user would name it (a directory, a URL without credentials) for messages and
        ``tiered-ckpt ls``; None for memory no other process can open. Default: None."""
        return None

    def missing_location(self) -> str | None:
        """Why this tier's location does not exist yet (``"no such bucket 'b'"``), or None when it does or the kind
        cannot tell, so the CLI says so instead of "no checkpoints". Read-only: creates nothing. Raise
        :class:`~tiered_ckpt.errors.TierError` when the store could not be asked. Default: None."""
        return None

    def temp_files(self) -> list[str]:
        """Keys of temporary files that unfinished writes left (a process killed before its rename), for
        ``tiered-ckpt gc``; never a key :meth:`list` returns. Default: none (a kind whose writes leave nothing
        half-written behind, such as process memory or object-store uploads)."""
        return []

    def modified(self, key: str) -> float | None:
        """When the blob or temporary file ``key`` last changed (seconds since the epoch), or None when the kind
        cannot tell or ``key`` is gone. ``gc`` removes only temporary files older than its grace period, so a kind
        that answers None keeps its temporary files until ``gc --min-age 0``. Default: None."""
        return None

    def remove_temp_file(self, key: str) -> None:
        """Delete one key :meth:`temp_files` returned (a missing one is not an error); refuse any other key with
        ``ValueError``. Default: refuses every key (the default lists none)."""
        raise ValueError(f"{key!r} is not a temporary file of tier {self.name!r} (kind {self.kind!r} lists none)")

    def unfinished_uploads(self, min_age_s: float = 0.0,
                           keys: Callable[[str], bool] | None = None) -> list[UnfinishedUpload]:
        """Uploads under this tier that were started and neither completed nor aborted: what a process killed
        mid-upload leaves on an object store, for ``tiered-ckpt gc``. One started less than ``min_age_s`` ago,
        or whose key ``keys`` refuses, may be left out without a look at its parts. Default: none (a kind without
        such uploads; its half-written files are :meth:`temp_files`)."""
        return []

    def abort_upload(self, upload: UnfinishedUpload) -> None:
        """Abort one upload :meth:`unfinished_uploads` returned, freeing its parts (one already gone is not an
        error). Default: refuses every upload with ``ValueError`` (the default lists none)."""
        raise ValueError(f"upload {upload.upload_id!r} of {upload.key!r} is not an unfinished upload of tier "
                         f"{self.name!r} (kind {self.kind!r} lists none)")

    def positional(self) -> Any:
        """A writer of one file at known offsets, shared by several processes (``open``, ``write_range``,
        ``pwrite``, ``truncate``, ``sync``, ``close``, ``rename``: :class:`~._positional.PositionalFiles`), or None
        when this tier cannot (object stores). The ``megatron`` layout's ranks write Megatron's file in place
        through it. Default: None."""
        return None

    def shared_parts(self) -> Any:
        """Multipart uploads of one object whose parts several processes send (``create``, ``alive``,
        ``upload``, ``complete``, ``abort``, and S3's part limits: :class:`~._s3_parts.SharedParts`), or None when
        this tier has none. The ``megatron`` layout's ranks upload their ranges of Megatron's file through it
        where the tier has no :meth:`positional` writer. Default: None."""
        return None

    def describe(self) -> str:
        """One line for logs and ``tiered-ckpt ls``: where this tier keeps its blobs."""
        return f"{self.kind}"

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release handles (mappings, connections). Stored blobs stay."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.describe()}>"
