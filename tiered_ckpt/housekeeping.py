"""What ``tiered-ckpt gc`` finds and removes: debris on file tiers (partial steps, temporary files, an object
store's unfinished uploads) and the shared memory of dead runs.

Nothing here runs on its own: the engine's retention removes only what it owns after a commit, and this module
only acts on an explicit command (dry run first). Finding is read-only: no directory or lock file is created.

What gc never touches (docs/operations.md, "What gc may touch"):

* a run whose lock is held (:mod:`tiered_ckpt.locking`: the lock lives beside the run's slots, so it is seen
  whatever ``TMPDIR`` each process has): its shared memory, and, when gc knows the run (``--config``), the
  temporary files and partial steps on its file tiers;
* a temporary file younger than ``min_age_s`` (:data:`TEMP_GRACE_S` by default), on any tier: a write in flight
  on another node (or on a store where ownership cannot be told) keeps touching its temporary file; the same for
  an unfinished upload whose newest part is younger.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import BlobNotFoundError, RunLockedError, TieredCkptError, TierError
from .locking import LOCKS_DIR, RUN_LOCK, remove_if_unheld, shm_lock_path, tmp_lock_base
from .tiers._files import remove_empty_dirs
from .tiers.base import _user_name

if TYPE_CHECKING:
    from .file_store import FileStore
    from .snapshot_record import SlotMeta
    from .tiers.base import UnfinishedUpload

#: A temporary file modified less than this long ago may belong to a write in flight: gc leaves it.
TEMP_GRACE_S = 3600.0
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # as config.py checks run_id


@dataclass
class Debris:
    tier: str
    what: str  # "partial step", "temporary file" or "unfinished upload"
    key: str
    nbytes: int | None  # None: the tier would not tell
    upload: UnfinishedUpload | None = None  # an unfinished upload's, to abort it
    age_s: float | None = None  # since its newest file (or part) changed, where gc looked at it; None: unknown
    left: str | None = None  # why it is found but not debris (LEFT_YOUNG, LEFT_NEWEST); None: debris

    def to_dict(self) -> dict:
        out = {"tier": self.tier, "what": self.what, "key": self.key, "bytes": self.nbytes}
        if self.upload is not None:
            out["upload_id"] = self.upload.upload_id
        if self.age_s is not None:
            out["age_s"] = round(self.age_s, 1)
        if self.left is not None:
            out["left"] = self.left
        return out


#: Why gc leaves what it found: changed less than ``min_age_s`` ago (or when cannot be told).
LEFT_YOUNG = "younger than --min-age"
#: An uncommitted step newer than every committed one: a save in flight, or one killed before its commit.
LEFT_NEWEST = "newer than every committed step"


def find_debris(store: FileStore, *, live: bool = False, min_age_s: float = TEMP_GRACE_S,
                now: float | None = None, left: list[Debris] | None = None) -> list[Debris]:
    """Uncommitted steps older than the newest committed one, and temporary files of unfinished writes (an object
    store's unfinished uploads: :func:`find_unfinished_uploads`).

    ``live``: an engine of the run that writes this tier holds its lock: nothing of it is debris (its own
    retention removes its partial steps after each commit). Temporary files and partial steps with a file
    modified less than ``min_age_s`` ago, or whose age cannot be told, are left too: a write in flight elsewhere
    keeps touching its files. ``left`` (when given) receives those, and the uncommitted steps newer than every
    commit (never debris: a save may be writing them), each with why (:attr:`Debris.left`), for gc to say."""
    if live:
        return []
    now = time.time() if now is None else now
    out: list[Debris] = []
    kept: list[Debris] = left if left is not None else []
    # A partial step is debris only when none of its files changed for min_age_s either: a run that saves below
    # an earlier run's steps (docs/operations.md) writes its next step beneath their newest commit.
    listed = store.tier.list("")
    uncommitted = store.uncommitted_steps(listed)
    partial = store.partial_steps(listed, uncommitted=uncommitted)
    for step, keys in sorted(uncommitted.items()):
        newest = step not in partial  # never debris: a save may be writing it (the next commit above removes it)
        age = files_age(store, keys, now) if min_age_s > 0 or newest else None
        debris = not newest and _is_old(age, min_age_s)
        step_dir = store.layout.step_dir(step)
        try:
            nbytes = store.tier.stored_bytes(step_dir)
        except (TieredCkptError, OSError):
            if debris:
                raise
            continue  # only said, never removed: a size that cannot be had is no reason to fail the tier's gc
        why = None if debris else LEFT_NEWEST if newest else LEFT_YOUNG
        (out if debris else kept).append(Debris(store.name, "partial step", step_dir, nbytes, age_s=age, left=why))
    relisted: set[str] | None = None  # the temporary files listed again, once, after a size() said "no blob"
    for rel in store.tier.temp_files():  # the Tier interface (tiers/base.py): every kind answers, plugins too
        age = _age(store, rel, now) if min_age_s > 0 else None
        try:
            size: int | None = store.tier.size(rel)
        except BlobNotFoundError:
            if relisted is None:
                relisted = set(store.tier.temp_files())
            if rel not in relisted:
                continue  # finished (renamed into place) or removed since the listing
            size = None  # a plugin's size() that refuses temp keys: still found (they were skipped: a trial)
        except (TierError, OSError):
            size = None
        debris = _is_old(age, min_age_s)
        (out if debris else kept).append(Debris(store.name, "temporary file", rel, size, age_s=age,
                                                left=None if debris else LEFT_YOUNG))
    return out


def find_unfinished_uploads(store: FileStore, *, live: bool = False, min_age_s: float = TEMP_GRACE_S,
                            now: float | None = None, left: list[Debris] | None = None) -> list[Debris]:
    """An object store's uploads that killed saves left open (billed, and seen by no listing), into the tier's
    step directories only: another program's uploads under the same prefix are not ours to abort. Each is left
    while its newest part (or, with none, its start) is younger than ``min_age_s``: a drain uploading keeps
    sending parts (``left``, when given, receives those). Found and aborted on this listing's ages (a temporary
    file's age is read again before its removal; an upload idle for ``min_age_s`` that resumes in between is not
    expected). ``live``: as for :func:`find_debris`. Raises the tier's error when it cannot list them
    (permissions, say)."""
    if live:
        return []
    now = time.time() if now is None else now

    def in_a_step(key: str) -> bool:
        top, inside, _ = key.partition("/")
        return bool(inside) and store.layout.parse_step_dir(top) is not None

    out = []
    # The Tier interface: none on kinds without such uploads. ``in_a_step``: the parts of others' are not asked.
    # Those started less than min_age_s ago are not asked for their parts (which a drain may be sending): not
    # reported as left either, but their step is (a partial step, or a step a save is writing).
    for up in store.tier.unfinished_uploads(min_age_s, in_a_step):
        if not in_a_step(up.key):
            continue
        age = None if up.modified is None else now - up.modified
        if _is_old(age, min_age_s):
            out.append(Debris(store.name, "unfinished upload", up.key, up.nbytes, upload=up, age_s=age))
        elif left is not None:
            left.append(Debris(store.name, "unfinished upload", up.key, up.nbytes, upload=up, age_s=age,
                                left=LEFT_YOUNG))
    return out


def modified(store: FileStore, rel: str) -> float | None:
    """When the file ``rel`` of a file tier last changed (seconds since the epoch), None if that cannot be told."""
    try:
        return store.tier.modified(rel)  # the Tier interface (tiers/base.py): None when the kind cannot tell
    except Exception:  # noqa: BLE001 - gone, not supported by the store, no answer: the age is unknown
        return None


def _age(store: FileStore, rel: str, now: float) -> float | None:
    mtime = modified(store, rel)
    return None if mtime is None else now - mtime


def files_age(store: FileStore, keys: Sequence[str], now: float | None = None) -> float | None:
    """Seconds since the newest of the files ``keys`` changed; None if one of them cannot tell (or none given)."""
    now = time.time() if now is None else now
    ages = [_age(store, k, now) for k in keys]
    return None if None in ages else min(ages, default=None)


def _is_old(age: float | None, min_age_s: float) -> bool:
    """Whether something last changed ``age`` seconds ago (None: unknown) is past gc's grace ``min_age_s``."""
    return min_age_s <= 0 or (age is not None and age >= min_age_s)


def _old_enough(store: FileStore, rel: str, min_age_s: float, now: float) -> bool:
    return min_age_s <= 0 or _is_old(_age(store, rel, now), min_age_s)


def remove_debris(store: FileStore, debris: list[Debris], *, min_age_s: float = TEMP_GRACE_S,
                  ) -> tuple[list[Debris], list[tuple[Debris, Exception]]]:
    """Remove what :func:`find_debris` (or :func:`find_unfinished_uploads`) found; a temporary file touched since
    (a write resumed) is left. Returns what was removed, and what could not be, with the tier's error (the rest
    is removed all the same)."""
    removed, failed = [], []
    now = time.time()
    for d in debris:
        try:
            if d.what == "partial step":
                store.tier.delete_prefix(d.key)
            elif d.upload is not None:
                store.tier.abort_upload(d.upload)
            elif _old_enough(store, d.key, min_age_s, now):
                store.tier.remove_temp_file(d.key)
                files = getattr(store.tier, "files", None)  # a directory tree: the directories it left empty too
                if files is not None and "/" in d.key:
                    remove_empty_dirs(files.root, d.key.rsplit("/", 1)[0])
            else:
                continue
        except (TierError, OSError) as exc:
            failed.append((d, exc))
            continue
        removed.append(d)
    return removed, failed


@dataclass
class StaleRun:
    """One run's directory in shared memory: its ranks, bytes, newest write, snapshot steps, and its state
    (:func:`run_state`; ``find_stale_runs`` returns the runs with no live engine)."""

    run_id: str
    path: str
    ranks: list[int] = field(default_factory=list)
    nbytes: int = 0
    age_s: float = 0.0
    steps: list[int] = field(default_factory=list)
    records: list[SlotMeta] = field(default_factory=list)  # those of snapshots meant for file tiers too
    snapshots: int = 0
    state: str = "closed"  # run_state(): "live", "closed" (close() ran) or "stale" (ended without close())

    @property
    def live(self) -> bool:
        return self.state == "live"

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "path": self.path, "ranks": self.ranks, "bytes": self.nbytes,
                "age_s": round(self.age_s, 1), "steps": self.steps, "state": self.state}


def lock_path(run_id: str) -> str:
    """Where :func:`tiered_ckpt.locking.lock_dir` keeps the ``$TMPDIR`` locks of ``run_id`` (not created)."""
    return os.path.join(tmp_lock_base(), run_id)


def lock_dirs(run_id: str, shm_paths: str | Sequence[str] = ()) -> list[str]:
    """Every place a lock of ``run_id`` can be: beside its slots in each shm path, and the ``$TMPDIR`` one."""
    paths = [shm_paths] if isinstance(shm_paths, str) else list(shm_paths)
    return [shm_lock_path(p, run_id) for p in paths] + [lock_path(run_id)]


def _held(path: str, mode: int) -> bool | None:
    """True if another process holds a lock on ``path`` that conflicts with ``mode``; None if there is no such
    file. Opened read-only, never created (flock does not care how the file was opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # removed by a closing engine while we looked, or never there
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def run_state(run_id: str, shm_paths: str | Sequence[str] = (), *, ranks_only: bool = False) -> str:
    """``"live"``: an engine (or its drain worker) holds a lock of ``run_id`` (beside its slots in one of
    ``shm_paths``, or in the ``$TMPDIR`` lock directory); ``"stale"``: an engine's lock file is left but nobody
    holds it (the process ended without ``close()``: killed, crashed); ``"closed"``: no such file (``close()``
    removes its own). Reads only. ``ranks_only``: skip ``run.lock`` (gc, holding it itself)."""
    left = False
    for directory in lock_dirs(run_id, shm_paths):
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".lock"))
        except OSError:
            continue
        for name in names:
            if ranks_only and name == RUN_LOCK:
                continue
            # Every engine of the run shares run.lock; each holds its rank's lock alone.
            held = _held(os.path.join(directory, name), fcntl.LOCK_EX if name == RUN_LOCK else fcntl.LOCK_SH)
            if held:  # an engine, or a drain worker still running (fencing.py): either may be writing
                return "live"
            # Only an engine's locks left unheld say it ended without close(); a worker's may stay after it exits.
            left = left or (held is False and (name == RUN_LOCK or name.startswith("rank_")))
    return "stale" if left else "closed"


def _run_is_live(run_id: str, shm_paths: str | Sequence[str] = ()) -> bool:
    """True if an engine holds a lock of ``run_id`` (reads only)."""
    return run_state(run_id, shm_paths) == "live"


def list_runs(shm_path: str) -> list[StaleRun]:
    """Every run of this user with a directory in ``shm_path`` (an shm tier's ``path``), live or not."""
    base = os.path.join(shm_path, _user_name())
    try:
        run_ids = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    now = time.time()
    out = []
    for run_id in run_ids:
        path = os.path.join(base, run_id)
        if run_id == LOCKS_DIR or not _RUN_ID.fullmatch(run_id) or not os.path.isdir(path) or os.path.islink(path):
            continue
        run = StaleRun(run_id, path, state=run_state(run_id, shm_path))
        newest = 0.0
        steps = set()
        for dirpath, _, files in os.walk(path):
            head = os.path.relpath(dirpath, path).split("/", 1)[0]
            if head.startswith("rank_") and head[5:].isdigit() and int(head[5:]) not in run.ranks:
                run.ranks.append(int(head[5:]))
            for f in files:
                full = os.path.join(dirpath, f)
                try:
                    st = os.stat(full)
                except OSError:  # removed while we looked
                    continue
                run.nbytes += st.st_size
                newest = max(newest, st.st_mtime)
                meta = _snapshot_meta(full) if f.startswith("slot_") and f.endswith(".json") else None
                if meta is not None:
                    steps.add(meta.step)
                    if meta.persistent:
                        run.records.append(meta)
                    run.snapshots += 1
        run.ranks.sort()
        run.steps = sorted(steps)
        run.age_s = now - newest if newest else 0.0
        out.append(run)
    return out


def _snapshot_meta(path: str) -> SlotMeta | None:
    """A slot record (``rank_RRRRR/slot_i.json``), None if it is unreadable or malformed."""
    from .snapshot_record import SlotMeta

    try:
        with open(path, "rb") as f:
            return SlotMeta.from_json(f.read(), path, "shm")
    except (OSError, TieredCkptError):
        return None


def find_stale_runs(shm_path: str) -> list[StaleRun]:
    """Runs of this user with snapshots in ``shm_path`` and no live engine."""
    return [run for run in list_runs(shm_path) if not run.live]


_LOCK_FILE = re.compile(r"(rank|worker)_\d{5,}\.lock|run\.lock")


@dataclass
class StaleLocks:
    """The lock directory of a run with no live engine and no shared memory, which no :class:`StaleRun` takes
    along: what an engine of a run without an shm tier leaves in ``$TMPDIR`` when it is killed, or one killed
    before its first slot (or whose slots went without gc) beside the slots (``@locks/``)."""

    run_id: str
    path: str
    state: str  # run_state(): "stale" or "closed"

    def to_dict(self) -> dict:
        return {"what": "stale locks", "run_id": self.run_id, "path": self.path, "state": self.state}


def find_stale_locks(shm_paths: Sequence[str], *, tmpdir: bool = True) -> list[StaleLocks]:
    """Lock directories (in each shm path's ``@locks/``, and with ``tmpdir`` the ``$TMPDIR`` one) of runs that
    have no directory of slots in ``shm_paths`` and no live engine. Reads only."""
    user = _user_name()
    out = []
    for base in [*(os.path.join(p, user, LOCKS_DIR) for p in shm_paths), *([tmp_lock_base()] if tmpdir else [])]:
        try:
            run_ids = sorted(os.listdir(base))
        except OSError:
            continue
        for run_id in run_ids:
            path = os.path.join(base, run_id)
            if not _RUN_ID.fullmatch(run_id) or os.path.islink(path) or not os.path.isdir(path):
                continue
            try:  # a lock directory holds lock files and nothing else (TIERED_CKPT_LOCK_DIR may be a shared place)
                names = os.listdir(path)
            except OSError:
                continue
            if not names or not all(_LOCK_FILE.fullmatch(n) for n in names):
                continue
            if any(os.path.lexists(os.path.join(p, user, run_id)) for p in shm_paths):
                continue  # a run with shared memory: find_stale_runs finds it, its locks go with it
            state = run_state(run_id, shm_paths)
            if state != "live":
                out.append(StaleLocks(run_id, path, state))
    return out


def remove_stale_locks(locks: StaleLocks) -> bool:
    """Remove the lock files of ``locks`` that nobody holds (each taken while it is unlinked, as a releasing
    engine does: one taken meanwhile stays), then the directory if that left it empty. Whether it is gone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(locks.path):
            if _LOCK_FILE.fullmatch(name):
                remove_if_unheld(os.path.join(locks.path, name))
    with contextlib.suppress(OSError):
        os.rmdir(locks.path)
    return not os.path.lexists(locks.path)


def remove_stale_run(run: StaleRun, shm_path: str | None = None) -> None:
    """Remove the shared memory of a run with no live engine, and its lock files.

    The run's ``run.lock`` (beside its slots) is taken exclusively first: that fails if an engine of the run is
    alive, whatever its ``TMPDIR``, and no engine of the run can start until the removal is done. ``shm_path``:
    the shm path the run was listed in (default: the one above ``run.path``)."""
    shm_path = shm_path or os.path.dirname(os.path.dirname(run.path))
    directory = shm_lock_path(shm_path, run.run_id)
    os.makedirs(directory, 0o700, exist_ok=True)  # beside the run's slots, in this user's private directory
    fd = os.open(os.path.join(directory, RUN_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockedError(f"run {run.run_id!r} has a live engine now (it holds {directory}/{RUN_LOCK}); "
                                 f"its shared memory {run.path} was not removed") from None
        if run_state(run.run_id, shm_path, ranks_only=True) == "live":  # between its two locks, or a $TMPDIR lock
            raise RunLockedError(f"run {run.run_id!r} has a live engine now; its shared memory {run.path} was "
                                 "not removed")
        shutil.rmtree(run.path)
        for name in os.listdir(directory):
            if name != RUN_LOCK:  # one an engine took meanwhile (waiting for run.lock now) stays its own
                remove_if_unheld(os.path.join(directory, name))
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, RUN_LOCK))  # while held: a starting engine opens a fresh one
        with contextlib.suppress(OSError):
            os.rmdir(directory)
        shutil.rmtree(lock_path(run.run_id), ignore_errors=True)  # $TMPDIR lock files of older versions
    finally:
        os.close(fd)
