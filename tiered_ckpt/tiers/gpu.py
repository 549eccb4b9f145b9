"""``gpu``: blobs as 1-D uint8 tensors in device memory, held by this process (gone when it exits).

The fastest place for a snapshot: a device-to-device copy. Works on any torch device (tests use ``cpu``).
``allocate_slot`` allocates once and hands back the same tensor while it is large enough. Before allocating,
the tier checks ``max_bytes`` (the sum of what it holds) and, on CUDA, the free device memory, and raises
:class:`~tiered_ckpt.errors.CapacityError` with the numbers instead of an out-of-memory error in the middle of
a save.

``enabled: auto`` turns the tier on only where the device exists: the engine calls :func:`resolve_enabled`.

On CUDA the snapshot is a device-to-device copy into a slot (``flat.copy_into``, called by ``save()``) and the
copies of ``write_blob`` run on a side stream of the device (:mod:`tiered_ckpt.cuda_streams`): after the work
already queued on the caller's stream, and waited for through an event, never a device-wide synchronize that
would also wait for the training kernels queued since. A slot is allocated on the caller's stream and written
on the side stream, which waits for the caller's stream first, so a block the allocator just reused is never
overwritten early; every copy into it is complete before the call returns, so a replaced slot is never freed
under a copy still running.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .. import cuda_streams, memcopy
from ..errors import BlobNotFoundError, CapacityError, ConfigError
from ..validate import Size
from .base import Capabilities, Chunk, Tier, TierContext, as_memoryview, check_key, check_prefix, check_range

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuOptions:
    device: str = "cuda"  # any torch device: "cuda", "cuda:1", "cpu" (tests), ...
    max_bytes: Size | None = None  # cap on the bytes this tier holds; None: what the device has free

    def __post_init__(self) -> None:
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f'device: expected a torch device such as "cuda", "cuda:0" or "cpu", '
                             f'got "{self.device}"') from None


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def availability(options: GpuOptions) -> tuple[bool, str]:
    """Whether ``options.device`` can be used in this process, and why (or why not)."""
    device = torch.device(options.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this process (no GPU, driver or CUDA build of torch)"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return False, f"device {options.device} does not exist ({count} CUDA devices)"
        return True, f"{options.device} of {count} CUDA devices"
    if device.type in ("cpu", "meta"):
        return device.type == "cpu", f"device {device.type}"
    module = getattr(torch, device.type, None)  # xpu, mps, ... expose is_available()
    is_available = getattr(module, "is_available", None)
    if callable(is_available) and not is_available():
        return False, f"torch reports device type {device.type!r} unavailable"
    return True, f"device {options.device}"


def resolve_enabled(enabled: bool | str, options: GpuOptions, *, name: str = "gpu") -> bool:
    """The engine's decision for a ``gpu`` tier's ``enabled`` setting (``true``, ``false`` or ``"auto"``).

    ``auto`` without the device: off, with one INFO line. ``true`` without it: a
    :class:`~tiered_ckpt.errors.ConfigError` (a job that asked for the GPU tier should not silently run
    without).
    """
    if enabled is False:
        return False
    ok, reason = availability(options)
    if ok:
        return True
    if enabled == "auto":
        log.info("tier %r (gpu, enabled: auto) is off: %s", name, reason)
        return False
    raise ConfigError(f"enabled is true but the device cannot be used: {reason}. Set enabled: auto to skip "
                      "this tier where there is no GPU, or pick another device",
                      key_path=f"tier {name!r}.enabled")


class GpuTier(Tier):
    kind = "gpu"
    capabilities = Capabilities(memory=True, node_local=True, survives_process=False,
                                atomic_rename=True, zero_copy_read=True)
    Options = GpuOptions

    def __init__(self, name: str, options: GpuOptions | None = None, context: TierContext | None = None):
        super().__init__(name, options, context)
        self.device = torch.device(self.options.device)
        self._blobs: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    @classmethod
    def availability(cls, options: GpuOptions) -> tuple[bool, str]:
        """Whether ``options.device`` can be used in this process, and why (or why not)."""
        return availability(options)

    @classmethod
    def staging_options(cls) -> GpuOptions:
        """Host memory of this process (``device: cpu``): where saves stage when the first tier is a file tier."""
        return GpuOptions(device="cpu")

    @staticmethod
    def resolve_enabled(enabled: bool | str, options: GpuOptions, *, name: str = "gpu") -> bool:
        """:func:`resolve_enabled` (module level), reachable from the class the registry returns."""
        return resolve_enabled(enabled, options, name=name)

    # ----- accounting --------------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return sum(t.numel() for t in list(self._blobs.values()))

    def _check_limit(self, key: str, nbytes: int, replacing: int = 0) -> None:
        """Would holding ``nbytes`` more (and ``replacing`` fewer) stay within ``max_bytes``?"""
        limit = self.options.max_bytes
        if limit is not None:
            held = self.held_bytes() - replacing
            if held + nbytes > limit:
                raise CapacityError(f"needs {_fmt(nbytes)} but max_bytes is {_fmt(limit)} and {_fmt(held)} "
                                    "are held; raise max_bytes or hold fewer slots", tier=self.name, key=key)

    def _empty(self, key: str, nbytes: int) -> torch.Tensor:
        """A new device buffer, after checking that the device has room for it."""
        if self.device.type == "cuda" and nbytes:
            free, _total = torch.cuda.mem_get_info(self.device)
            # memory torch's caching allocator holds but does not use is free for us too
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            if nbytes > free:
                raise CapacityError(f"needs {_fmt(nbytes)} but {self.device} has {_fmt(free)} free",
                                    tier=self.name, key=key)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise CapacityError(f"out of memory allocating {_fmt(nbytes)} on {self.device}: {exc}",
                                tier=self.name, key=key) from exc

    def _device_bytes(self, chunk: Chunk) -> torch.Tensor:
        """A 1-D uint8 view of a chunk: tensors stay where they are, host buffers become CPU tensors."""
        if isinstance(chunk, torch.Tensor):
            return chunk.detach().contiguous().reshape(-1).view(torch.uint8)
        mv = as_memoryview(chunk)
        if len(mv) == 0:
            return torch.empty(0, dtype=torch.uint8)
        if mv.readonly:  # torch cannot wrap read-only memory without a warning; `bytes` chunks are small
            mv = memoryview(bytearray(mv))
        return torch.frombuffer(mv, dtype=torch.uint8)

    # ----- blob primitives ---------------------------------------------------------------------------------
    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        check_key(key)
        old = self._blobs.get(key)
        replacing = old.numel() if old is not None else 0
        # On CUDA: copies on the device's side stream, complete when the block ends (readers on other threads
        # and streams see whole blobs). A streamed producer runs inside the block too, so its reuse of a device
        # buffer is queued on the side stream, behind the copy of the previous chunk.
        cuda = self.device.type == "cuda"
        streams = cuda_streams.on_side_streams([self.device]) if cuda else contextlib.nullcontext()
        with streams:
            if isinstance(chunks, (list, tuple)):  # sizes known: one buffer, filled in place
                views = [self._device_bytes(c) for c in chunks]
                total = sum(v.numel() for v in views)
                self._check_limit(key, total, replacing)
                out = self._empty(key, total)
                pos = 0
                for v in views:
                    out[pos:pos + v.numel()].copy_(v, non_blocking=cuda and v.device.type == "cuda")
                    pos += v.numel()
            else:  # a stream: copy each chunk as it comes (the producer may reuse its buffer), then join
                parts, total = [], 0
                for chunk in chunks:
                    v = self._device_bytes(chunk)
                    self._check_limit(key, total + v.numel(), replacing)
                    parts.append(self._empty(key, v.numel()).copy_(v, non_blocking=cuda and v.device.type == "cuda"))
                    total += v.numel()
                if len(parts) == 1:
                    out = parts[0]
                else:
                    out = self._empty(key, total)
                    if parts:
                        torch.cat(parts, out=out)
        with self._lock:
            self._blobs[key] = out  # one dict store: readers see the old tensor or the new one
        return total

    def _get(self, key: str) -> torch.Tensor:
        check_key(key)
        try:
            return self._blobs[key]
        except KeyError:
            raise BlobNotFoundError("no such blob", tier=self.name, key=key) from None

    def read_blob(self, key: str) -> torch.Tensor:
        return self._get(key)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        data = self._get(key)
        check_range(offset, length, data.numel(), tier=self.name, key=key)
        return bytes(as_memoryview(data[offset:offset + length]))

    def size(self, key: str) -> int:
        return self._get(key).numel()

    def exists(self, key: str) -> bool:
        return check_key(key) in self._blobs

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        return sorted(k for k in list(self._blobs) if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._blobs.pop(key, None)

    # ----- slots -------------------------------------------------------------------------------------------
    def allocate_slot(self, key: str, nbytes: int) -> torch.Tensor:
        check_key(key)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            old = self._blobs.get(key)
            if old is not None and old.numel() >= nbytes:
                return old
            # Release the smaller buffer first: device memory is the scarce resource, and a slot's content is
            # unspecified anyway.
            self._blobs.pop(key, None)
            del old
            self._check_limit(key, nbytes)
            if self.device.type == "cpu":
                # Pre-faulted, as a slot should be, and page-aligned (torch.empty gives 64 bytes past a page): a
                # layout's placement of tensors at file offsets modulo a page holds at the slot's addresses, for
                # the staging tier's direct writes too.
                try:
                    out = memcopy.fresh_buffer(nbytes)
                except MemoryError as exc:
                    raise CapacityError(f"no host memory for a slot of {_fmt(nbytes)}: {exc}; a snapshot needs "
                                        "its size in host memory: free some, or save less per rank",
                                        tier=self.name, key=key) from exc
            else:
                out = self._empty(key, nbytes)
            self._blobs[key] = out
            return out

    def describe(self) -> str:
        limit = f", max {_fmt(self.options.max_bytes)}" if self.options.max_bytes is not None else ""
        return f"gpu {self.device}{limit}"

    def close(self) -> None:
        """Drop every blob: they live only in this process, and closing frees the device memory."""
        with self._lock:
            self._blobs.clear()

