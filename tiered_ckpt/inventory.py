"""What is on a tier: steps with their state (committed or partial), size and age; verification by re-hashing.

Used by the ``ls``, ``inspect``, ``verify`` and ``gc`` commands; reads only, never changes a tier. Opening a
tier for them must not change anything either: :func:`absent_before_open` says, before a tier is built (some
kinds create their directory when built), whether there is anything to open at all, and :func:`absent_location`
asks a built URL tier whether its directory or bucket exists. "Nothing there" (no such directory or bucket) and
"could not look" (:class:`Unreadable`: unreachable, permission denied) are different answers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from .errors import BlobNotFoundError, ConfigError, CorruptionError, RangeError, TieredCkptError, TierError
from .housekeeping import files_age
from .layouts.foreign import DCP_STATE, foreign_step_dirs

if TYPE_CHECKING:
    from .config import TierConfig
    from .file_store import FileStore
    from .snapshot_record import SlotMeta
    from .store import SnapshotStore
    from .tiers.base import Tier

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
UNREADABLE_MANIFEST = "unreadable manifest"  # a step row whose manifest the tier would not serve (not damage)


class Unreadable(TieredCkptError):
    """A tier that could not be looked at (unreachable, permission denied): nothing is known of its contents."""


def absent_before_open(cfg: TierConfig, run_id: str, user: str, where_set: str | None = None) -> str | None:
    """Why a ``local`` or ``shm`` tier has nothing to open (its directory does not exist), or None.

    Checked before the tier is built, because building those kinds creates the directory. A path that is a file
    is a usage error (:class:`ConfigError`; ``where_set``: where the path was given, ``tiers.yaml: tiers[0].path``,
    else it came from the command line); one that cannot be looked at raises :class:`Unreadable`."""
    path = getattr(cfg.options, "path", None)
    if cfg.kind not in ("local", "shm") or not isinstance(path, str):
        return None
    path = os.path.abspath(os.path.expanduser(path))
    where = path if cfg.kind == "local" else os.path.join(path, user, run_id)
    if where_set is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{path} is a file, not a directory: set {where_set} to the tier's directory")
    try:
        os.stat(where)
    except FileNotFoundError:
        if cfg.kind == "local":  # named by the tier (--config): say which directory; a path given says itself
            return f"no such directory ({where})" if where_set is not None else "no such directory"
        return f"no snapshots of run {run_id!r} ({where} does not exist)"
    except OSError as exc:
        raise Unreadable(f"{where}: {exc.strerror or exc}") from None
    if not os.path.isdir(where):
        hint = (f"; to read it as a configuration: --config {path}" if path.endswith(CONFIG_SUFFIXES) else
                "; give the directory that holds the checkpoints (or --config tiers.yaml)")
        raise ConfigError(f"{path} is a file, not a checkpoint directory{hint}")
    if not os.access(where, os.R_OK | os.X_OK):
        raise Unreadable(f"{where}: permission denied")
    return None


def absent_location(tier: Tier) -> str | None:
    """For a tier on an fsspec file system: why its directory or bucket is not there, or None if it is.

    Raises :class:`Unreadable` when the store could not be asked (no answer, access denied, no credentials) and
    :class:`ConfigError` when the URL names a file."""
    why = tier.missing_location()  # the Tier interface (tiers/base.py): a kind that can tell, plugins too
    if why is not None:
        return why
    fs, root = getattr(tier, "fs", None), getattr(tier, "root", None)
    if fs is None or not isinstance(root, str) or not hasattr(fs, "info"):
        return None
    url = getattr(tier.options, "url", root)
    try:
        info = fs.info(root)
    except FileNotFoundError:
        info = None
    except Exception as exc:
        from .tiers.fsspec_tier import FsspecTier

        # the fsspec tiers' own reading of their store's errors (a bare "Forbidden" gets its hint)
        err = tier._tier_exception(exc, None, "look at", root) if isinstance(tier, FsspecTier) else None
        raise Unreadable(str(err) if err is not None else _redacted(tier, _why(exc))) from None
    if info is not None:
        if info.get("type") == "file":
            raise ConfigError(_redacted(tier, f"{url} is a file, not a checkpoint directory"))
        return None
    from .tiers.fsspec_tier import BUCKET_PROTOCOLS, missing_bucket

    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if protocol in BUCKET_PROTOCOLS:  # is it the bucket that is missing?
        try:
            why = missing_bucket(fs, root)
        except Exception as exc:
            raise Unreadable(_redacted(tier, f"bucket {root.split('/', 1)[0]!r}: {_why(exc)}")) from None
        return why or "nothing stored under this prefix"
    return "no such directory"


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"


def _redacted(tier: Tier, text: str) -> str:
    redact = getattr(tier, "_redact", None)
    return redact(text) if callable(redact) else text


@dataclass
class StepInfo:
    tier: str
    step: int | None  # None: a row about a whole run whose snapshots could not be read
    state: str  # "committed", "partial" (files or rank votes but no checkpoint manifest), "snapshot ..." (memory)
    nbytes: int
    age_s: float | None
    files: int
    ranks: list[int] = field(default_factory=list)
    run_id: str | None = None  # memory tiers: whose snapshot it is
    snapshots: list[SlotMeta] = field(default_factory=list)  # memory tiers: the records of the row (not in to_dict)

    def to_dict(self) -> dict:
        out = {"tier": self.tier, "step": self.step, "state": self.state, "bytes": self.nbytes,
               "age_s": None if self.age_s is None else round(self.age_s, 1), "files": self.files,
               "ranks": self.ranks}
        if self.run_id is not None:
            out["run_id"] = self.run_id
        return out


def file_steps(store: FileStore) -> list[StepInfo]:
    from .dcp.inventory import plain_step_dirs

    keys = store.tier.list("")
    foreign = foreign_step_dirs(keys, store.tier)
    committed = store.layout.committed_in(keys)
    present = {store.layout.parse_step_dir(k.split("/", 1)[0]) for k in keys} - {None}
    now = time.time()
    out = []
    for step in sorted(present | committed):
        if step in committed:
            try:
                m = store.read_manifest(step)
                # the ranks that committed it: a rank whose part is ranges of another's file lists no file of its own
                voters = {r for r in m.extra.get("ranks", ()) if isinstance(r, int)}
                out.append(StepInfo(store.name, step, "committed", m.total_bytes, now - m.created, len(m.files),
                                    sorted({f.rank for f in m.files} | voters)))
                continue
            except BlobNotFoundError:
                continue  # removed since it was listed (a live job's retention)
            except Exception as exc:  # noqa: BLE001 - a store's own error too: that step's row says so
                what = UNREADABLE_MANIFEST if cannot_read(exc) else "corrupt manifest"
                out.append(StepInfo(store.name, step, f"{what} ({exc})", 0, None, 0))
                continue
        prefix = store.layout.step_dir(step) + "/"
        files = [k for k in keys if k.startswith(prefix)]
        size = store.tier.stored_bytes(prefix)
        state = foreign.get(store.layout.step_dir(step), "partial")  # Megatron-LM's, DLRover's or DCP's own
        age = files_age(store, files, now) if state == "partial" else None  # another program's: not stat'ed
        out.append(StepInfo(store.name, step, state, size, age, len(files),
                            sorted(store.rank_manifests(step))))
    if "" in plain_step_dirs(keys):  # the directory given is a DCP checkpoint itself (issue #14)
        out.append(StepInfo(store.name, None, DCP_STATE, sum(store.tier.size(k) for k in keys), None, len(keys)))
    return out


def memory_steps(store: SnapshotStore, ranks: list[int] | None = None) -> list[StepInfo]:
    """One row per step (and run, and kind of save) in ``store``, as for a file tier: the ranks that hold a
    snapshot of it, their bytes and items summed, the age of the newest. A rank with two snapshots of one step (a
    step saved again) counts once in ``ranks``, both in the sizes."""
    now = time.time()
    rows: dict[tuple, StepInfo] = {}
    for rank in ranks if ranks is not None else memory_ranks(store):
        view = store.for_rank(rank)
        for _, meta in sorted(view.metas().items()):
            key = (meta.step, meta.persistent, meta.run_id)
            row = rows.get(key)
            if row is None:
                row = rows[key] = StepInfo(store.name, meta.step,
                                           "snapshot" if meta.persistent else "snapshot (non-persistent)", 0, None,
                                           0, [], run_id=meta.run_id)
            row.nbytes += meta.total_bytes
            row.files += len(meta.items)
            row.age_s = min(now - meta.created, row.age_s if row.age_s is not None else float("inf"))
            row.ranks = sorted({*row.ranks, rank})
            row.snapshots.append(meta)
    return sorted(rows.values(), key=lambda s: (s.step, s.ranks))


def memory_ranks(store: SnapshotStore) -> list[int]:
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
    problems: list[str] = field(default_factory=list)  # damage found: a file missing, cut short or changed
    against: str = "manifest"  # what the bytes were checked against (FOREIGN_CHECK: a step Megatron-LM wrote)
    notes: list[str] = field(default_factory=list)  # said, not failures
    # What could not be read (permission denied, a store's error): nothing is said about those bytes, so they
    # are never reported as damage (an operator would delete a healthy step).
    unread: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unread

    @property
    def status(self) -> str:
        return "FAILED" if self.problems else "UNREADABLE" if self.unread else "OK"

    def failed_to_read(self, what: str, exc: BaseException) -> None:
        """``exc`` while reading ``what``: damage when the file is not there, else a read failure."""
        text = f"{what}: cannot read: {exc}" if isinstance(exc, TieredCkptError | OSError) else \
            f"{what}: cannot read: {type(exc).__name__}: {exc}"
        (self.unread if cannot_read(exc) else self.problems).append(text)


def cannot_read(exc: BaseException) -> bool:
    """Whether ``exc``, raised while reading a file, says it could not be read rather than that it is damaged or
    missing (a missing file of a committed step is damage)."""
    if isinstance(exc, CorruptionError | BlobNotFoundError | RangeError | FileNotFoundError):
        return False
    return isinstance(exc, TierError | OSError) or not isinstance(exc, TieredCkptError)


def verify_step(store: FileStore, step: int, progress: bool | TextIO = False) -> VerifyReport:
    """Re-hash every file of a committed step against its manifest.

    ``progress``: True for a progress bar on stderr, or a stream to draw it on. It counts the manifest's bytes
    (its total is the step's size) and ends at 100%, files that failed included."""
    from .megatron.loadable import is_megatron_file
    from .progress import progress_bar

    report = VerifyReport(store.name, step)
    try:
        manifest = store.read_manifest(step)
    except CorruptionError as exc:
        report.problems.append(str(exc))
        return report
    except Exception as exc:  # noqa: BLE001 - a store's own error too (gcsfs, adlfs, a plugin): not read
        report.failed_to_read("the manifest", exc)
        return report
    stream_out: Any = None if isinstance(progress, bool) else progress
    with progress_bar(total=sum(e.size for e in manifest.files), desc=f"verify {store.name} step {step}",
                      disable=not progress, file=stream_out, leave=True) as bar:
        for entry in manifest.files:
            try:
                _verify_file(store, entry, report, is_megatron_file)
            finally:
                bar.update(entry.size)
    if manifest.layout == "dcp" and report.ok:  # DCP's .metadata against the files (issue #14)
        report.problems += __import__("tiered_ckpt.dcp.inventory", fromlist=["_"]).structure_problems(store, manifest)
    return report


def _verify_file(store: FileStore, entry: Any, report: VerifyReport, is_megatron_file: Any) -> None:
    from .checksum import hasher_for, new_hasher

    # Hashed while it is read, under the algorithm the entry names (xxh3-128, or crc32 for Megatron's file written
    # in place by the DP ranks); an unknown one is hashed as xxh3 and so reported as a mismatch.
    hasher = hasher_for(entry.checksum) or new_hasher()
    algorithm = entry.checksum.split(":", 1)[0]
    try:
        blob = store.tier.read_blob_hashed(entry.key, hasher, max_size=entry.size)  # a far larger file: never whole
    except CorruptionError as exc:  # found while reading (larger than its manifest says, a split blob's bad piece)
        report.problems.append(f"{entry.key}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 - a store's own error too (gcsfs, adlfs, a plugin), no memory
        report.failed_to_read(entry.key, exc)
        return
    nbytes, hexdigest = blob.numel(), hasher.hexdigest()
    report.checked += 1
    report.nbytes += nbytes
    if nbytes != entry.size:
        report.problems.append(f"{entry.key}: size {nbytes}, manifest says {entry.size}")
    elif f"{algorithm}:{hexdigest}" != entry.checksum:
        report.problems.append(f"{entry.key}: checksum mismatch: the manifest says {entry.checksum}, the bytes "
                               f"stored hash to {algorithm}:{hexdigest} (same size: damaged or replaced in place)")
    elif is_megatron_file(entry.key):  # intact, but would Megatron-LM load it?
        problem = _megatron_refusal(store, entry.key)
        if problem:
            report.problems.append(problem)


#: What a step Megatron-LM (or DLRover) wrote is verified against: it has no manifest of ours.
FOREIGN_CHECK = "zip CRC-32s and Megatron's allow-list (no manifest: written by Megatron-LM or DLRover)"


def foreign_megatron_steps(store: FileStore) -> list[int]:
    """The steps of ``store`` that Megatron-LM or DLRover wrote (their files, no manifest of ours), oldest first."""
    from .layouts.foreign import MEGATRON_STATE

    found = foreign_step_dirs(store.tier.list(""), store.tier)
    return sorted(n for d, state in found.items()
                  if state == MEGATRON_STATE and (n := store.layout.parse_step_dir(d)) is not None)


def verify_foreign_step(store: FileStore, step: int, progress: bool | TextIO = False) -> VerifyReport:
    """Check a step Megatron-LM wrote as far as its files allow: each torch file's records against the CRC-32s
    its zip directory gives (torch computes them on save), and its pickle against Megatron's weights-only
    loader. Damage in place is found; a file missing altogether is not (nothing lists the files it should have)."""
    from .megatron.lazy_torch import open_lazy
    from .megatron.loadable import explain, is_megatron_file, refused_globals
    from .progress import progress_bar

    report = VerifyReport(store.name, step, against=FOREIGN_CHECK)
    step_dir = store.layout.step_dir(step)
    try:
        keys = sorted(k for k in store.tier.list(step_dir + "/") if is_megatron_file(k))
        sizes = {k: store.tier.size(k) for k in keys}
    except (TierError, OSError) as exc:
        report.unread.append(f"{step_dir}: cannot list its files: {exc}")
        return report
    stream_out: Any = None if isinstance(progress, bool) else progress
    no_crcs = []
    with progress_bar(total=sum(sizes.values()), desc=f"verify {store.name} step {step}", disable=not progress,
                      file=stream_out, leave=True) as bar:
        for key in keys:
            try:
                torch_file = open_lazy(store.tier, key, unpickle=False)
                mismatches = torch_file.damaged_records(bar.update)
                if mismatches is None:
                    no_crcs.append(key)
                else:
                    report.problems += [f"{key}: record {m} (damaged)" for m in mismatches]
                refused = refused_globals(torch_file.pickle_bytes())
                if refused:
                    report.problems.append(explain(key, refused))
            except (TierError, OSError) as exc:
                report.failed_to_read(key, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a truncated or overwritten file: this file failed
                report.problems.append(f"{key}: not a readable torch file ({type(exc).__name__}: {exc})")
                continue
            report.checked += 1
            report.nbytes += sizes[key]
    if no_crcs:
        report.notes.append(f"{len(no_crcs)} file(s) written without CRC-32s (torch's config.save.compute_crc32 = "
                            f"False): only their structure and pickle were checked ({', '.join(no_crcs[:3])})")
    if not keys:
        report.problems.append(f"{step_dir}: no Megatron file (model_optim_rng.pt, distrib_optim.pt) is there")
    elif report.ok:
        _check_foreign_structure(store, step, report)
    return report


def _check_foreign_structure(store: FileStore, step: int, report: VerifyReport) -> None:
    """A problem where the step's directories show something missing (an ``mp_rank_*`` directory of the args'
    TP size, a file the other directories have), as the loaders and ``convert`` would refuse it."""
    from .errors import LayoutMismatchError
    from .megatron.legacy import detect

    try:
        detect(store.tier, step=step)
    except LayoutMismatchError as exc:
        report.problems.append(str(exc))
    except Exception as exc:  # noqa: BLE001 - each file was read above; this adds only the structure
        report.notes.append(f"the step's directory structure was not checked: {exc}")


def _megatron_refusal(store: FileStore, key: str) -> str | None:
    from .megatron.loadable import explain, file_refusals

    try:
        refused = file_refusals(store.tier, key)
    except Exception as exc:  # not a readable torch file: say so rather than pass it
        return f"{key}: not a readable torch file ({type(exc).__name__}: {exc})"
    return explain(key, refused) if refused else None
