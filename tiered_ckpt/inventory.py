"""What is on a tier: steps with their state (committed or partial), size and age; verification by re-hashing.

Used by the ``ls``, ``inspect``, ``verify`` and ``gc`` commands; reads only, never changes a tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .checksum import ALGORITHM, HashingStream
from .errors import BlobNotFoundError, CorruptionError, TierError
from .file_store import FileStore
from .megatron.loadable import is_megatron_file
from .memory_store import MemoryStore


@dataclass
class StepInfo:
    tier: str
    step: int
    state: str  # "committed", "partial" (files or rank votes but no checkpoint manifest), "snapshot" (memory)
    nbytes: int
    age_s: float | None
    files: int
    ranks: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"tier": self.tier, "step": self.step, "state": self.state, "bytes": self.nbytes,
                "age_s": None if self.age_s is None else round(self.age_s, 1), "files": self.files,
                "ranks": self.ranks}


def file_steps(store: FileStore) -> list[StepInfo]:
    keys = store.tier.list("")
    committed = {s for s in map(store.layout.parse_manifest_key, keys) if s is not None}
    present = {store.layout.parse_step_dir(k.split("/", 1)[0]) for k in keys} - {None}
    now = time.time()
    out = []
    for step in sorted(present | committed):
        if step in committed:
            try:
                m = store.read_manifest(step)
                out.append(StepInfo(store.name, step, "committed", m.total_bytes, now - m.created, len(m.files),
                                    sorted({f.rank for f in m.files})))
                continue
            except (CorruptionError, TierError) as exc:
                out.append(StepInfo(store.name, step, f"corrupt manifest ({exc})", 0, None, 0))
                continue
        prefix = store.layout.step_dir(step) + "/"
        files = [k for k in keys if k.startswith(prefix)]
        size = 0
        for k in files:
            try:
                size += store.tier.size(k)
            except BlobNotFoundError:
                pass
        out.append(StepInfo(store.name, step, "partial", size, None, len(files),
                            sorted(store.rank_manifests(step))))
    return out


def memory_steps(store: MemoryStore, ranks: list[int] | None = None) -> list[StepInfo]:
    now = time.time()
    out = []
    for rank in ranks if ranks is not None else memory_ranks(store):
        view = MemoryStore(store.tier, rank, store.nslots)
        for _, meta in sorted(view.metas().items()):
            out.append(StepInfo(store.name, meta.step, "snapshot", meta.total_bytes, now - meta.created,
                                len(meta.items), [rank]))
    return sorted(out, key=lambda s: (s.step, s.ranks))


def memory_ranks(store: MemoryStore) -> list[int]:
    ranks = set()
    for key in store.tier.list(""):
        head = key.split("/", 1)[0]
        if head.startswith("rank_") and head[5:].isdigit():
            ranks.add(int(head[5:]))
    return sorted(ranks)


@dataclass
class VerifyReport:
    tier: str
    step: int
    checked: int = 0
    nbytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(store: FileStore, step: int, progress: bool = False) -> VerifyReport:
    """Re-hash every file of a committed step against its manifest (a progress bar on a terminal)."""
    from tqdm import tqdm

    report = VerifyReport(store.name, step)
    try:
        manifest = store.read_manifest(step)
    except (CorruptionError, TierError) as exc:
        report.problems.append(str(exc))
        return report
    bar = tqdm(manifest.files, desc=f"verify {store.name} step {step}", unit="file", disable=not progress,
               leave=False)
    for entry in bar:
        try:
            blob = store.tier.read_blob(entry.key)
        except (TierError, OSError) as exc:
            report.problems.append(f"{entry.key}: cannot read: {exc}")
            continue
        stream = HashingStream([blob])
        for _ in stream:
            pass
        report.checked += 1
        report.nbytes += stream.nbytes
        if stream.nbytes != entry.size:
            report.problems.append(f"{entry.key}: size {stream.nbytes}, manifest says {entry.size}")
        elif f"{ALGORITHM}:{stream.hexdigest}" != entry.checksum:
            report.problems.append(f"{entry.key}: checksum mismatch")
        elif is_megatron_file(entry.key):  # intact, but would Megatron-LM load it?
            problem = _megatron_refusal(store, entry.key)
            if problem:
                report.problems.append(problem)
    return report


def _megatron_refusal(store: FileStore, key: str) -> str | None:
    from .megatron.loadable import explain, file_refusals

    try:
        refused = file_refusals(store.tier, key)
    except Exception as exc:  # not a readable torch file: say so rather than pass it
        return f"{key}: not a readable torch file ({type(exc).__name__}: {exc})"
    return explain(key, refused) if refused else None
