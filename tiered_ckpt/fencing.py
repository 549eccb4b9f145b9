"""Fencing of drain workers: a worker writes only while the engine that started it owns the run (issue #15).

Each drain worker holds ``worker_RRRRR.lock`` (``flock(LOCK_EX)``, its pid inside) in the run's lock directory
beside the shm slots (``locking.shm_lock_dir``) for its whole life. Two fences keep an orphan (a worker whose
training process died) from writing what a newer owner of the run may own:

* the worker watches its parent and exits at once when it is gone (:func:`watch_parent`), without finishing
  or committing what it was draining: uncommitted files are debris for retention and ``gc``;
* a new engine, once it holds the rank's lock (so the old owner is dead), takes the worker lock before it
  touches a slot (:func:`fence_previous_worker`): a worker that cannot exit by itself (SIGSTOPped, stuck in a
  system call) is SIGKILLed first. So no old worker is alive once a new owner writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import threading
import time
from typing import Any

from .errors import TieredCkptError
from .locking import shm_lock_dir, shm_lock_path, shm_paths

log = logging.getLogger(__name__)

#: How long a new owner lets an orphaned worker exit by itself before it SIGKILLs it.
ORPHAN_GRACE_S = 5.0
#: How often a worker checks that its training process is alive.
PARENT_POLL_S = 0.1


def worker_lock_path(config: Any, rank: int, *, create: bool = True) -> str | None:
    """Where the worker of ``rank`` holds its lock; None without an shm tier (then no worker runs).
    ``create=False`` (the worker's side): the directory is not made; the engine made it before it started the
    worker, and a worker that starts after its engine is gone must not leave a new one behind."""
    paths = shm_paths(config)
    if not paths:
        return None
    directory = shm_lock_dir(paths[0], config.run_id) if create else shm_lock_path(paths[0], config.run_id)
    return os.path.join(directory, f"worker_{rank:05d}.lock")


def _try_lock(path: str) -> int | None:
    """The lock's fd, or None while another process holds it."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)  # unlinked by an exiting worker between our open and flock: lock the file now at the path
    raise TieredCkptError(f"the drain worker lock {path} keeps changing (removed by other processes while we lock it)")


def _holder(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
        return int(f.read(32).decode().strip() or "0") or None
    return None


def release_worker_lock(path: str, fd: int) -> None:
    """Remove the lock file we hold (so the run's lock directory can go with its last engine), then let go."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)


def hold_worker_lock(path: str, wait_s: float = ORPHAN_GRACE_S * 4) -> int:
    """The worker's side: take the lock (its owner fenced any previous worker already) and write our pid."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = _try_lock(path)
        except FileNotFoundError:
            raise TieredCkptError(f"the lock directory {os.path.dirname(path)} of this run is gone: the engine that "
                                  "started this drain worker has closed or was killed (or `tiered-ckpt gc` removed "
                                  "the run) before the worker was up; it drains nothing") from None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        if time.monotonic() >= deadline:
            raise TieredCkptError(f"the drain worker lock {path} is held by process {_holder(path)}, another drain "
                                  "worker of this run and rank; stop it (or its training process) first")
        time.sleep(0.05)


def fence_previous_worker(config: Any, rank: int, grace_s: float = ORPHAN_GRACE_S) -> int | None:
    """The new owner's side (it holds the rank lock): wait for a previous worker of ``rank`` to exit, SIGKILL it
    after ``grace_s``; return the pid of the worker that was fenced, or None if there was none."""
    path = worker_lock_path(config, rank)
    if path is None:
        return None
    fd = _try_lock(path)
    if fd is not None:  # no worker holds it: nothing to fence
        release_worker_lock(path, fd)
        return None
    pid = _holder(path)
    log.warning("run %r rank %d: the drain worker of a previous engine (process %s) is still alive; it is stopped "
                "before this engine starts", config.run_id, rank, pid)
    deadline = time.monotonic() + grace_s
    killed = False
    while True:
        fd = _try_lock(path)
        if fd is not None:
            release_worker_lock(path, fd)
            return pid
        now = time.monotonic()
        if now >= deadline:
            if killed:
                raise TieredCkptError(f"run {config.run_id!r} rank {rank}: the drain worker of a previous engine "
                                      f"(process {pid}, lock {path}) does not exit; kill it, then start again")
            pid = _holder(path) or pid  # it may have written its pid only now
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)  # a stopped process is killed too
            killed, deadline = True, now + grace_s
        time.sleep(0.02)


def watch_parent(parent_pid: int, on_orphaned: Any = None) -> threading.Thread:
    """A thread of the worker: once the training process is gone, exit now (``os._exit``: no drain finishes,
    nothing more is written; the flock goes with the process)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        if on_orphaned is not None:
            with contextlib.suppress(Exception):
                on_orphaned()
        os.write(2, f"tiered_ckpt drain worker {os.getpid()}: its training process {parent_pid} is gone; "
                    "exiting without writing more (uncommitted files are left for retention/gc)\n".encode())
        os._exit(3)

    th = threading.Thread(target=watch, name="tiered_ckpt-parent-watch", daemon=True)
    th.start()
    return th


def owner_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid
