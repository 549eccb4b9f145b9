"""``shm``: blobs as files on a memory filesystem (``/dev/shm``); they survive the training process, not the
node.

Files live under ``{path}/{user}/{run_id}/``: the per-user directory is created 0700 (and refused if another
user owns it), files 0600. The tier checks, when built, that ``path`` is on tmpfs or ramfs and logs a loud
warning if not: a disk-backed "shm" turns a memory-speed snapshot into a disk write.

* **Capacity.** Before anything is allocated (``write_blob``, ``allocate_slot``) the free space of the
  filesystem (``statvfs``), less ``min_free``, is checked, and :class:`~tiered_ckpt.errors.CapacityError`
  names the tier, the key, the bytes needed and the bytes free. Slots are then reserved with
  ``posix_fallocate``, which fails with ENOSPC instead of letting a later page fault raise SIGBUS. In a
  container, tmpfs pages count against its memory limit, which the filesystem's free space does not show: an
  allocation of 16 MiB or more is also checked against what the memory cgroup leaves (``cgroup_memory.py``),
  keeping 1/16 of the limit for the process, so that the job gets an error instead of the OOM killer.
* **Slots** (``allocate_slot``) are files mapped ``MAP_SHARED`` and pre-faulted (``posix_fallocate`` allocates
  the tmpfs pages, ``MADV_POPULATE_WRITE`` or one write per page maps them), so the blocking copy of a save
  runs at memory speed instead of paying a page fault per 4 KiB (measured here: 0.7-2.8 GB/s into fresh pages,
  13-20 GB/s into pre-faulted ones). The mapping is kept and reused while the file is unchanged and large
  enough; a slot grows in place.
* **Reads** are zero-copy: the file is mapped copy-on-write (``MAP_PRIVATE``, read+write). Torch gets a
  writable buffer (no warning), nothing is copied until someone writes, and a caller that modifies a loaded
  tensor in place changes only its private pages, never the snapshot, which may be the only copy not yet
  drained. Pages it has not written keep following the file, so writes into a slot are visible through earlier
  reads of it. (Under strict overcommit, ``vm.overcommit_memory=2``, a private writable mapping is charged in
  full: load with copies there.)
* **Writes** of whole blobs go to a temporary file in the same directory, then ``rename`` (no fsync: tmpfs has
  no disk to sync).
* **Page-locking** (``pin``). In a process that copies from CUDA, each slot's mapping is registered with
  ``cudaHostRegister`` when it is allocated, so device-to-host copies into it run at DMA speed instead of through
  the driver's pageable staging path; it is unregistered before the mapping is dropped, replaced or grown, and at
  ``close``. ``auto`` (the default) pins only where this process has already initialised CUDA: the drain worker,
  which only maps slots to read them, and CPU-only jobs never touch CUDA. ``true`` insists (a
  :class:`~tiered_ckpt.errors.ConfigError` at the first slot where CUDA is not available); ``false`` never pins.
  A registration that fails is logged once per slot and the slot works unpinned.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import cuda_streams
from ..errors import CapacityError, ConfigError, PermanentTierError, TieredCkptError
from ..hostmem import madvise
from ..private_dirs import private_dir
from ..retry import FULL_ERRNOS
from ..validate import Size
from ._files import BlobFiles, FilesHousekeeping, make_dirs
from ._nofollow import check_dirs, check_size, refused_entry
from .base import (
    Capabilities,
    Chunk,
    Tier,
    TierContext,
    as_memoryview,
    check_key,
    check_prefix,
    file_in_path,
    not_a_directory,
)
from .cgroup_memory import memory_headroom

log = logging.getLogger(__name__)

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_PIN_WITHOUT_CUDA = ("pin is true but CUDA is not available in this process (no GPU, driver or CUDA build of "
                     "torch), so slots cannot be page-locked. Set pin: auto to pin only where the process uses "
                     "CUDA, or pin: false")
_CGROUP_CHECK_FROM = 16 << 20  # allocations this large are checked against the container's memory limit too
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python < 3.13 lacks the name
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_POPULATE_READ_MIN = 1 << 20  # below this, faulting pages in on first touch costs nothing worth a syscall


@dataclass(frozen=True)
class ShmOptions:
    path: str = "/dev/shm/tiered_ckpt"  # on tmpfs; blobs go to {path}/{user}/{run_id}/
    min_free: Size = 0  # headroom left free on the filesystem for everybody else
    # page-lock slots (cudaHostRegister) for device-to-host copies: "auto" where this process already uses CUDA
    pin: bool | Literal["auto"] = "auto"


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_table() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    try:
        with open("/proc/self/mountinfo") as f:
            out = []
            for line in f:
                left, sep, right = line.partition(" - ")
                if sep and len(left.split()) >= 5 and right.split():
                    out.append((_unescape(left.split()[4]), right.split()[0]))
            return out
    except OSError:
        pass
    try:
        with open("/proc/mounts") as f:
            return [(_unescape(p[1]), p[2]) for p in (line.split() for line in f) if len(p) >= 3]
    except OSError:
        return []


def filesystem_type(path: str) -> str:
    """The type (``tmpfs``, ``ext4``, ...) of the filesystem holding ``path`` (or its nearest existing
    parent), by the longest mount-point prefix; ``"unknown"`` where the mount table cannot be read."""
    path, tail = os.path.abspath(path), ""
    while not os.path.exists(path) and path != os.path.dirname(path):  # resolve links in what exists
        path, name = os.path.split(path)
        tail = os.path.join(name, tail) if tail else name
    path = os.path.join(os.path.realpath(path), tail) if tail else os.path.realpath(path)
    best, best_len = "unknown", -1
    for mount_point, fstype in _mount_table():
        mp = mount_point.rstrip("/") or "/"
        if (mp == "/" or path == mp or path.startswith(mp + "/")) and len(mp) >= best_len:
            best, best_len = fstype, len(mp)  # equal length: a later mount hides an earlier one
    return best


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


@dataclass
class _Slot:
    mm: mmap.mmap
    tensor: torch.Tensor
    dev: int
    ino: int
    pinned: bool = False  # registered with cudaHostRegister
    pin_tried: bool = False  # registration attempted (a failure is warned about once, not at every reuse)

    def release(self, tier: str = "", key: str = "") -> None:
        """Forget the slot. Never ``mm.close()``: tensors from ``torch.frombuffer`` hold a reference to the
        mmap object but no buffer export, so closing it would unmap memory they still point to (a segfault).
        The mapping goes away when the last tensor over it does; it is unregistered first, so CUDA never holds
        a registration of memory that is later unmapped (tensors still over it keep working, unpinned)."""
        if self.pinned and self.tensor is not None:
            error = cuda_streams.host_unregister(self.tensor.data_ptr())
            if error is not None:
                log.warning("tier %r: cudaHostUnregister of slot %s failed: %s", tier, key, error)
            self.pinned = False
        self.tensor = None  # type: ignore[assignment]
        self.mm = None  # type: ignore[assignment]


def shm_base(path: str, key_path: str | None = None, source: str | None = None) -> str:
    """``path`` made absolute; a :class:`ConfigError` at ``key_path`` where it names a file. The tier, the run's
    locks and the configuration's check all place things there, each before the others may have looked."""
    base = os.path.abspath(path)
    blocker = file_in_path(base)
    if blocker is not None:
        raise ConfigError(f"{not_a_directory(base, blocker)}: give the shm tier a directory on a tmpfs (the "
                          "default is /dev/shm/tiered_ckpt)", source=source, key_path=key_path)
    return base


class ShmTier(FilesHousekeeping, Tier):
    kind = "shm"
    capabilities = Capabilities(memory=True, node_local=True, survives_process=True,
                                atomic_rename=True, zero_copy_read=True)
    Options = ShmOptions

    def __init__(self, name: str, options: ShmOptions | None = None, context: TierContext | None = None):
        super().__init__(name, options, context)
        base = shm_base(self.options.path, key_path=f"tier {name!r}.path")
        self.filesystem_type = filesystem_type(base)
        if self.filesystem_type not in MEMORY_FILESYSTEMS:
            log.warning(
                "tier %r: shm path %s is on a %s filesystem, not tmpfs or ramfs. Snapshots there are disk "
                "writes, not memory copies: a save that should block for a second can block for a minute "
                "(DLRover users saw 50 s saves this way). Point `path` at a tmpfs mount such as /dev/shm.",
                name, base, self.filesystem_type)
        user, run_id = self.context.user, self.context.run_id
        for what, value in (("user", user), ("run_id", run_id)):
            if "/" in value or check_key(value) != value:
                raise PermanentTierError(f"{what} {value!r} cannot name a directory", tier=name)
        self.root = os.path.join(base, user, run_id)
        self._prepare_dirs(base, user)
        self.files = BlobFiles(name, self.root, file_mode=0o600, dir_mode=0o700, fsync=False,
                               full_error=CapacityError)
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()

    # ----- directories -------------------------------------------------------------------------------------
    def _prepare_dirs(self, base: str, user: str) -> None:
        try:
            if not os.path.isdir(base):
                os.makedirs(base, exist_ok=True)
                try:  # shared by every user of the node, like /tmp: sticky and world-writable
                    os.chmod(base, 0o1777)
                except OSError:
                    pass
            try:
                private_dir(os.path.join(base, user), "checkpoints")
            except TieredCkptError as exc:
                raise PermanentTierError(str(exc), tier=self.name) from None
            try:
                os.mkdir(self.root, 0o700)
            except FileExistsError:
                if not os.path.isdir(self.root):
                    raise PermanentTierError(f"{self.root} is not a directory", tier=self.name) from None
        except OSError as exc:
            raise PermanentTierError(f"cannot prepare {self.root}: {exc.strerror or exc}",
                                     tier=self.name) from exc

    # ----- capacity ----------------------------------------------------------------------------------------
    def free_bytes(self) -> int:
        """Bytes that may still be allocated: free space of the filesystem less ``min_free``."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize - self.options.min_free

    def _check_room(self, key: str, needed: int) -> None:
        if needed <= 0:
            return
        free = self.free_bytes()
        if needed > free:
            min_free = self.options.min_free
            if min_free:  # the filesystem's free space and the tier's own reserve, apart: either may be the cause
                room = (f"{_fmt(max(free, 0))} may be used on {self.root} ({self.filesystem_type}: "
                        f"{_fmt(free + min_free)} free, less min_free {_fmt(min_free)})")
                fix = "lower min_free, enlarge the tmpfs, free space, or hold fewer slots"
            else:
                room = f"only {_fmt(max(free, 0))} are free on {self.root} ({self.filesystem_type})"
                fix = "enlarge the tmpfs, free space, or hold fewer slots"
            raise CapacityError(f"needs {_fmt(needed)} but {room}; {fix}", tier=self.name, key=key)
        if needed < _CGROUP_CHECK_FROM:
            return  # records and small blobs: not worth reading the cgroup's files on the save path
        limit = memory_headroom()
        if limit is not None and needed > limit.available - limit.limit // 16:
            raise CapacityError(
                f"needs {_fmt(needed)} of shared memory, which counts against this container's memory limit: "
                f"{_fmt(limit.limit)} ({limit.where}), of which {_fmt(limit.used)} are in use (page cache not "
                f"counted) and 1/16 is left for the process itself. Allocating it would get the job killed "
                "for running out of memory. Raise the memory limit, or hold fewer or smaller slots",
                tier=self.name, key=key)

    # ----- blob primitives ---------------------------------------------------------------------------------
    def _ensure_root(self) -> None:
        """The run's directory, made again if a closing tier of another rank removed it while it was empty."""
        if not os.path.isdir(self.root):
            self._prepare_dirs(os.path.dirname(os.path.dirname(self.root)), self.context.user)

    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        check_key(key)
        self._ensure_root()
        nbytes = self.files.write(key, chunks, check=lambda _written, n: self._check_room(key, n))
        self._drop_slot(key)
        return nbytes

    def read_blob(self, key: str) -> torch.Tensor:
        return self.read_blob_hashed(key)

    def read_blob_hashed(self, key: str, hasher: Any = None, max_size: int | None = None) -> torch.Tensor:
        blob = self._map(key, max_size)
        if hasher is not None:
            hasher.update(as_memoryview(blob))
        return blob

    def _map(self, key: str, max_size: int | None) -> torch.Tensor:
        fd, st, path = self.files.open_regular(key)  # never a link or a FIFO: see _nofollow
        try:
            check_size(st.st_size, max_size, path, tier=self.name, key=key)
            if st.st_size == 0:
                return torch.empty(0, dtype=torch.uint8)
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, PROT_READ|PROT_WRITE
        except OSError as exc:
            raise self.files.error(exc, key, "map", path) from exc
        finally:
            os.close(fd)
        blob = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive as long as the tensor
        if st.st_size >= _POPULATE_READ_MIN:
            # Map every page in one call: a reader (the drain worker hashing and writing a snapshot) would otherwise
            # take one page fault per 4 KiB. Through ctypes, which lets go of the GIL (mmap.madvise holds it: about
            # 0.1 s per GiB during which the process's other threads would stand still). Kernels before 5.14
            # refuse it: pages then fault in on first touch.
            madvise(blob.data_ptr(), st.st_size, _MADV_POPULATE_READ)
        return blob

    def blob_identity(self, key: str) -> tuple | None:
        try:
            st = os.stat(self.files.path(key))
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size)

    def delete(self, key: str) -> None:
        check_key(key)
        self._drop_slot(key)
        self.files.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        prefix = check_prefix(prefix.rstrip("/") + "/")
        with self._lock:
            for key in [k for k in self._slots if k.startswith(prefix)]:
                self._slots.pop(key).release(self.name, key)
        self.files.delete_prefix(prefix)


    # ----- slots -------------------------------------------------------------------------------------------
    def allocate_slot(self, key: str, nbytes: int) -> torch.Tensor:
        check_key(key)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        path = self.files.path(key)
        pin = self._want_pin()  # before anything is allocated: `pin: true` without CUDA fails here
        self._ensure_root()
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                if slot.tensor.numel() >= nbytes and self._same_file(path, slot):
                    if pin and not slot.pin_tried:  # CUDA came up after the slot was made
                        self._pin(key, slot)
                    return slot.tensor
                self._slots.pop(key).release(self.name, key)  # unregistered before the file is remapped
            check_dirs(self.root, os.path.dirname(key), tier=self.name, key=key)
            try:
                make_dirs(self.root, os.path.dirname(key), 0o700)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            except OSError as exc:
                raise self.files.error(exc, key, "create", path) from exc
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):  # a FIFO or device where the slot file should be
                    raise refused_entry(path, st.st_mode, tier=self.name, key=key, error=PermanentTierError)
                size = max(nbytes, st.st_size)
                if size == 0:
                    return torch.empty(0, dtype=torch.uint8)
                self._check_room(key, size - st.st_blocks * 512)  # what the file does not hold yet
                self._reserve(fd, key, path, st.st_size, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise self.files.error(exc, key, "map", path) from exc
            finally:
                os.close(fd)
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
            _prefault(mm, tensor)
            slot = self._slots[key] = _Slot(mm, tensor, st.st_dev, st.st_ino)
            if pin:
                self._pin(key, slot)
            return tensor

    # ----- page-locking ------------------------------------------------------------------------------------
    @classmethod
    def check_usable(cls, options: ShmOptions) -> None:
        """At engine build: ``pin: true`` needs CUDA in this process (a ConfigError now, not at the first save)."""
        if options.pin is True and not torch.cuda.is_available():
            raise ConfigError(_PIN_WITHOUT_CUDA, key_path="pin")

    def _want_pin(self) -> bool:
        """Whether slots allocated now should be page-locked. Only slot allocation asks: readers (the drain
        worker maps slots through ``read_blob``) never pin, and ``auto`` touches no CUDA API at all in a process
        that has not initialised CUDA itself."""
        pin = self.options.pin
        if pin is False:
            return False
        if pin == "auto":
            return cuda_streams.cuda_in_use()
        if not torch.cuda.is_available():
            raise ConfigError(_PIN_WITHOUT_CUDA, key_path=f"tier {self.name!r}.pin")
        return True

    def _pin(self, key: str, slot: _Slot) -> None:
        """Register the slot's whole mapping; on failure warn and carry on unpinned (never fail the save)."""
        slot.pin_tried = True
        nbytes = slot.tensor.numel()
        error = cuda_streams.host_register(slot.tensor.data_ptr(), nbytes)
        if error is None:
            slot.pinned = True
            return
        log.warning("tier %r: cannot page-lock slot %s (%s) with cudaHostRegister: %s. The slot stays pageable: "
                    "device-to-host copies into it run slower (through the driver's staging buffer)",
                    self.name, key, _fmt(nbytes), error)

    def is_pinned(self, key: str) -> bool:
        """Whether the slot ``key`` (as last allocated here) is page-locked."""
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.pinned

    def _reserve(self, fd: int, key: str, path: str, old_size: int, size: int) -> None:
        """Grow the file to ``size`` and allocate every page now: ENOSPC here, never SIGBUS later."""
        if size > old_size:
            os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if size > old_size:
                os.ftruncate(fd, old_size)
            if exc.errno in FULL_ERRNOS:
                raise CapacityError(
                    f"cannot reserve {_fmt(size)} for a slot on {self.root} ({self.filesystem_type}): "
                    f"{exc.strerror}; {_fmt(max(self.free_bytes(), 0))} free",
                    tier=self.name, key=key) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise

    @staticmethod
    def _same_file(path: str, slot: _Slot) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (slot.dev, slot.ino)

    def _drop_slot(self, key: str) -> None:
        with self._lock:
            slot = self._slots.pop(key, None)
        if slot is not None:
            slot.release(self.name, key)

    def describe(self) -> str:
        return f"shm {self.root} ({self.filesystem_type})"

    def close(self) -> None:
        """Forget every slot mapping (unregistered first); then remove this run's directories that are empty
        (``{path}/{user}/{run_id}/`` and its ``rank_*``), so a run whose slots were all deleted leaves nothing."""
        with self._lock:
            slots, self._slots = list(self._slots.items()), {}
        for key, slot in slots:
            slot.release(self.name, key)
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            with contextlib.suppress(OSError):  # not empty (another rank's, kept snapshots), or gone already
                os.rmdir(os.path.join(self.root, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.root)


def _prefault(mm: mmap.mmap, tensor: torch.Tensor) -> None:
    """Map every page of a shared mapping writable now, keeping the content."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
        return
    except (OSError, ValueError, AttributeError):  # kernel < 5.14
        pass
    pages = tensor[:: mmap.PAGESIZE]
    pages.copy_(pages.clone())  # one write per page, of the byte already there
