"""One live engine per (run_id, rank) on a node: a second one fails clearly instead of corrupting the first."""

from __future__ import annotations

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
    def __init__(self, run_id: str, rank: int):
        self.path = os.path.join(lock_dir(run_id), f"rank_{rank:05d}.lock")
        self.run_id = run_id
        self.rank = rank
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
