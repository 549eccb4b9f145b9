"""One live engine per (run_id, rank) on a node: a second one fails clearly instead of corrupting the first."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile

from .errors import RunLockedError, TieredCkptError
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
        base = _private_dir(os.path.join(tempfile.gettempdir(), f"tiered_ckpt-{_user_name()}"))
    return _private_dir(os.path.join(base, run_id))


def _private_dir(path: str) -> str:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TieredCkptError(f"{path} is not a directory (a symlink or a file); refusing to keep lock files there")
    if st.st_uid != os.geteuid():
        raise TieredCkptError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); refusing "
                              "to keep lock files where another user can take or replace them")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


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
