"""One live engine per (run_id, rank) on a node: a second one fails clearly instead of corrupting the first."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

from .errors import RunLockedError
from .private_dirs import private_dir
from .tiers.base import _user_name


def lock_dir(run_id: str) -> str:
    """Per-user, 0700: ``$TMPDIR/tiered_ckpt-<user>/<run_id>`` (override with TIERED_CKPT_LOCK_DIR).

    The per-user directory and the run's are this user's own and 0700 (fixed if they are not); one that another
    user owns, or that is a symlink, is refused: whoever controls it could hold or swap our lock files.
    """
    override = os.environ.get("TIERED_CKPT_LOCK_DIR")
    if override:
        os.makedirs(override, exist_ok=True)  # the user's choice of place: used as it is
        base = override
    else:
        base = private_dir(os.path.join(tempfile.gettempdir(), f"tiered_ckpt-{_user_name()}"), "lock files")
    return private_dir(os.path.join(base, run_id), "lock files")


class RunLock:
    """An ``flock`` on ``rank_RRRRR.lock`` in the run's lock directory, held while the engine lives.

    ``release`` removes the lock file (while still holding it) and the run's directory once empty, so the per-user
    directory does not keep one directory per run_id ever used. That is safe because ``acquire`` checks, once it
    holds the lock, that its file is still the one at the path: a file unlinked by a releasing engine between our
    ``open`` and ``flock`` is let go, and the path opened afresh."""

    def __init__(self, run_id: str, rank: int):
        self.dir = lock_dir(run_id)
        self.path = os.path.join(self.dir, f"rank_{rank:05d}.lock")
        self.run_id = run_id
        self.rank = rank
        self._fd: int | None = None

    def acquire(self) -> None:
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:  # a releasing engine removed the run's directory just now
                self.dir = lock_dir(self.run_id)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                try:
                    holder = os.pread(fd, 64, 0).decode().strip()
                except OSError:
                    pass
                os.close(fd)
                raise RunLockedError(
                    f"run_id {self.run_id!r} rank {self.rank} is already in use on this node"
                    + (f" by process {holder}" if holder else "")
                    + f" (lock {self.path}); give each job its own run_id") from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                self._fd = fd
                return
            os.close(fd)  # unlinked by its releasing holder: lock the file now at the path instead
        raise RunLockedError(f"run_id {self.run_id!r} rank {self.rank}: the lock {self.path} keeps changing")

    def release(self) -> None:
        if self._fd is not None:
            if _same_file(self._fd, self.path):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)  # while held: whoever opened it before sees it is gone (acquire)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(OSError):  # other ranks' lock files still there: it stays
                os.rmdir(self.dir)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
