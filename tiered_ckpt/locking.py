"""Ownership of a run: one live engine per (run_id, rank) on a node, and ``gc`` can tell a live run from a dead one.

Where the locks are. The lock files live beside what they protect: for every ``shm`` tier, in
``{path}/{user}/@locks/{run_id}/`` (``@`` cannot start a run_id, so the directory is never taken for a run's). Two
engines that see the same shm directory therefore see the same locks, whatever their ``TMPDIR`` (containers
sharing ``/dev/shm``, a batch job beside a login shell). A run with no shm tier has nothing on the node that
another process could overwrite; its lock stays in the per-user ``$TMPDIR/tiered_ckpt-{user}/{run_id}/`` (or
``TIERED_CKPT_LOCK_DIR``), which keeps two engines of one run_id in one environment apart.

In each lock directory:

* ``rank_RRRRR.lock``: ``flock(LOCK_EX)`` by the engine of that rank, for its whole life. Inside: the owner's pid,
  host and start time, for the message a second engine gets.
* ``run.lock`` (shm lock directories only): ``flock(LOCK_SH)`` by every engine of the run. ``gc`` takes it
  ``LOCK_EX`` before it removes the run's shared memory: it gets it only when no engine of the run is alive, and
  no engine can start while it holds it.

``flock`` locks go with the process (a killed engine holds nothing) and work between processes of different
containers as long as they share the filesystem. ``release`` removes the files (while still holding them) and the
run's directory once empty; ``acquire`` checks, once it holds a lock, that its file is still the one at the path,
so a file unlinked between our ``open`` and ``flock`` is let go and the path opened afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .errors import RunLockedError, TieredCkptError
from .private_dirs import private_dir
from .tiers.base import _user_name
from .tiers.shm import shm_base

LOCKS_DIR = "@locks"  # in {shm path}/{user}/: run_ids are letters, digits, "_", "-", "." only
RUN_LOCK = "run.lock"
#: How long an engine waits for ``gc`` to finish removing the run's shared memory before it gives up.
GC_WAIT_S = 30.0


def lock_dir(run_id: str) -> str:
    """Per-user, 0700: ``$TMPDIR/tiered_ckpt-<user>/<run_id>`` (override with TIERED_CKPT_LOCK_DIR): the locks of a
    run with no shm tier.

    The per-user directory and the run's are this user's own and 0700 (fixed if they are not); one that another
    user owns, or that is a symlink, is refused: whoever controls it could hold or swap our lock files.
    """
    override = os.environ.get("TIERED_CKPT_LOCK_DIR")
    if override:
        os.makedirs(override, exist_ok=True)  # the user's choice of place: used as it is
        base = override
    else:
        base = private_dir(tmp_lock_base(), "lock files")
    return private_dir(os.path.join(base, run_id), "lock files")


def tmp_lock_base() -> str:
    """The per-user directory of the ``$TMPDIR`` locks (computed, never created)."""
    return os.environ.get("TIERED_CKPT_LOCK_DIR") or os.path.join(tempfile.gettempdir(),
                                                                  f"tiered_ckpt-{_user_name()}")


def shm_lock_path(shm_path: str, run_id: str, user: str | None = None) -> str:
    """``{shm_path}/{user}/@locks/{run_id}``: where the locks of ``run_id`` live beside its slots (not created)."""
    return os.path.join(os.path.abspath(shm_path), user or _user_name(), LOCKS_DIR, run_id)


def shm_lock_dir(shm_path: str, run_id: str) -> str:
    """:func:`shm_lock_path`, created: the shm path as the tier makes it (shared and sticky, like /tmp), the
    per-user directory and the lock directories private (0700, this user's, never a symlink)."""
    base = shm_base(shm_path)
    try:
        if not os.path.isdir(base):
            os.makedirs(base, exist_ok=True)
            with contextlib.suppress(OSError):  # shared by every user of the node: sticky and world-writable
                os.chmod(base, 0o1777)
        user = private_dir(os.path.join(base, _user_name()), "checkpoints")
        return private_dir(os.path.join(private_dir(os.path.join(user, LOCKS_DIR), "lock files"), run_id),
                           "lock files")
    except OSError as exc:
        raise TieredCkptError(f"cannot create the lock directory of run {run_id!r} in the shm path {base}: "
                              f"{exc.strerror or exc}; check that the shm tier's path is writable") from None


def shm_paths(config: Any) -> list[str]:
    """The paths of the enabled ``shm`` tiers of a configuration, each once, in order. A path that is a file is a
    :class:`ConfigError` at its ``tiers[i].path`` (the run's locks go there before any tier is built)."""
    paths = []
    for i, t in enumerate(config.tiers):
        if t.kind == "shm" and t.enabled is not False:
            paths.append(shm_base(t.options.path, f"tiers[{i}].path", getattr(config, "source", None)))
    return list(dict.fromkeys(paths))


def owner_record(started: str, job: str | None = None) -> bytes:
    """What a rank lock holds: its owner's pid, host and start, and (once the start-up exchange gave it) the job
    incarnation it belongs to (:meth:`RunLock.stamp`)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    return json.dumps({**record, "job": job} if job else record).encode()


def describe_owner(raw: bytes) -> str:
    """`` by process 123 on host h (since 2026-...)`` from a lock file's content; old ones hold a bare pid."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        owner = json.loads(text)
    except ValueError:
        return f" by process {text[:40]}" if text else ""
    if not isinstance(owner, dict):
        return f" by process {text[:40]}"
    out = f" by process {owner.get('pid', '?')}"
    if owner.get("host"):
        out += f" on host {owner['host']}"
    if owner.get("started"):
        out += f" (since {owner['started']})"
    return out


class _LockFile:
    """One ``flock`` on ``name`` in the directory ``make_dir()`` returns (and re-creates after a releasing engine
    removed it)."""

    def __init__(self, make_dir: Callable[[], str], name: str):
        self._make_dir = make_dir
        self.dir = make_dir()
        self.name = name
        self.fd: int | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.dir, self.name)

    def acquire(self, mode: int, on_busy: Callable[[int], Exception]) -> None:
        """``mode``: LOCK_EX or LOCK_SH. ``on_busy(fd)`` makes the error when another process holds it."""
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:  # a releasing engine removed the run's directory just now
                self.dir = self._make_dir()
                continue
            if not _flock_soon(fd, mode):
                # gc removing a stale lock holds it for the moment of its unlink: a file gone from the path was
                # not a holder's; lock the one at the path now
                if not _same_file(fd, self.path):
                    os.close(fd)
                    continue
                try:
                    error = on_busy(fd)
                finally:
                    os.close(fd)
                raise error from None
            if _same_file(fd, self.path):
                self.fd = fd
                return
            os.close(fd)  # unlinked by its releasing holder: lock the file now at the path instead
        raise RunLockedError(f"the lock {self.path} keeps changing (removed by other processes while we lock it)")

    def release(self, unlink: bool = True) -> None:
        if self.fd is None:
            return
        if unlink and _same_file(self.fd, self.path):
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while held: whoever opened it before sees it is gone (acquire)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


class RunLock:
    """The locks of one engine (``run_id``, ``rank``), held while it lives: in each of ``shm_paths`` (the shm tiers'
    paths, :func:`shm_paths`), or in the ``$TMPDIR`` lock directory when there is none."""

    def __init__(self, run_id: str, rank: int, shm_paths: Sequence[str] = ()):
        self.run_id = run_id
        self.rank = rank
        self._started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # what the lock says, stamped or not
        makers: list[Callable[[], str]] = [(lambda p=p: shm_lock_dir(p, run_id)) for p in shm_paths]
        if not makers:
            makers = [lambda: lock_dir(run_id)]
        self._ranks: list[_LockFile] = []
        try:
            for make in makers:
                self._ranks.append(_LockFile(make, f"rank_{rank:05d}.lock"))
        except BaseException:  # a later shm path refused (not writable, another user's): no empty run directory
            for made in self._ranks:  # left in the earlier ones, where nothing would ever remove it
                with contextlib.suppress(OSError):
                    os.rmdir(made.dir)
            raise
        # gc removes only shared memory: a run with no shm tier has no run.lock ($TMPDIR: rank locks alone).
        self._runs: list[_LockFile | None] = [_LockFile(m, RUN_LOCK) for m in makers] if shm_paths else [None]

    @property
    def path(self) -> str:
        return self._ranks[0].path

    @property
    def dir(self) -> str:
        return self._ranks[0].dir

    def acquire(self) -> None:
        try:
            for rank_lock, run_lock in zip(self._ranks, self._runs, strict=True):
                rank_lock.acquire(fcntl.LOCK_EX, lambda fd, lf=rank_lock: self._in_use(fd, lf.path))
                if run_lock is not None:
                    self._share_run_lock(run_lock)
                os.ftruncate(rank_lock.fd, 0)
                os.pwrite(rank_lock.fd, owner_record(self._started), 0)
        except BaseException:
            self.release()
            raise

    def stamp(self, job: str) -> None:
        """Write the job incarnation (``Coordinator.incarnation``) into the held rank locks: :func:`gone_ranks`
        counts only locks of the job asking, never one an earlier run left (or one of a rank that shares this
        node's name but not its lock directory: containers on the host network with their own /dev/shm)."""
        record = owner_record(self._started, job)
        for rank_lock in self._ranks:
            if rank_lock.fd is not None:
                # the same record with the job added: written over the old one, which it only lengthens, so a
                # reader never finds it empty
                os.pwrite(rank_lock.fd, record, 0)
                os.ftruncate(rank_lock.fd, len(record))

    def _share_run_lock(self, run_lock: _LockFile) -> None:
        deadline = time.monotonic() + GC_WAIT_S
        while True:
            try:
                run_lock.acquire(fcntl.LOCK_SH, lambda fd: RunLockedError(
                    f"run_id {self.run_id!r}: `tiered-ckpt gc` is removing this run's shared memory (it holds "
                    f"{run_lock.path}); start the engine again once it has finished"))
                return
            except RunLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)  # gc holds it only while it deletes

    def _in_use(self, fd: int, path: str) -> RunLockedError:
        try:
            holder = describe_owner(os.pread(fd, 512, 0))
        except OSError:
            holder = ""
        return RunLockedError(
            f"run_id {self.run_id!r} rank {self.rank} is already in use on this node{holder} (lock {path}); "
            "give each job its own run_id, or stop the other engine first")

    def release(self) -> None:
        for rank_lock, run_lock in zip(self._ranks, self._runs, strict=True):
            if rank_lock.fd is not None:
                remove_if_unheld(os.path.join(rank_lock.dir, f"worker_{self.rank:05d}.lock"))
            rank_lock.release()
            if run_lock is not None and run_lock.fd is not None:
                # The last engine of the run removes run.lock: only it can take it exclusively.
                try:
                    fcntl.flock(run_lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except BlockingIOError:
                    last = False
                run_lock.release(unlink=last)
            with contextlib.suppress(OSError):  # other ranks' lock files still there: it stays
                os.rmdir(rank_lock.dir)


def run_lock_path(run_id: str, shm_paths: Sequence[str] = ()) -> str:
    """The directory the rank locks of ``run_id`` live in (as :class:`RunLock` makes it; never created here)."""
    return shm_lock_path(shm_paths[0], run_id) if shm_paths else os.path.join(tmp_lock_base(), run_id)


def gone_ranks(directory: str, ranks: Sequence[int], job: str) -> dict[int, str]:
    """Of ``ranks``, those whose engine of the job incarnation ``job`` died on this node: its lock file is still in
    ``directory`` (a killed process leaves it; a closing engine removes it), stamped with ``job``
    (:meth:`RunLock.stamp`), and no process holds it. Rank → that lock file. A rank with no such file here (on
    another node, closed, not started, or a lock of an earlier run) is not in the answer. Taken for a moment with
    ``LOCK_SH``: an engine starting meanwhile tries its lock again a few times (:func:`_flock_soon`)."""
    gone = {}
    for rank in ranks:
        path = os.path.join(directory, f"rank_{rank:05d}.lock")
        with _taken_if_unheld(path, fcntl.LOCK_SH) as fd:
            if fd is not None and _job_of(os.pread(fd, 4096, 0)) == job:
                gone[rank] = path
    return gone


def _job_of(raw: bytes) -> str | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record.get("job") if isinstance(record, dict) else None


def _flock_soon(fd: int, mode: int, tries: int = 5, pause_s: float = 0.01) -> bool:
    """``flock(fd, mode)`` without blocking, tried again a few times ``pause_s`` apart: gc takes a stale lock
    for the moment it needs to unlink it, and an engine starting then must not read that as a live holder."""
    for i in range(tries):
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(pause_s)
    return False


def remove_if_unheld(path: str) -> None:
    """Remove a lock file that nobody holds, taking it for the moment of the unlink: one still held (an orphaned
    drain worker's, fencing.py; an engine's that started meanwhile) stays. A closing engine removes its worker's
    lock this way, and ``gc`` a stale run's locks."""
    with _taken_if_unheld(path, fcntl.LOCK_EX) as fd:
        if fd is not None:
            with contextlib.suppress(OSError):  # gone meanwhile
                os.unlink(path)  # while held: a worker opening it now sees it is gone


@contextlib.contextmanager
def _taken_if_unheld(path: str, mode: int) -> Iterator[int | None]:
    """The lock file at ``path`` taken with ``mode`` (``LOCK_SH``/``LOCK_EX``) for the block, its fd, if no process
    holds it and it is still the file at the path (not unlinked by its releasing owner meanwhile); None when it is
    held, absent or gone. Let go when the block ends."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError:  # held (BlockingIOError)
            yield None
            return
        yield fd if _same_file(fd, path) else None
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
