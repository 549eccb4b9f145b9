"""Per-user directories for what other users must neither read nor replace (shm slots, lock files)."""

from __future__ import annotations

import logging
import os
import stat

from .errors import TieredCkptError

log = logging.getLogger(__name__)


def private_dir(path: str, keeps: str) -> str:
    """Create ``path`` 0700 if missing; refuse it if it is a symlink, not a directory, or another user's; tighten
    a looser mode. ``keeps`` says what goes there, for the messages ("checkpoints", "lock files")."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TieredCkptError(f"{path} is not a directory (a symlink or a file); refusing to keep {keeps} there")
    if st.st_uid != os.geteuid():
        raise TieredCkptError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); refusing "
                              f"to keep {keeps} where another user can read or replace them")
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("%s was mode %o; setting it to 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)
    return path
