"""What ``tiered-ckpt gc`` finds and removes: debris on file tiers and the shared memory of dead runs.

Nothing here runs on its own: the engine's retention removes only what it owns after a commit, and this module
only acts on an explicit command (dry run first). Finding is read-only: no directory or lock file is created.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import TieredCkptError, TierError
from .tiers.base import _user_name

if TYPE_CHECKING:
    from .file_store import FileStore


@dataclass
class Debris:
    tier: str
    what: str  # "partial step" or "temporary file"
    key: str
    nbytes: int

    def to_dict(self) -> dict:
        return {"tier": self.tier, "what": self.what, "key": self.key, "bytes": self.nbytes}


def find_debris(store: FileStore) -> list[Debris]:
    """Uncommitted steps older than the newest committed one, and temporary files of unfinished writes."""
    keys = store.tier.list("")
    committed = {s for s in map(store.layout.parse_manifest_key, keys) if s is not None}
    out = []
    if committed:
        newest = max(committed)
        sizes: dict[int, int] = {}
        for key in keys:
            step = store.layout.parse_step_dir(key.split("/", 1)[0])
            if step is not None and step < newest and step not in committed:
                sizes[step] = sizes.get(step, 0) + store.tier.size(key)
        out += [Debris(store.name, "partial step", store.layout.step_dir(s), n) for s, n in sorted(sizes.items())]
    files = getattr(store.tier, "files", store.tier)  # local and shm: their BlobFiles; fsspec: the tier itself
    if hasattr(files, "temp_files"):
        for rel in files.temp_files():
            try:
                size = store.tier.size(rel)
            except (TierError, OSError):
                continue
            out.append(Debris(store.name, "temporary file", rel, size))
    return out


def remove_debris(store: FileStore, debris: list[Debris]) -> None:
    for d in debris:
        if d.what == "partial step":
            store.tier.delete_prefix(d.key)
        else:
            getattr(store.tier, "files", store.tier).remove_temp_file(d.key)


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
    snapshots: int = 0
    state: str = "closed"  # run_state(): "live", "closed" (close() ran) or "stale" (ended without close())

    @property
    def live(self) -> bool:
        return self.state == "live"

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "path": self.path, "ranks": self.ranks, "bytes": self.nbytes,
                "age_s": round(self.age_s, 1), "steps": self.steps, "state": self.state}


def lock_path(run_id: str) -> str:
    """Where :func:`tiered_ckpt.locking.lock_dir` keeps ``run_id``'s lock files, computed without creating it."""
    base = os.environ.get("TIERED_CKPT_LOCK_DIR") or os.path.join(tempfile.gettempdir(),
                                                                  f"tiered_ckpt-{_user_name()}")
    return os.path.join(base, run_id)


def run_state(run_id: str) -> str:
    """``"live"``: an engine on this node holds a lock of ``run_id``; ``"stale"``: a lock file is left but nobody
    holds it (the process ended without ``close()``: killed, crashed); ``"closed"``: no lock file (``close()``
    removes its own). Reads only: the lock files are opened read-only, nothing is created."""
    directory = lock_path(run_id)
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".lock"))
    except (FileNotFoundError, NotADirectoryError):
        return "closed"
    left = False
    for name in names:
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # removed by a closing engine while we looked
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a live engine holds LOCK_EX
            fcntl.flock(fd, fcntl.LOCK_UN)
            left = True
        except BlockingIOError:
            return "live"
        finally:
            os.close(fd)
    return "stale" if left else "closed"


def _run_is_live(run_id: str) -> bool:
    """True if any rank's lock of ``run_id`` is held by a live engine on this node (reads only)."""
    return run_state(run_id) == "live"


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
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        run = StaleRun(run_id, path, state=run_state(run_id))
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
                step = _snapshot_step(full) if f.startswith("slot_") and f.endswith(".json") else None
                if step is not None:
                    steps.add(step)
                    run.snapshots += 1
        run.ranks.sort()
        run.steps = sorted(steps)
        run.age_s = now - newest if newest else 0.0
        out.append(run)
    return out


def _snapshot_step(path: str) -> int | None:
    """The step of a slot record (``rank_RRRRR/slot_i.json``), None if it is unreadable or malformed."""
    from .memory_store import SlotMeta

    try:
        with open(path, "rb") as f:
            return SlotMeta.from_json(f.read(), path, "shm").step
    except (OSError, TieredCkptError):
        return None


def find_stale_runs(shm_path: str) -> list[StaleRun]:
    """Runs of this user with snapshots in ``shm_path`` and no live engine on this node."""
    return [run for run in list_runs(shm_path) if not run.live]


def remove_stale_run(run: StaleRun) -> None:
    import shutil

    if _run_is_live(run.run_id):  # it came back to life since it was listed
        raise RuntimeError(f"run {run.run_id!r} has a live engine now; not removed")
    shutil.rmtree(run.path)
    shutil.rmtree(lock_path(run.run_id), ignore_errors=True)  # its lock files go with it
