"""Opening what is below a file tier's root without following links or blocking on special files.

The root itself may be a link (the user chose it); below it, directories are walked one component at a time
(``openat`` with ``O_NOFOLLOW`` on the parent's descriptor) and files opened ``O_NOFOLLOW | O_NONBLOCK`` and
checked with ``fstat`` before a byte is read. A symbolic link, a FIFO, a socket or a device where a directory or
a blob should be is refused with an error naming the path: a :class:`~tiered_ckpt.errors.CorruptionError` on
reads (a load falls back to the next tier), a :class:`~tiered_ckpt.errors.PermanentTierError` on writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ..errors import BlobNotFoundError, BlobTooLargeError, CorruptionError, PermanentTierError

# Directories below the root: never through a link (O_PATH: search permission is enough to walk through).
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
# Blobs: a link is ELOOP, a FIFO opens at once (no writer needed) and fstat tells what it is before any read.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _what(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def refused_entry(path: str, mode: int, *, tier: str, key: str | None, target: str | None = None,
                  error: type[Exception] = CorruptionError) -> Exception:
    """The error for a link or special file found at ``path`` inside a tier, saying what it is and what to do."""
    what = _what(mode) + (f" to {target}" if target else "")
    if stat.S_ISLNK(mode):
        advice = ("a tier never follows links below its directory (one may lead out of it); replace the link "
                  "with the directory or file itself, or remove it")
    else:
        advice = "a tier stores only regular files and directories; remove it"
    return error(f"{path} is {what}: {advice}", tier=tier, key=key)


def _refuse_if_special(dir_fd: int, name: str, path: str, *, tier: str, key: str | None,
                       error: type[Exception] = CorruptionError) -> None:
    """Raise :func:`refused_entry` if ``name`` in ``dir_fd`` is a link or a special file (else return)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return
    target = None
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            target = os.readlink(name, dir_fd=dir_fd)
    raise refused_entry(path, st.st_mode, tier=tier, key=key, target=target, error=error)


def open_parent(root: str, key: str, *, tier: str) -> tuple[int, str]:
    """A descriptor of the directory holding ``key`` under ``root``, reached without following a link, and the
    key's last component. A link on the way is a :class:`CorruptionError` naming it; a missing directory or a
    file on the way raises ``FileNotFoundError``/``NotADirectoryError`` (the caller maps them)."""
    parts = key.split("/")
    fd = os.open(root, _DIR_FLAGS)
    try:
        path = root
        for part in parts[:-1]:
            path = os.path.join(path, part)
            try:
                nfd = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    _refuse_if_special(fd, part, path, tier=tier, key=key)
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def open_regular(root: str, key: str, *, tier: str) -> tuple[int, os.stat_result]:
    """``key``'s file opened for reading (blocking), with its ``fstat``; never through a link, never a FIFO.

    A link or special file at the key or on the way is a :class:`CorruptionError`, a directory a
    :class:`BlobNotFoundError`; ``OSError`` for the rest (missing: ``FileNotFoundError``)."""
    dir_fd, name = open_parent(root, key, tier=tier)
    try:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):  # a link; a socket
                _refuse_if_special(dir_fd, name, os.path.join(root, key), tier=tier, key=key)
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise BlobNotFoundError("no such blob (a directory)", tier=tier, key=key)
        if not stat.S_ISREG(st.st_mode):
            raise refused_entry(os.path.join(root, key), st.st_mode, tier=tier, key=key)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_dirs(root: str, rel_dir: str, *, tier: str, key: str | None,
               error: type[Exception] = PermanentTierError) -> None:
    """Refuse to write below ``root/rel_dir`` if a component that exists is a link or a special file (writes would
    land outside the tier, or in a directory its listing never descends into)."""
    path = root
    for part in rel_dir.split("/") if rel_dir else ():
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except OSError:
            return  # missing (made next) or unreadable (the write reports it)
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            target = None
            if stat.S_ISLNK(st.st_mode):
                with contextlib.suppress(OSError):
                    target = os.readlink(path)
            raise refused_entry(path, st.st_mode, tier=tier, key=key, target=target, error=error)
        return  # a file on the way: the write fails with ENOTDIR


def real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def check_size(size: int, max_size: int | None, path: str, *, tier: str, key: str | None) -> None:
    """Refuse a blob larger than the size its manifest records, before reading it."""
    if max_size is not None and size > max_size:
        raise BlobTooLargeError(f"{path} is {size} bytes, more than the {max_size} bytes its manifest records "
                                f"(not read)", size=size, max_size=max_size, tier=tier, key=key)
