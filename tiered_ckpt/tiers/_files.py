"""What the file tiers (``local``, ``shm``, ``fsspec`` on a local path) share: temporary names, atomic writes,
listing, error mapping, and opening files without following links.

A write goes to a temporary file in the target directory, then ``rename`` replaces the key in one step.
Temporary names look like ``.{basename}.tmp-{16 hex digits}``: hidden, recognisable by :func:`is_temp_name`
(listings skip them; ``gc`` finds the ones a crash left behind) and unlikely to collide with a real key. A temporary
file that vanishes before its rename (a concurrent ``gc --delete``) fails that write attempt as transient: the
engine's retry writes the file again.

Nothing below the tier's root is followed or opened blindly (the root itself may be a link: the user chose it):

* directories are walked one component at a time with ``O_NOFOLLOW`` (``openat`` on the parent's descriptor),
  and files opened ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` before a byte is read, so a symbolic
  link, a FIFO, a socket or a device where a blob should be is a :class:`~tiered_ckpt.errors.CorruptionError`
  naming the path (loads fall back to the next tier) instead of a read of another file or a read that never
  returns; writes through such a directory are refused (:class:`~tiered_ckpt.errors.PermanentTierError`);
* listings never descend into a linked directory (and log it); deletions never reach through one;
* a read given the size its manifest records (``max_size``) refuses a larger file before reading it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..crashpoints import crash_point
from ..errors import BlobNotFoundError, CorruptionError, PermanentTierError, TierError, TransientTierError
from ..hostmem import FileShrankError, buffered_io, direct_mode, read_file
from ..retry import FULL_ERRNOS, TRANSIENT_ERRNOS, repeat_on
from ._direct_io import DIRECT_MIN, DirectWriter
from ._nofollow import check_dirs, check_size, open_parent, open_regular, real_dir, refused_entry
from .base import IO_BLOCK, as_memoryview, check_key, check_prefix, check_range, chunks_stable

log = logging.getLogger(__name__)

TEMP_MARKER = ".tmp-"
_TEMP_RE = re.compile(r"^\..+\.tmp-[0-9a-f]{16}$")
_MAX_IOV = 512  # chunks per writev call (IOV_MAX is 1024 on Linux)
_WRITE_MAX = 1 << 30  # bytes per write call (Linux caps one write at 2 GiB - 4 KiB)



def walk_strict(top: str, root: str, on_link: Callable[[str], None] | None = None):
    """``os.walk(top)`` that raises what it meets (EACCES, ENOTDIR, ELOOP: "could not look") instead of skipping
    it silently, and never follows a link below ``root``. A ``top`` that does not exist lists as empty (nothing
    there), and so does a ``top`` below a file (a blob, not a directory) or a link, which is reported to
    ``on_link(path)``; a ``root`` that is not a directory is an error."""
    try:
        st = os.stat(root)  # the root may be a link: the user's choice
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), root)
    if top != root:
        path = root
        for part in os.path.relpath(top, root).split(os.sep):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return
            if stat.S_ISLNK(st.st_mode) and on_link is not None:
                on_link(path)
            if not stat.S_ISDIR(st.st_mode):
                return

    def fail(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):  # a directory removed while listing: gone, not unreadable
            raise exc

    yield from os.walk(top, onerror=fail)


def temp_name(basename: str) -> str:
    return f".{basename}{TEMP_MARKER}{secrets.token_hex(8)}"


def is_temp_name(name: str) -> bool:
    """True for the last path component of a temporary file of a write in progress (or a crashed one)."""
    return bool(_TEMP_RE.match(name.rsplit("/", 1)[-1]))


def tier_error(exc: OSError, *, tier: str, key: str | None, op: str, path: str,
               full_error: type[TierError] = PermanentTierError, missing_ok: bool = False) -> TierError:
    """The tier error for an ``OSError`` raised by ``op`` on ``path`` (raise it ``from exc``)."""
    code = exc.errno
    what = f"{op} {path}: {exc.strerror or exc}"
    if code in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR) and missing_ok:
        return BlobNotFoundError("no such blob", tier=tier, key=key)
    if code in FULL_ERRNOS:
        return full_error(f"disk full ({errno.errorcode[code]}): {what}", tier=tier, key=key)
    if code in TRANSIENT_ERRNOS:
        return TransientTierError(what, tier=tier, key=key)
    return PermanentTierError(what, tier=tier, key=key)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(root: str, rel_dir: str, mode: int) -> list[str]:
    """Create ``root/rel_dir`` and missing parents below ``root`` (which exists); return the ones created."""
    if not rel_dir:
        return []
    missing = []
    path = os.path.join(root, rel_dir)
    while path != root and not real_dir(path):
        missing.append(path)
        path = os.path.dirname(path)
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
            created.append(d)
        except FileExistsError:
            if not real_dir(d):  # a file, or a link (check_dirs names it)
                raise
    return created


def remove_empty_dirs(root: str, rel_dir: str) -> None:
    """Remove ``root/rel_dir`` and its parents below ``root`` while they are empty."""
    while rel_dir:
        try:
            os.rmdir(os.path.join(root, rel_dir))
        except OSError:
            return
        rel_dir = os.path.dirname(rel_dir)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every view (no copies), handling short writes."""
    views = [v for v in views if len(v)]
    while views:
        batch = views[:_MAX_IOV]
        if len(batch) == 1:
            n = os.write(fd, batch[0][:_WRITE_MAX])
        else:
            n = os.writev(fd, batch)
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def write_chunks(fd: int, chunks: Iterable[Any], fail: Callable[[OSError], Exception],
                 check: Callable[[int, int], None] | None = None, direct: bool = False) -> int:
    """Write ``chunks`` to ``fd``; ``check(written_so_far, next_len)`` may raise before a chunk is written.

    A list or tuple is written with ``writev`` in batches; any other iterable chunk by chunk, each written
    before the next is requested (producers may reuse their buffer), unless the chunks are stable
    (:func:`~.base.chunks_stable`): then a direct write of one may still run while the next is made.
    ``direct``: ``fd`` was opened with ``O_DIRECT``; a :class:`~._direct_io.DirectWriter` writes streams and
    lists of at least ``DIRECT_MIN`` bytes, smaller lists are written through the page cache. An ``OSError`` of
    the writes themselves becomes ``fail(exc)``; whatever the producer raises propagates unchanged (after every
    write still running from its chunks has returned).
    """
    stable = chunks_stable(chunks)
    if isinstance(chunks, (list, tuple)):
        views = [as_memoryview(c) for c in chunks]
        total = sum(len(v) for v in views)
        if not direct or total < DIRECT_MIN:
            if direct:  # a few bytes (a manifest, the tracker): one ordinary write
                buffered_io(fd)
            if check is not None:
                check(0, total)
            try:
                _write_all(fd, views)
            except OSError as exc:
                raise fail(exc) from exc
            return total
        chunks = views
    writer = DirectWriter(fd, stable=stable) if direct else None
    written = 0
    try:
        for chunk in chunks:
            mv = as_memoryview(chunk)
            if check is not None:
                check(written, len(mv))
            try:
                if writer is None:
                    _write_all(fd, [mv])
                else:
                    writer.write(mv)
            except OSError as exc:
                raise fail(exc) from exc
            written += len(mv)
            del chunk, mv  # kept only by a direct write still running from a stable chunk: let the producer free it
        if writer is not None:
            try:
                writer.finish()
            except OSError as exc:
                raise fail(exc) from exc
    finally:
        if writer is not None:
            writer.close()
    return written


class BlobFiles:
    """Blobs as files under ``root``; ``local``, ``shm`` and ``fsspec`` on a local path configure it (modes,
    fsync, capacity check, the crash point a written temporary file passes)."""

    def __init__(self, tier: str, root: str, *, file_mode: int, dir_mode: int, fsync: bool,
                 full_error: type[TierError] = PermanentTierError, direct_io: bool = False,
                 temp_written_point: str = "files.temp_written"):
        self.tier = tier
        self.root = root
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.fsync = fsync
        self.full_error = full_error
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")  # off for good once the filesystem refuses it
        self.temp_written_point = temp_written_point
        self._links_logged: set[str] = set()

    def path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key))

    def error(self, exc: OSError, key: str | None, op: str, path: str, missing_ok: bool = False) -> TierError:
        return tier_error(exc, tier=self.tier, key=key, op=op, path=path, full_error=self.full_error,
                          missing_ok=missing_ok)

    def _log_link(self, path: str) -> None:
        if path not in self._links_logged:  # once per path: listings run on every load and every ls
            self._links_logged.add(path)
            log.warning("tier %r: %s is a symbolic link; a tier never follows links below its directory, so "
                        "nothing under it is listed or loaded (replace the link with the directory itself)",
                        self.tier, path)

    def _open_new(self, path: str) -> tuple[int, bool]:
        """Create ``path`` exclusively; with ``O_DIRECT`` when configured and the filesystem takes it."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self.direct_io:
            try:
                return os.open(path, flags | os.O_DIRECT, self.file_mode), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                with contextlib.suppress(OSError):  # the refusal may come after the file was created
                    os.unlink(path)
                log.info("tier %r: %s does not take O_DIRECT; writing through the page cache", self.tier,
                         self.root)
                self.direct_io = False
        return os.open(path, flags, self.file_mode), False

    def rename_temp(self, tmp: str, final: str, key: str) -> None:
        """A written temp file takes ``final``'s place (crash point first); a temp file gone meanwhile is transient."""
        crash_point(self.temp_written_point)
        try:
            os.rename(tmp, final)
        except FileNotFoundError as exc:
            raise vanished_temp(tmp, final, tier=self.tier, key=key) from exc
        except OSError as exc:
            raise self.error(exc, key, "rename into", final) from exc

    def write(self, key: str, chunks: Iterable[Any], check: Callable[[int, int], None] | None = None) -> int:
        """Temp file in the target directory, write, (fsync), rename, (fsync the directory and new dirs)."""
        final = self.path(key)
        rel_dir, base = os.path.split(key)
        directory = os.path.join(self.root, rel_dir)
        tmp = os.path.join(directory, temp_name(base))
        check_dirs(self.root, rel_dir, tier=self.tier, key=key)

        def create() -> tuple[list[str], int, bool]:
            created = make_dirs(self.root, rel_dir, self.dir_mode)
            return (created, *self._open_new(tmp))

        try:  # twice if a concurrent delete pruned the directory just made
            created, fd, direct = repeat_on(FileNotFoundError, 2)(create)
        except OSError as exc:
            raise self.error(exc, key, "create", tmp) from exc
        try:
            try:
                nbytes = write_chunks(fd, chunks, lambda exc: self.error(exc, key, "write", tmp), check, direct)
                if self.fsync:
                    try:
                        os.fsync(fd)
                    except OSError as exc:
                        raise self.error(exc, key, "fsync", tmp) from exc
            finally:
                os.close(fd)
            self.rename_temp(tmp, final, key)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            for d in reversed(created):  # and the directories made for it, if nothing else went there since
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            raise
        if self.fsync:
            try:
                fsync_dir(directory)
                for d in reversed(created):  # each new directory is an entry in its parent
                    fsync_dir(os.path.dirname(d))
            except OSError as exc:
                raise self.error(exc, key, "fsync the directory of", final) from exc
        return nbytes

    def open_regular(self, key: str, op: str = "open") -> tuple[int, os.stat_result, str]:
        """``key``'s file opened for reading without following links (:func:`open_regular`): (fd, fstat, path)."""
        path = self.path(key)
        try:
            fd, st = open_regular(self.root, key, tier=self.tier)
        except OSError as exc:
            raise self.error(exc, key, op, path, missing_ok=True) from exc
        return fd, st, path

    def read_into_tensor(self, key: str, hasher: Any = None, max_size: int | None = None) -> torch.Tensor:
        """The whole file in fresh private memory, read in parallel pieces (:func:`~..hostmem.read_file`: the
        page setup of the new memory overlaps the disk reads); ``hasher.update`` sees the pieces in order. A file
        larger than ``max_size`` is a :class:`CorruptionError`, and nothing of it is read. With ``direct_io``, a
        large file is read with ``O_DIRECT``, as it was written: past the page cache, into the new memory."""
        fd, st, path = self.open_regular(key)
        try:
            check_size(st.st_size, max_size, path, tier=self.tier, key=key)
            block = IO_BLOCK if self.direct_io and st.st_size >= DIRECT_MIN and direct_mode(fd) else None
            return read_file(fd, st.st_size, hasher=hasher, direct_block=block)
        except FileShrankError as exc:
            raise PermanentTierError(f"{path} shrank while being read ({exc.got} of {exc.size} bytes)",
                                     tier=self.tier, key=key) from None
        except OSError as exc:
            raise self.error(exc, key, "read", path, missing_ok=True) from exc
        finally:
            os.close(fd)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        fd, st, path = self.open_regular(key)
        try:
            check_range(offset, length, st.st_size, tier=self.tier, key=key)
            parts = []
            while length:
                data = os.pread(fd, min(length, _WRITE_MAX), offset)
                if not data:
                    raise PermanentTierError(f"{path} shrank while being read", tier=self.tier, key=key)
                parts.append(data)
                offset += len(data)
                length -= len(data)
            return b"".join(parts) if len(parts) != 1 else parts[0]
        except OSError as exc:
            raise self.error(exc, key, "read", path, missing_ok=True) from exc
        finally:
            os.close(fd)

    def _lstat(self, key: str) -> os.stat_result:
        """What is at ``key`` itself (a link is not followed), reached without following a link."""
        path = self.path(key)
        try:
            dir_fd, name = open_parent(self.root, key, tier=self.tier)
            try:
                return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise self.error(exc, key, "stat", path, missing_ok=True) from exc

    def size(self, key: str) -> int:
        st = self._lstat(key)
        if stat.S_ISDIR(st.st_mode):
            raise BlobNotFoundError("no such blob (a directory)", tier=self.tier, key=key)
        if not stat.S_ISREG(st.st_mode):
            raise refused_entry(self.path(key), st.st_mode, tier=self.tier, key=key)
        return st.st_size

    def exists(self, key: str) -> bool:
        """Something other than a directory is at ``key`` (a link or a FIFO too: reading it says what is wrong);
        below a link there is nothing."""
        try:
            return not stat.S_ISDIR(self._lstat(key).st_mode)
        except (BlobNotFoundError, CorruptionError):
            return False

    def list(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        rel_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, rel_dir) if rel_dir else self.root
        keys = []
        try:
            for dirpath, dirnames, filenames in walk_strict(top, self.root, self._log_link):
                rel = os.path.relpath(dirpath, self.root)
                rel = "" if rel == "." else rel + "/"
                if rel and not (rel.startswith(prefix) or prefix.startswith(rel)):
                    dirnames.clear()
                    continue
                for name in dirnames:  # os.walk lists links to directories here and never descends into them
                    below = rel + name + "/"
                    if (below.startswith(prefix) or prefix.startswith(below)) and os.path.islink(
                            os.path.join(dirpath, name)):
                        self._log_link(os.path.join(dirpath, name))
                for name in filenames:
                    key = rel + name
                    if key.startswith(prefix) and not is_temp_name(name):
                        keys.append(key)
        except OSError as exc:
            raise self.error(exc, prefix or ".", "list", getattr(exc, "filename", None) or top) from exc
        return sorted(keys)

    def modified(self, key: str) -> float | None:
        """When the file at ``key`` last changed (its mtime; a link's own), None when nothing is there."""
        try:
            return self._lstat(key).st_mtime
        except (TierError, CorruptionError):
            return None

    def temp_files(self) -> list[str]:  # (best effort: gc reports what it can see)
        """Relative paths of temporary files (writes that never finished: a crash, a full disk)."""
        found = []
        for dirpath, _, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            found += [name if rel == "." else f"{rel}/{name}" for name in filenames if is_temp_name(name)]
        return sorted(found)

    def remove_temp_file(self, rel: str) -> None:
        if not is_temp_name(os.path.basename(rel)):
            raise ValueError(f"{rel!r} is not a temporary file")
        self._unlink(rel)

    def _unlink(self, key: str) -> bool:
        """Remove the entry at ``key`` (a link itself, never what it points to); False if nothing was there."""
        path = self.path(key)
        try:
            dir_fd, name = open_parent(self.root, key, tier=self.tier)
        except CorruptionError:
            return False  # below a link: not in the tier
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise self.error(exc, key, "delete", path) from exc
        try:
            os.unlink(name, dir_fd=dir_fd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except OSError as exc:
            if exc.errno == errno.EPERM and stat.S_ISDIR(os.stat(name, dir_fd=dir_fd,
                                                                 follow_symlinks=False).st_mode):
                return False  # unlink() of a directory on Linux
            raise self.error(exc, key, "delete", path) from exc
        finally:
            os.close(dir_fd)
        return True

    def delete(self, key: str) -> None:
        if self._unlink(check_key(key)):
            remove_empty_dirs(self.root, os.path.dirname(key))

    def delete_prefix(self, prefix: str) -> None:
        """Every key under the directory ``prefix``, then the directories left empty. A link where the
        directory should be is removed itself (what it points to is not the tier's)."""
        prefix = check_prefix(prefix.rstrip("/") + "/")
        for key in self.list(prefix):
            crash_point("files.deleting")
            self.delete(key)
        top = os.path.join(self.root, prefix.rstrip("/"))
        if os.path.islink(top):
            self._unlink(prefix.rstrip("/"))
        elif real_dir(top):
            for dirpath, _, _ in sorted(os.walk(top, topdown=False), key=lambda e: -len(e[0])):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        remove_empty_dirs(self.root, os.path.dirname(prefix.rstrip("/")))


def vanished_temp(tmp: str, final: str, *, tier: str, key: str) -> TransientTierError:
    """A temporary file gone before its rename: a concurrent ``gc --delete`` or delete removed it (or its
    directory). That attempt failed, nothing else: the retry writes the file again."""
    return TransientTierError(f"rename {tmp} into {final}: the temporary file vanished before its rename "
                              f"(removed by a concurrent gc --delete or delete?); the write is tried again",
                              tier=tier, key=key)


class FilesHousekeeping:
    """The parts of the Tier interface (tiers/base.py) that :class:`BlobFiles` answers as it is — reads by range,
    sizes, listings, and what gc and the CLI ask — for kinds whose blobs are :class:`BlobFiles` under a directory
    ``root``: listed before :class:`~tiered_ckpt.tiers.base.Tier` in the bases."""

    root: str
    files: BlobFiles

    @property
    def location(self) -> str | None:
        return self.root

    def temp_files(self) -> list[str]:
        return self.files.temp_files()

    def remove_temp_file(self, key: str) -> None:
        self.files.remove_temp_file(key)

    def modified(self, key: str) -> float | None:
        return self.files.modified(key)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        return self.files.read_range(key, offset, length)

    def size(self, key: str) -> int:
        return self.files.size(key)

    def exists(self, key: str) -> bool:
        return self.files.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.files.list(prefix)
