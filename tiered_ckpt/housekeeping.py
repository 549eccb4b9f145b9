"""What ``tiered-ckpt gc`` finds and removes: debris on file tiers and the shared memory of dead runs.

Nothing here runs on its own: the engine's retention removes only what it owns after a commit, and this module
only acts on an explicit command (dry run first).
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field

from .errors import TierError
from .file_store import FileStore
from .locking import lock_dir
from .tiers.base import _user_name


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
    run_id: str
    path: str
    ranks: list[int] = field(default_factory=list)
    nbytes: int = 0
    age_s: float = 0.0

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "path": self.path, "ranks": self.ranks, "bytes": self.nbytes,
                "age_s": round(self.age_s, 1)}


def _run_is_live(run_id: str) -> bool:
    """True if any rank's lock of ``run_id`` is held by a live engine on this node."""
    directory = lock_dir(run_id)
    for name in os.listdir(directory):
        if not name.endswith(".lock"):
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def find_stale_runs(shm_path: str) -> list[StaleRun]:
    """Runs of this user with snapshots in ``shm_path`` and no live engine on this node."""
    base = os.path.join(shm_path, _user_name())
    if not os.path.isdir(base):
        return []
    now = time.time()
    out = []
    for run_id in sorted(os.listdir(base)):
        path = os.path.join(base, run_id)
        if not os.path.isdir(path) or _run_is_live(run_id):
            continue
        run = StaleRun(run_id, path)
        newest = 0.0
        for dirpath, _, files in os.walk(path):
            head = os.path.relpath(dirpath, path).split("/", 1)[0]
            if head.startswith("rank_") and head[5:].isdigit() and int(head[5:]) not in run.ranks:
                run.ranks.append(int(head[5:]))
            for f in files:
                st = os.stat(os.path.join(dirpath, f))
                run.nbytes += st.st_size
                newest = max(newest, st.st_mtime)
        run.ranks.sort()
        run.age_s = now - newest if newest else 0.0
        out.append(run)
    return out


def remove_stale_run(run: StaleRun) -> None:
    import shutil

    if _run_is_live(run.run_id):  # it came back to life since it was listed
        raise RuntimeError(f"run {run.run_id!r} has a live engine now; not removed")
    shutil.rmtree(run.path)
    shutil.rmtree(lock_dir(run.run_id), ignore_errors=True)  # its lock files go with it
