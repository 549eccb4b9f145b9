"""The commit protocol on a file tier, written once above the tier primitives.

Per step and rank: each item's file is written under its layout path (the tier makes the write atomic), its
checksum computed while the bytes stream out; then the rank manifest. The committing rank writes the checkpoint
manifest once every rank's manifest is there, then the tracker. Retention runs only after a commit and never
removes the newest committed step. A step without its checkpoint manifest does not exist.

:class:`FileStore` implements the :class:`~tiered_ckpt.store.Store` protocol (docs/architecture.md): which rank
commits a step here, and when retention runs, are decided in :meth:`FileStore.commit`. Discovering committed steps
and reading their files verified is :mod:`tiered_ckpt.file_store_read`'s part of the class.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

import torch

from . import copy_gate
from . import events as ev
from .checksum import ALGORITHM, HashingStream
from .codecs import flat
from .codecs.byte_grouping import grouped_chunks, ungroup_
from .codecs.file_codecs import FileCodec, FlatFileCodec, ItemSource
from .codecs.transcode import item_source
from .compression import compress_chunks
from .config import TierConfig
from .crashpoints import crash_point
from .errors import BlobNotFoundError, CorruptionError, TierError
from .failure_records import record_failure, recorded_failure
from .file_store_read import CommittedFiles
from .file_streams import raw_pieces
from .layouts.base import Layout
from .layouts.foreign import foreign_step_dirs
from .locking import gone_ranks
from .manifest import (
    SAVE_KEY,
    CheckpointManifest,
    FileEntry,
    RankManifest,
    dump_checkpoint,
    dump_rank,
)
from .memory_store import MemoryStore
from .parallel import ParallelLayout, RankCoords, layout_changes
from .retry import call_with_retry
from .snapshot_record import UNVERIFIED, SlotMeta
from .step_read import read_committed_step, read_in_place_item
from .store import Store, Written
from .tiers.base import Chunk, StableChunks, Tier, as_memoryview, chunks_stable

log = logging.getLogger(__name__)
EARLIER_COMMITS = 16  # the commits before it a checkpoint manifest names ("earlier"): FileStore.wait_committed
Emit = Callable[[ev.Event], None]


#: On a node-local tier the write loop hands the tier at most this many bytes at a time (a remote tier gets the
#: chunks as made: an object store's writer borrows large ones without a copy). Before each piece, and each chunk,
#: it looks at the copy gate: while a save copies, the drain sleeps (copy_gate.py) instead of competing with it
#: for memory bandwidth and cores (the stream's hash of a piece runs beside the piece's write).
WRITE_PIECE = 32 << 20
#: How long a step saved again waits for a deletion of its old files still under way (``write_step``).
REMOVAL_WAIT_S = 300.0
# A commit by another run_id more than this (seconds, by the two machines' clocks: NTP keeps them far closer)
# after this store opened is another job writing the same directory at the same time, not an earlier run's step
# (FileStore._another_job_s). One committed before, or within it, is taken for an earlier run's.
CONCURRENT_JOB_MARGIN_S = 2.0
GONE_LOOK_S = 0.5  # how often a committing rank looks whether a missing rank of its node died (seen twice: dead)
RECORD_LOOK_S = 1.0  # a failure record already looked at (none, or another save's) is read again after this


class _Counting:
    """Counts the bytes of a chunk stream (the raw size before compression), handing them on in pieces of at
    most ``piece`` bytes (None: as they come), each after :func:`copy_gate.wait_clear`."""

    def __init__(self, chunks: Iterable[Chunk], piece: int | None = None):
        self._chunks = chunks
        self._piece = piece
        self.nbytes = 0
        self.stable = chunks_stable(chunks)  # pieces are views of the chunks: as stable as they are

    def __iter__(self):
        for c in self._chunks:
            mv = as_memoryview(c)
            self.nbytes += len(mv)
            piece = self._piece or len(mv)
            if len(mv) <= piece:
                copy_gate.wait_clear()
                yield mv
                continue
            for start in range(0, len(mv), piece):
                copy_gate.wait_clear()
                yield mv[start:start + piece]


def regroup(raw: torch.Tensor, grouped: bool, want: bool) -> Iterable[Chunk]:
    """The raw bytes of a flat file with byte grouping switched to ``want``."""
    if grouped == want:
        return [raw]
    header, data = FlatFileCodec.split(raw)
    info = flat.decode_header(header)
    prefix = raw[:raw.numel() - data.numel()]
    if want:
        return [prefix, *grouped_chunks(info, data)]
    data = data.clone()
    ungroup_(info, data)
    return [prefix, data]


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class GoneWatch:
    """Which of the ranks a commit waits for died on this node, from ``probe`` (:meth:`FileStore.gone_probe`):
    looked at most every ``GONE_LOOK_S``; a rank counts once seen dead at two looks in a row."""

    def __init__(self, probe: Callable[[list[int]], dict[int, str]] | None):
        self.probe = probe
        self._next = 0.0
        self._seen: set[int] = set()

    def confirmed(self, ranks: list[int]) -> dict[int, str]:
        """Of ``ranks``, those seen dead at this look and the last, each with its lock file."""
        if self.probe is None or time.monotonic() < self._next:
            return {}
        self._next = time.monotonic() + GONE_LOOK_S
        dead = self.probe(ranks)
        confirmed = {r: lock for r, lock in sorted(dead.items()) if r in self._seen}
        self._seen = set(dead)
        return confirmed


class FileStore(CommittedFiles):
    """One file tier seen through a layout, with this tier's compression and retry policy (its discovering and
    reading half: :class:`~tiered_ckpt.file_store_read.CommittedFiles`)."""

    def __init__(self, tier: Tier, cfg: TierConfig, layout: Layout, codecs: dict[str, FileCodec],
                 emit: Emit, run_id: str = "default", lock_dir: str | None = None):
        self.tier = tier
        # where this run's engines on this node hold their rank locks (locking.py): a committing rank stops
        # waiting for a rank of its node whose engine died (gone_ranks)
        self.lock_dir = lock_dir
        self.cfg = cfg
        self.layout = layout
        self.codecs = codecs
        self.emit = emit
        self.run_id = run_id
        self._opened = time.time()  # commits of other runs after this are another job's, running beside this one
        self._warned_jobs: set[str] = set()
        # committed manifests, for listings (steps_for_rank); a load reads the one it uses afresh (a step saved
        # again gets a new one, maybe committed by another process)
        self._manifests: dict[int, CheckpointManifest] = {}
        self._told_unreadable: set[tuple[int, str]] = set()  # (step, error) already warned of by steps_for_rank
        # Counts this store's commits and un-commits (a re-save replaces a manifest); the lock makes "no commit
        # since I began reading" and the cache entry one step for a reader (file_store_read.read_manifest).
        self._manifest_changes = 0
        self._manifest_lock = threading.Lock()
        self._started: set[tuple[int, int]] = set()  # (step, rank) whose marker this process wrote
        self._started_lock = threading.Lock()  # the tier's thread adds, its deletion thread removes
        self._held_back = False  # the last retention kept steps only because they were pinned
        # The step this process committed here last: retention counts steps up to it, and leaves any newer
        # committed step alone (an earlier run's, or this one's before it went back: docs/operations.md)
        self._newest_own: int | None = None
        # The saves this process committed here last, (step, save): each commit's manifest carries them
        # ("earlier"), so a rank waiting for a commit that retention has already retired sees it was made
        self._committed_saves: collections.deque[tuple[int, str]] = collections.deque(maxlen=EARLIER_COMMITS)
        self._warned_newer: tuple[int, ...] = ()
        self._warned_uploads = False  # retention could not list the uploads left open in what it removes
        self._retention = threading.Lock()  # retain() runs in whichever drain thread finishes a job
        # Steps retention un-committed whose files a deletion is removing (or is about to, beside the tier's next
        # write: drain.py): retention that runs meanwhile must not count them as debris and delete them again.
        self._removing: set[int] = set()
        self._removed = threading.Condition(self._retention)  # notified as steps leave _removing

    @property
    def name(self) -> str:
        return self.tier.name

    # ----- the Store protocol ------------------------------------------------------------------------------
    durable = True

    def slots(self) -> None:
        return None

    def files(self) -> FileStore:
        return self

    def clean_start(self) -> list[str]:
        return []  # debris of a killed writer is retention's (and ``gc``'s) business, never an engine start's

    def prepare(self, nbytes: int) -> None:
        pass

    def release_on_close(self, durable: Callable[[], set[int]]) -> None:
        return None

    def close(self) -> None:
        self.tier.close()

    def due(self, ordinal: int, persistent: bool) -> bool:
        # every ``every``-th save starting with the first, so a misconfigured tier shows up at once
        return persistent and (ordinal - 1) % self.cfg.every == 0

    def durable_steps(self) -> list[int]:
        return self.committed_steps()

    def loadable_steps(self, coords: RankCoords) -> list[int]:
        steps = self.steps_for_rank(coords)
        legacy = self.legacy_step() if not steps else None
        return [legacy] if legacy is not None else steps

    def write_step(self, step: int, coords: RankCoords, source: Store, *, slot: int | None,
                   pinned: Callable[[int], bool], hasher: Executor, node_ranks: list[int] | None = None,
                   wait_s: float = 0.0) -> Written:
        """This rank's files and manifest of ``step``, encoded from a snapshot or copied from a file tier."""
        sole = self._sole_writer(coords, node_ranks)
        with self._retention:
            # Written again (a job that went back) while a deletion of its old files runs, on this tier's
            # deletion thread or in retention on another tier's thread: the new files come after it. One that
            # never ran (its task lost to a failure) must not hold the step for ever.
            if not self._removed.wait_for(lambda: step not in self._removing, timeout=REMOVAL_WAIT_S):
                raise TierError(f"step {step} is saved again while the deletion of its old files here still runs "
                                f"after {REMOVAL_WAIT_S:.0f} s: not written here (the deletion would remove the "
                                "new files); the next save is tried afresh", tier=self.name)
        mem = source.slots()
        if mem is None:
            crash_point("drain.before_write")
            upper = source.files()
            assert upper is not None
            manifest = self.copy_rank_from(upper, step, coords, wait_s=wait_s, sole_writer=sole)
            crash_point("drain.after_write")
            return Written(step, sum(f.size for f in manifest.files), manifest=manifest)
        assert isinstance(mem, MemoryStore) and slot is not None
        meta = mem.snapshot(step, slot)
        mem.check_layout(meta, coords)  # never another layout's snapshot under this layout's name
        crash_point("drain.before_write")
        sources = mem.item_sources(meta)
        replaced = self._uncommit_for_rewrite(step, coords, meta.save_id) if sole or meta.save_id else []

        def checked() -> SlotMeta:
            # On another core while this tier is written: the checksums the saving process takes right after
            # its copy, then the slot checked against them. This rank's manifest is published only if the slot
            # still matches, so damage in memory is never stamped verified here. The write need not wait for the
            # checksums: bytes damaged before they are read are in the file whichever comes first, and damage
            # after the checksum is taken fails the check.
            settled = mem.await_checksums(meta)
            if settled.checksummed:
                mem.check_sources(settled, sources)
            return settled

        check = hasher.submit(checked)
        entries: list[FileEntry] = []
        try:
            job_scope = not self.tier.capabilities.node_local or (
                node_ranks is not None and len(set(node_ranks)) == coords.world_size)
            entries = [e for e in (self._write_item(step, coords, src, job_scope=job_scope) for src in sources)
                       if e is not None]
            meta = check.result()
            # A save of this step again may take the slot of a memory tier below the first while this drain still
            # sends views of it (StableChunks; MemoryStore.acquire_slot takes such a slot last): what was written
            # may then mix two saves, so it never counts. A new save invalidates the record before it copies.
            still = mem.read_meta(meta.slot)
            if still is None or still.created != meta.created:
                raise TierError(f"the snapshot of step {step} left slot {meta.slot} while tier {self.name!r} was "
                                "written from it (a new save of the step took the slot): these files are not used",
                                tier=mem.name, key=mem.meta_key(meta.slot))
            if meta.checksums == UNVERIFIED:  # the files say so, so that loads of them say verified=False
                entries = [replace(e, meta={**e.meta, "origin": "unverified"}) for e in entries]
        except BaseException as failure:
            check.exception()  # nothing may read the slot once the drain lets it go
            try:
                if not self.tier.exists(self.layout.manifest_key(step)):  # never a committed step's files
                    for e in entries:
                        self.tier.delete(e.key)
            except Exception as cleanup:  # noqa: BLE001 - the write's own failure is the one to report
                log.warning("tier %r: the files step %d wrote before failing stay (retention or gc removes them): "
                            "%s", self.name, step, cleanup)
            raise failure
        self._remove_replaced(step, coords.rank, replaced, entries)
        manifest = self._publish_rank(step, coords, entries, meta.save_id)
        crash_point("drain.after_write")
        return Written(step, sum(f.size for f in manifest.files), manifest=manifest)

    def commit(self, written: Written, coords: RankCoords, *, node_ranks: list[int], wait_s: float,
               pinned: Callable[[], set[int]], on_committed: Callable[[int], None], fail_fast: bool = False
               ) -> None:
        if not self._commits_here(coords, node_ranks):
            return
        crash_point("drain.before_commit")
        save_id = written.manifest.extra.get(SAVE_KEY, "") if written.manifest is not None else ""
        with self._retention:
            # The step this run commits now: a job that went back counts from there. Set before the manifest
            # appears, so that retention running meanwhile (another tier's thread) never takes it for a newer
            # step of another run; put back if the commit fails (keep would count up to a step not committed).
            before, self._newest_own = self._newest_own, written.step
        committed, failure = None, []
        try:
            committed = self.try_commit(written.step, coords, self._voters(coords, node_ranks), wait_s=wait_s,
                                        save_id=save_id, fail_fast=fail_fast, failure=failure,
                                        gone=self.gone_probe(coords, node_ranks, save_id))
        finally:
            if committed is None:
                with self._retention:
                    if self._newest_own == written.step:
                        self._newest_own = before
        if committed is None:
            raise TierError(f"step {written.step} not committed: " + (
                failure[0] if failure else f"not every rank's files arrived within {wait_s:.0f} s"), tier=self.name)
        on_committed(committed.total_bytes)
        # The steps retention drops are un-committed now; deleting their files (slow for big files: an unlink of
        # 1 GiB took 0.3 s on the development VM's ext4) waits until this step's save is reported durable.
        try:
            written.housekeeping += self._apply_retention(coords, pinned, always=True)
        except Exception as exc:  # noqa: BLE001 - the step is committed: a failed retention must not say otherwise
            with self._retention:
                self._held_back = True  # the drain's next retain() tries again
            log.warning("tier %r: step %d is committed, but retention failed (tried again later): %s", self.name,
                        written.step, exc)

    def write_failed(self, step: int, coords: RankCoords, *, node_ranks: list[int], save_id: str,
                     reason: str) -> None:
        """Record that this rank's part of ``step`` (the save ``save_id``) will not be committed here, so that
        the ranks waiting for it stop waiting: the committing rank records the step's failure, the others their
        own (failure_records.py). Nothing where this rank writes alone."""
        if self._sole_writer(coords, node_ranks):
            return
        if self._commits_here(coords, node_ranks):
            key = self.layout.commit_failed_key(step)
        else:
            key = self.layout.rank_failed_key(step, coords.rank)
        record_failure(self.tier, key, save_id=save_id, rank=coords.rank, reason=reason,
                       retried=lambda publish: self._retry(publish, step, coords.rank, f"publish {key}"))

    def retain(self, coords: RankCoords, *, node_ranks: list[int], pinned: Callable[[], set[int]]
               ) -> list[Callable[[], None]]:
        return self._apply_retention(coords, pinned, always=False) if self._commits_here(coords, node_ranks) else []

    def _apply_retention(self, coords: RankCoords, pinned: Callable[[], set[int]], *, always: bool
                         ) -> list[Callable[[], None]]:
        """Un-commit what ``keep`` lets go (after a commit; otherwise only where the last pass held steps back);
        the deletions of their files, to run later."""
        with self._retention:
            if not (always or self._held_back):
                return []
            doomed = [s for s in self.uncommit_expired(self.cfg.keep, pinned(), newest=self._newest_own)
                      if s not in self._removing]
            self._removing.update(doomed)
        return [lambda: self._remove_retained(doomed, coords.rank)] if doomed else []

    def _remove_retained(self, steps: list[int], rank: int) -> None:
        try:
            self.remove_steps(steps, rank)
        finally:
            with self._retention:
                self._removing.difference_update(steps)
                self._removed.notify_all()

    def _voters(self, coords: RankCoords, node_ranks: list[int]) -> list[int]:
        # A shared tier is committed by global rank 0 for the job; a node-local one by each node's first rank.
        return sorted(node_ranks) if self.tier.capabilities.node_local else list(range(coords.world_size))

    def gone_probe(self, coords: RankCoords, node_ranks: list[int], save_id: str
                   ) -> Callable[[list[int]], dict[int, str]] | None:
        """Which of the ranks asked about died on this node (:func:`gone_ranks`) while in the job incarnation
        that made ``save_id`` (its first part, ``Coordinator.incarnation``), among the ranks the start-up exchange
        placed on this node. Only an engine of this job past that exchange stamps its lock with the incarnation,
        and a closing one removes its lock: an unheld lock so stamped is a dead engine of this job."""
        peers = {r for r in node_ranks if r != coords.rank}
        job = save_id.partition(".")[0]
        if self.lock_dir is None or not peers or not job:
            return None
        directory = self.lock_dir
        return lambda missing: gone_ranks(directory, [r for r in missing if r in peers], job)

    def _commits_here(self, coords: RankCoords, node_ranks: list[int]) -> bool:
        return coords.rank == self._voters(coords, node_ranks)[0]

    def read_step(self, step: int, coords: RankCoords, *, copy: bool, map_location: Any, verify: bool,
                  trust_pickles: bool, into: dict[str, Any] | None) -> tuple[dict[str, Any], bool, int]:
        return read_committed_step(self, step, coords, copy=copy, map_location=map_location, verify=verify,
                                   trust_pickles=trust_pickles, into=into)

    # ----- retries -----------------------------------------------------------------------------------------
    def _retry(self, fn: Callable[[], Any], step: int | None, rank: int, what: str) -> Any:
        def on_retry(attempt: int, exc: BaseException, sleep: float) -> None:
            self.emit(ev.Event(ev.RETRY, step=step, rank=rank, tier=self.name, seconds=sleep,
                               message=f"{what}: attempt {attempt} failed: {exc}", detail={"attempt": attempt}))

        return call_with_retry(fn, self.cfg.retry, on_retry)

    # ----- writing -----------------------------------------------------------------------------------------
    def _mark_started(self, step: int, rank: int) -> None:
        """Before a rank's first file of ``step``: a marker under the step's ``tiered_ckpt/``, so that a save
        failing before its rank manifest never leaves a directory that passes for Megatron-LM's (layouts use
        Megatron's file names, and retention keeps Megatron-LM's directories: layouts/foreign.py)."""
        with self._started_lock:
            if (step, rank) in self._started:
                return
        key = self.layout.started_key(step, rank)
        self._retry(lambda: self.tier.publish(key, f'{{"run_id": {json.dumps(self.run_id)}}}\n'.encode()),
                    step, rank, f"publish {key}")
        with self._started_lock:
            if len(self._started) > 64:  # a long-lived convert or drain: only recent steps are written again
                self._started.clear()
            self._started.add((step, rank))

    def _sole_writer(self, coords: RankCoords, node_ranks: list[int] | None) -> bool:
        """Whether this rank alone writes (and commits) its steps here: a one-rank job, or a node-local tier on a
        node of one rank."""
        return coords.world_size == 1 or (node_ranks is not None and self.tier.capabilities.node_local
                                          and len(set(node_ranks)) == 1)

    def _uncommit_for_rewrite(self, step: int, coords: RankCoords, save_id: str = "") -> list[str]:
        """Before a rank writes a step the tier holds committed by another save (a job saving again the step it
        resumed at, a script re-run with the same directory): un-commit it first, so that no manifest vouches
        for files being replaced. The manifest goes first, then the files the commit derived from the ranks'
        (DCP's ``.metadata``, Megatron's merged optimizer file: with no manifest they would pass for a plain
        checkpoint of their own), the tracker is pointed at the newest other committed step, and the rank's own
        old manifest goes. Until the new save commits, the step is partial here (docs/operations.md, "Saving a
        step again").

        With several writers it is done only when the save has an identity (``save_id``): a commit of this save
        needs this rank's vote, which comes after this, so a manifest found here is another save's; one of this
        very save (a recovery drain of a step committed meanwhile) is kept. Without an identity only the sole
        writer does it (docs/architecture.md, "Save identity").

        Returns the keys of this rank's files of the earlier save, for :meth:`_remove_replaced`."""
        rank = coords.rank
        # This rank's vote goes first: a commit of an earlier save still under way re-reads its votes after
        # publishing (try_commit) and withdraws itself if one is gone, so no manifest vouches for these files.
        mine = self.layout.rank_manifest_key(step, rank)
        earlier: list[str] = []
        if self._retry(lambda: self.tier.exists(mine), step, rank, f"look for {mine}"):
            self._refuse_another_job_s(step, rank)  # before its vote and files are taken for this job's
            earlier = self._own_files_of_another_save(step, coords, save_id)
            self._retry(lambda: self.tier.delete(mine), step, rank, f"delete {mine}")
        key = self.layout.manifest_key(step)
        if self._retry(lambda: self.tier.exists(key), step, rank, f"look for {key}"):
            try:
                old = self.read_manifest(step)
            except (CorruptionError, BlobNotFoundError):
                old = None  # unreadable (or un-committed meanwhile by another rank): it vouches for nothing
            if old is not None and self._another_job_s(old):
                raise self._another_job_error(step, old)
            if old is not None and save_id and old.extra.get(SAVE_KEY) == save_id:
                return earlier
            by = (f" (it was committed by run {old.run_id!r}, this engine's run is {self.run_id!r}: another job "
                  "saving into this directory?)" if old is not None and old.run_id != self.run_id else "")
            log.warning("tier %r: step %d is committed here and is being saved again%s: it is un-committed until "
                        "the new save commits (a crash before then leaves the previous step the newest)",
                        self.name, step, by)
            self._drop_commit(step, rank, old.files if old is not None else ())
            if self.read_tracker() == step:  # Megatron-LM reads the tracker alone: point it at a committed step
                older = [s for s in self._retry(self.committed_steps, step, rank, "list the tier") if s != step]
                if older:
                    self._retry(lambda: self.tier.publish(self.layout.tracker, str(max(older)).encode()), step,
                                rank, f"publish {self.layout.tracker}")
                else:
                    self._retry(lambda: self.tier.delete(self.layout.tracker), step, rank,
                                f"delete {self.layout.tracker}")

        return earlier

    def _another_job_s(self, manifest: CheckpointManifest) -> bool:
        """Whether ``manifest`` was committed by another job while this one runs (another run_id, after this
        store opened): two jobs saving into one directory, whose steps neither may take for its own."""
        return manifest.run_id != self.run_id and manifest.created > self._opened + CONCURRENT_JOB_MARGIN_S

    def _refuse_another_job_s(self, step: int, rank: int) -> None:
        """Before a rank replaces a committed ``step``: refuse when another job committed it while this one runs.
        Un-committing it would take that job's newest step away and overwrite its files (a fault trial: two jobs
        in one directory left neither a loadable step), so this save fails here instead, saying why; the other
        job's step stays as it is. An earlier run's step (committed before this job started) is replaced, as a
        re-run is meant to. Asked only where this rank has a vote of the step here already (a save of a new step,
        the common case, costs no request more)."""
        key = self.layout.manifest_key(step)
        if not self._retry(lambda: self.tier.exists(key), step, rank, f"look for {key}"):
            return
        try:
            old = self._retry(lambda: self.read_manifest(step), step, rank, f"read {key}")
        except (CorruptionError, BlobNotFoundError):
            return  # unreadable, or gone meanwhile: _uncommit_for_rewrite decides as before
        if self._another_job_s(old):
            raise self._another_job_error(step, old)

    def _another_job_error(self, step: int, old: CheckpointManifest) -> TierError:
        return TierError(f"step {step} here was committed {old.created - self._opened:.0f} s after this job started "
                         f"by another job (run_id {old.run_id!r}; this one is {self.run_id!r}): two jobs are "
                         "saving into one directory. That step is left as it is and this job's save of it is not "
                         "written here; give each job its own directory (or stop the other job)", tier=self.name,
                         key=self.layout.manifest_key(step))

    def _own_files_of_another_save(self, step: int, coords: RankCoords, save_id: str) -> list[str]:
        """The keys this rank's manifest of ``step`` lists, when it is another save's of this very layout: with
        the same parallel layout a key names the same rank's file in every save, so none of them is another
        rank's now. Derived files and ranges of Megatron's merged file (every rank's) are never among them."""
        try:
            old = self.read_rank_manifest(step, coords.rank)
        except (CorruptionError, BlobNotFoundError):
            return []
        if (save_id and old.extra.get(SAVE_KEY) == save_id) or old.layout != self.layout.name \
                or ParallelLayout.from_dict(old.parallel) != coords.layout:
            return []
        return [e.key for e in old.files
                if e.rank == coords.rank and "in_place" not in e.meta and not self.layout.is_derived(e)]

    def _remove_replaced(self, step: int, rank: int, earlier: list[str], entries: list[FileEntry]) -> None:
        """Delete this rank's files of an earlier save of ``step`` that this save did not write again (an item
        renamed or gone): no manifest lists them, so nothing else ever would. Before this rank votes, so a
        commit never sees them; a failure only leaves them behind."""
        for key in sorted(set(earlier) - {e.key for e in entries}):
            try:
                self._retry(lambda k=key: self.tier.delete(k), step, rank, f"delete {key}")
            except Exception as failure:  # noqa: BLE001 - the save itself is sound
                log.warning("tier %r: %s, a file of an earlier save of step %d that this one does not use, stays: "
                            "%s", self.name, key, step, failure)

    def _forget_manifest(self, step: int) -> None:
        """``step``'s manifest is gone: out of the cache, and a read begun before this is not cached either."""
        with self._manifest_lock:
            self._manifest_changes += 1
            self._manifests.pop(step, None)

    def _drop_commit(self, step: int, rank: int, files: Iterable[FileEntry]) -> None:
        """Un-commit ``step``: its checkpoint manifest first, then the files that commit derived from the ranks'
        (``files``: its entries; DCP's ``.metadata``, Megatron's merged optimizer file), which with no manifest
        would pass for a plain checkpoint of their own. The ranks' own files stay."""
        key = self.layout.manifest_key(step)
        self._retry(lambda: self.tier.delete(key), step, rank, f"delete {key}")
        self._forget_manifest(step)
        for e in files:
            if self.layout.is_derived(e):
                self._retry(lambda k=e.key: self.tier.delete(k), step, rank, f"delete {e.key}")

    def _write_file(self, key: str, make_chunks: Callable[[], Iterable[Chunk]], step: int, rank: int,
                    compress: bool = True, private: bool = False) -> tuple[int, str, int]:
        """Write one file with retries; returns (stored size, checksum, raw size). ``private``: a file of a codec
        only tiered_ckpt reads (the tier may store it split: ``Tier.write_private_blob``)."""
        self._mark_started(step, rank)
        compression = self.cfg.compression if compress and self.compression_name == "zstd" else None
        write = self.tier.write_private_blob if private else self.tier.write_blob

        def attempt() -> tuple[int, str, int]:
            raw = _Counting(make_chunks(), WRITE_PIECE if self.tier.capabilities.node_local else None)
            stored = compress_chunks(raw, compression) if compression else raw
            stream = HashingStream(stored)
            write(key, stream)
            return stream.nbytes, f"{ALGORITHM}:{stream.hexdigest}", raw.nbytes

        return self._retry(attempt, step, rank, f"write {key}")

    @property
    def byte_grouping(self) -> bool:
        c = self.cfg.compression
        return bool(c and c.codec == "zstd" and c.byte_grouping)

    @property
    def compression_name(self) -> str | None:
        c = self.cfg.compression
        return c.codec if c and c.codec != "none" else None

    def _write_item(self, step: int, coords: RankCoords, src: ItemSource, *, job_scope: bool = False
                    ) -> FileEntry | None:
        codec = self.codecs[self.layout.file_codec(src.name, self.cfg)]  # the tier's codec choice (layouts/base.py)
        key = self.layout.item_key(step, src.name, coords, codec.extension)
        if key is None:
            return None
        if job_scope and self.compression_name is None:
            self._mark_started(step, coords.rank)
            # the megatron layout's ranks write their ranges of Megatron's merged file themselves (layouts/megatron.py)
            entry = self.layout.write_in_place(self, step, coords, src, key)
            if entry is not None:
                return entry
        grouping = self.byte_grouping and codec.supports_byte_grouping
        size, checksum, raw = self._write_file(
            key, lambda: codec.encode(src, byte_grouping=grouping), step, coords.rank, private=codec.private)
        return FileEntry(key=key, item=src.name, rank=coords.rank, codec=codec.name, size=size, checksum=checksum,
                         compression=self.compression_name, raw_size=raw,
                         meta={"byte_grouping": True} if grouping else {})

    def write_file(self, key: str, make_chunks: Callable[[], Iterable[Chunk]], *, item: str, rank: int, step: int,
                   codec: str = "torch", meta: dict[str, Any] | None = None) -> FileEntry:
        """One file of ``step`` written from a chunk stream that is not an item of a snapshot (Megatron's merged
        or converted files), with this tier's retries and events, checksummed on the way out and never
        compressed (Megatron must read it). ``make_chunks`` is called once per attempt."""
        private = codec in self.codecs and self.codecs[codec].private
        size, checksum, raw = self._write_file(key, make_chunks, step, rank, compress=False, private=private)
        return FileEntry(key=key, item=item, rank=rank, codec=codec, size=size, checksum=checksum, compression=None,
                         raw_size=raw, meta=dict(meta or {}))

    def copy_file(self, src: Tier, src_key: str, key: str, *, entry: FileEntry | None, item: str, rank: int,
                  step: int, meta: dict[str, Any] | None = None, codec: str = "torch",
                  on_read: Callable[[int], None] | None = None) -> FileEntry:
        """Copy a file from another tier piece by piece (decompressed if its ``entry`` says it was stored
        compressed). With ``entry`` the source is checked while it is read: a mismatch removes the copy and
        raises :class:`CorruptionError` naming the source."""
        try:
            return self.write_file(key, lambda: raw_pieces(src, src_key, entry, on_read=on_read), item=item,
                                   rank=rank, step=step, meta=meta, codec=codec)
        except CorruptionError:
            self.tier.delete(key)
            raise

    def commit_files(self, step: int, layout: ParallelLayout, entries: list[FileEntry]) -> CheckpointManifest:
        """Commit files of ``step`` already written (by :meth:`write_file`/:meth:`copy_file`) for a job of
        ``layout``: every rank's manifest (empty for ranks that own no file), then the checkpoint manifest and
        the tracker (:meth:`try_commit`)."""
        by_rank: dict[int, list[FileEntry]] = {r: [] for r in range(layout.world_size)}
        for e in entries:
            by_rank[e.rank].append(e)
        save_id = uuid.uuid4().hex[:16]  # one writer for every rank: this commit's votes are these
        for r, files in by_rank.items():
            self._publish_rank(step, layout.coords(r), files, save_id)
        committed = self.try_commit(step, layout.coords(0), save_id=save_id)
        if committed is None:
            raise CorruptionError(f"step {step}: not committed on {self.tier.describe()}: rank manifests missing",
                                  tier=self.name)
        return committed

    def _publish_rank(self, step: int, coords: RankCoords, entries: list[FileEntry], save_id: str = ""
                      ) -> RankManifest:
        manifest = RankManifest(step=step, rank=coords.rank, layout=self.layout.name, coords=coords.to_dict(),
                                parallel=coords.layout.to_dict(), files=tuple(entries), run_id=self.run_id,
                                extra={SAVE_KEY: save_id} if save_id else {})
        key = self.layout.rank_manifest_key(step, coords.rank)
        crash_point("store.files_written")
        self._retry(lambda: self.tier.publish(key, dump_rank(manifest)), step, coords.rank, f"publish {key}")
        crash_point("store.rank_manifest_written")
        return manifest

    def copy_rank_from(self, source: FileStore, step: int, coords: RankCoords, *, wait_s: float = 0.0,
                       sole_writer: bool = False) -> RankManifest:
        """Copy this rank's files of ``step`` from another file tier, verifying each against its manifest.

        Identical storage (same compression and byte grouping) is copied byte for byte and must hash the same;
        otherwise the file is transcoded through its raw bytes. This rank's ranges of Megatron's merged file
        (written in place) are readable once ``source`` committed the step, which its committing rank does when
        every rank's ranges are there: waited for, up to ``wait_s``.
        """
        rank_manifest = source.read_rank_manifest(step, coords.rank)
        save_id = rank_manifest.extra.get(SAVE_KEY, "")  # the save the files come from, on every rank alike
        if any("in_place" in e.meta for e in rank_manifest.files):
            source.wait_committed(step, coords.rank, wait_s, why=": Megatron's merged file, which this rank's part "
                                  "is in, is not complete")
        replaced = self._uncommit_for_rewrite(step, coords, save_id) if sole_writer or save_id else []
        entries = []
        for entry in rank_manifest.files:
            if "in_place" in entry.meta:  # this rank's ranges of Megatron's merged file: its own file here
                obj = read_in_place_item(source, step, coords, entry, verify=True)
                written = self._write_item(step, coords, item_source(entry.item, obj))
                entries += [written] if written is not None else []
                continue
            blob = source._retry(lambda e=entry: source.tier.read_blob_hashed(e.key, max_size=e.size), step,
                                 coords.rank, f"read {entry.key}")
            source.verify(entry, blob)
            if self.layout.file_codec(entry.item, self.cfg) != entry.codec:  # this tier names another codec
                written = self._write_item(step, coords, item_source(entry.item, source.decode_entry(entry, blob)))
                entries += [written] if written is not None else []
                continue
            grouped = bool(entry.meta.get("byte_grouping"))
            codec = self.codecs[entry.codec]
            want_grouped = self.byte_grouping and codec.supports_byte_grouping
            if entry.compression == self.compression_name and grouped == want_grouped:
                size, checksum, _ = self._write_file(entry.key, lambda b=blob: StableChunks([b]), step, coords.rank,
                                                     compress=False, private=codec.private)
                if checksum != entry.checksum:
                    self.tier.delete(entry.key)
                    raise CorruptionError("bytes changed while copying between tiers", tier=self.name,
                                          key=entry.key)
                raw = entry.raw_size
            else:
                plain = source.decode_stored(entry, blob)
                make = lambda p=plain, g=grouped, w=want_grouped: regroup(p, g, w)  # noqa: E731
                size, checksum, raw = self._write_file(entry.key, make, step, coords.rank, private=codec.private)
            meta = {**entry.meta, "byte_grouping": True} if want_grouped else {
                k: v for k, v in entry.meta.items() if k != "byte_grouping"}
            entries.append(FileEntry(key=entry.key, item=entry.item, rank=entry.rank, codec=entry.codec,
                                     size=size, checksum=checksum, compression=self.compression_name,
                                     raw_size=raw, meta=meta))
        self._remove_replaced(step, coords.rank, replaced, entries)
        return self._publish_rank(step, coords, entries, save_id)

    # ----- committing --------------------------------------------------------------------------------------
    def wait_committed(self, step: int, rank: int, wait_s: float, *, save_id: str = "", why: str = "",
                       fail_fast: bool = False, committer: int | None = None,
                       gone: Callable[[list[int]], dict[int, str]] | None = None) -> None:
        """Return once ``step`` is committed here, by the save ``save_id`` where one is given (an earlier commit
        of the step is another save's); :class:`TierError` saying ``why`` it matters after ``wait_s`` without,
        or (``fail_fast``, the save's first drain) as soon as the committing rank recorded that it failed, or
        ``gone`` (:meth:`gone_probe`) saw the ``committer`` rank dead (:class:`GoneWatch`).
        The pause between looks grows from 20 ms to 1 s: every rank of a job may be looking at the one key."""
        deadline = time.monotonic() + wait_s
        key = self.layout.manifest_key(step)
        pause = 0.02
        next_look = 0.0  # the failure record is looked for at once, then at most every RECORD_LOOK_S
        watch = GoneWatch(gone if fail_fast and committer is not None else None)
        while True:
            committed_here = self._retry(lambda: self.tier.exists(key), step, rank, f"look for {key}")
            if committed_here and (not save_id or self.committed_save(step, rank) == save_id):
                return
            dead = watch.confirmed([committer] if committer is not None else [])
            if dead:
                if self._committed_by(key, step, rank, save_id):  # just before it died
                    return
                record = recorded_failure(self.tier, self.layout.commit_failed_key(step), save_id)
                reason = record["reason"] if record is not None else (  # what it said before it died
                    f"the engine of the committing rank {committer} died on this node (its lock {dead[committer]} "
                    "is left and nobody holds it)")
                raise TierError(f"step {step} was not committed here: {reason}{why}", tier=self.name, key=key)
            if fail_fast and save_id and time.monotonic() >= next_look:
                # also beside another save's commit of the step (another job's, which this save's refused)
                next_look = time.monotonic() + RECORD_LOOK_S
                record = recorded_failure(self.tier, self.layout.commit_failed_key(step), save_id)
                if record is not None:
                    raise TierError(f"step {step} was not committed here: {record['reason']}{why}",
                                    tier=self.name, key=key)
            if not committed_here and save_id and not self._retry(
                    lambda: self.tier.exists(self.layout.rank_manifest_key(step, rank)), step, rank,
                    f"look for step {step}'s rank manifest"):
                # The step is gone, this rank's part with it: retention removed it, after a newer commit, either
                # as committed and retired by keep, or as what a failed save left. The newer commits say which.
                if self._committed_earlier(step, save_id, rank):
                    return
                raise TierError(f"step {step} is not committed here: it was removed as what a failed save left"
                                f"{why}", tier=self.name, key=key)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TierError(f"step {step} is not committed here after {wait_s:.0f} s{why}", tier=self.name,
                                key=key)
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, 1.0)

    def _committed_by(self, key: str, step: int, rank: int, save_id: str) -> bool:
        """Whether ``step``'s manifest ``key`` is here, committed by ``save_id`` where one is given."""
        return self._retry(lambda: self.tier.exists(key), step, rank, f"look for {key}") and (
            not save_id or self.committed_save(step, rank) == save_id)

    def _committed_earlier(self, step: int, save_id: str, rank: int) -> bool:
        """Whether a newer commit here names the save ``save_id`` of ``step`` among the commits made before it."""
        newer = [s for s in self._retry(self.committed_steps, step, rank, "list the committed steps") if s > step]
        for later in sorted(newer)[:EARLIER_COMMITS]:
            try:
                earlier = self._retry(lambda s=later: self.read_manifest(s), step, rank,
                                      f"read step {later}'s manifest").extra.get("earlier", [])
            except BlobNotFoundError:
                continue
            if [step, save_id] in earlier:
                return True
        return False

    def committed_save(self, step: int, rank: int) -> str | None:
        """The save whose commit of ``step`` is here ("" where it has no identity; None: none, or gone since a
        look); ``rank`` names the asker in retry events."""
        try:
            manifest = self._retry(lambda: self.read_manifest(step), step, rank, f"read step {step}'s manifest")
        except BlobNotFoundError:
            return None
        return manifest.extra.get(SAVE_KEY, "")

    def rank_manifests(self, step: int) -> dict[int, str]:
        return self._step_records(step)[0]

    def _step_records(self, step: int) -> tuple[dict[int, str], dict[int, str], list[str]]:
        """One listing of ``step``'s ``tiered_ckpt/``: the ranks' manifests and failure records (rank → key),
        and the step's own failure records (``commit.failed``)."""
        votes, failed, step_failed = {}, {}, []
        commit_failed = self.layout.commit_failed_key(step)
        for key in self.tier.list(self.layout.rank_manifest_prefix(step)):
            if key == commit_failed:
                step_failed.append(key)
            elif (parsed := self.layout.parse_rank_manifest_key(key)) and parsed[0] == step:
                votes[parsed[1]] = key
            elif (parsed := self.layout.parse_rank_failed_key(key)) and parsed[0] == step:
                failed[parsed[1]] = key
        return votes, failed, step_failed

    def try_commit(self, step: int, coords: RankCoords, ranks: list[int] | None = None, *, wait_s: float = 0.0,
                   poll_s: float = 0.05, save_id: str = "", fail_fast: bool = False,
                   failure: list[str] | None = None,
                   gone: Callable[[list[int]], dict[int, str]] | None = None) -> CheckpointManifest | None:
        """As the committing rank: once every rank of ``ranks`` (default: the whole job) has its manifest here,
        write the checkpoint manifest, then the tracker. Waits up to ``wait_s``; None means not committed.
        ``save_id``: only rank manifests of that save are votes (another save's are stale). ``fail_fast``: stop
        waiting as soon as a rank recorded that its part of this save failed (failure_records.py), appending
        what it said to ``failure``; and (with ``gone``, :meth:`gone_probe`) as soon as a missing rank's engine is
        seen dead (:class:`GoneWatch`)."""
        ranks = list(range(coords.world_size)) if ranks is None else sorted(ranks)
        deadline = time.monotonic() + wait_s
        votes: dict[int, RankManifest] = {}
        looked: dict[int, float] = {}  # rank → when its failure record was read last (another save's, or none)
        watch = GoneWatch(gone if fail_fast else None)
        while True:
            present, failed, step_failed = self._retry(lambda: self._step_records(step), step, coords.rank,
                                                       "list rank manifests")
            missing = [r for r in ranks if r not in present]
            stale: list[str] = []
            if not missing:
                for r in ranks:
                    if r not in votes:
                        # manifest.load_rank checks every field (a rank lists only its own files, ...): a
                        # CorruptionError naming the manifest and field refuses the commit
                        vote = self.read_rank_manifest(step, r)
                        why = self._not_a_vote(vote, coords.layout, save_id)
                        if why:
                            stale.append(f"rank {r}: {why}")
                        else:
                            votes[r] = vote
                missing = [r for r in ranks if r not in votes]
            if not missing:
                break
            if fail_fast and save_id:  # a rank without this save's vote (none, or a stale one) that said why
                for r in [r for r in missing if r in failed
                          and time.monotonic() - looked.get(r, -RECORD_LOOK_S) >= RECORD_LOOK_S]:
                    looked[r] = time.monotonic()  # another save's record may be replaced by this save's
                    record = recorded_failure(self.tier, failed[r], save_id)
                    if record is not None:
                        why = f"rank {r} could not write its part here: {record['reason']}"
                        log.warning("tier %r: step %d not committed: %s", self.name, step, why)
                        if failure is not None:
                            failure.append(why)
                        return None
            # A killed rank never sends its part: without this the step waited out wait_s (on each tier in turn)
            # before it was given up.
            dead = watch.confirmed(missing)
            if dead:
                why = (f"the engine of rank(s) {_short(list(dead))} on this node died before its files arrived "
                       f"(its lock {next(iter(dead.values()))} is left and nobody holds it)")
                log.warning("tier %r: step %d not committed: %s", self.name, step, why)
                if failure is not None:
                    failure.append(why)
                return None
            if time.monotonic() >= deadline:
                why = f"no files from rank(s) {_short(missing)} after {wait_s:.0f} s" + (
                    f" ({'; '.join(stale[:4])})" if stale else "")
                log.warning("tier %r: step %d not committed: %s", self.name, step, why)
                if failure is not None:
                    failure.append(why)
                return None
            time.sleep(poll_s)
        for key in [*(failed[r] for r in ranks if r in failed), *step_failed]:  # other saves': stale now
            try:
                self.tier.delete(key)
            except Exception as exc:  # noqa: BLE001 - a stale record is harmless; gc removes it with the step
                log.debug("tier %r: could not delete the stale failure record %s: %s", self.name, key, exc)
        files: list[FileEntry] = []
        for r in ranks:
            files.extend(votes[r].files)
        scope = "job" if len(ranks) == coords.world_size else "node"
        files = self.layout.checkpoint_files(files, self.layout.finalize(self, step, coords.layout, files, scope))
        extra: dict[str, Any] = {"ranks": ranks, "scope": scope, **({SAVE_KEY: save_id} if save_id else {})}
        if save_id and self._committed_saves:
            extra["earlier"] = [list(c) for c in self._committed_saves]
        manifest = CheckpointManifest(step=step, layout=self.layout.name, parallel=coords.layout.to_dict(),
                                      files=tuple(files), run_id=self.run_id, extra=extra)
        key = self.layout.manifest_key(step)
        self._retry(lambda: self.tier.publish(key, dump_checkpoint(manifest)), step, coords.rank, f"publish {key}")
        if save_id and not self._votes_hold(step, ranks, save_id, coords.rank):
            # A rank moved on to a later save of this step meanwhile (its vote is gone or replaced) and may be
            # replacing its files: this commit withdraws, derived files with it, before anything points at it.
            self._drop_commit(step, coords.rank, files)
            why = "a rank began saving it again while this save committed"
            log.warning("tier %r: step %d not committed: %s", self.name, step, why)
            if failure is not None:
                failure.append(why)
            return None
        with self._manifest_lock:
            self._manifest_changes += 1
            self._manifests[step] = manifest
            if save_id:
                self._committed_saves.append((step, save_id))
        crash_point("store.manifest_written")
        self._update_tracker(step, coords.rank)
        return manifest

    def _votes_hold(self, step: int, ranks: list[int], save_id: str, rank: int) -> bool:
        """Whether every rank's manifest of ``step`` is still this save's (read again after the commit)."""
        for r in ranks:
            try:
                vote = self._retry(lambda r=r: self.read_rank_manifest(step, r), step, rank, f"read rank {r}'s vote")
            except (BlobNotFoundError, CorruptionError):
                return False
            if vote.extra.get(SAVE_KEY) != save_id:
                return False
        return True

    def _not_a_vote(self, vote: RankManifest, layout: ParallelLayout, save_id: str = "") -> str:
        """Why a rank manifest is not this save's vote for the step (an old job's, of another layout), or ''."""
        key = self.layout.rank_manifest_key(vote.step, vote.rank)
        if save_id and vote.extra.get(SAVE_KEY) != save_id:
            if vote.run_id != self.run_id:  # two jobs in one directory, or a re-run
                return (f"{key} belongs to another job's save of step {vote.step} (run_id {vote.run_id!r}; this "
                        f"one is {self.run_id!r}): waiting for this save's")
            return (f"{key} belongs to another save of step {vote.step} (an earlier job's or attempt's): waiting "
                    "for this save's")
        if vote.layout != self.layout.name:
            return f"{key} is of layout {vote.layout!r}, not {self.layout.name!r}"
        if ParallelLayout.from_dict(vote.parallel) != layout:
            changed = ", ".join(layout_changes(vote.parallel, layout)) or "another parallel layout"
            return f"{key} was written by a job of another parallel layout ({changed}): waiting for this job's"
        return ""

    def read_tracker(self) -> int | None:
        try:
            text = bytes(as_memoryview(self.tier.read_blob_hashed(self.layout.tracker, max_size=4096))).decode().strip()
        except (BlobNotFoundError, UnicodeDecodeError, CorruptionError):  # damaged (a FIFO, a link): replaced
            return None
        return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None  # not "²", not 5000 digits

    def _update_tracker(self, step: int, rank: int) -> None:
        """Point Megatron-LM's tracker at ``step``, just committed. Its reads are retried like its write: a
        throttled read must not fail the step. A tier that still fails fails the save (the step is committed for
        tiered_ckpt's loads, but Megatron-LM's own loader would resume from the step the tracker names)."""
        tracker = self.layout.tracker
        current = self._retry(self.read_tracker, step, rank, f"read {tracker}")
        newer = current is not None and current > step and self._retry(
            lambda: self.tier.exists(self.layout.manifest_key(current)), step, rank, f"look for step {current}")
        if newer:
            return  # never move the tracker backwards (a late, older commit); a damaged one names no commit
        self._retry(lambda: self.tier.publish(tracker, str(step).encode()), step, rank, f"publish {tracker}")

    # ----- retention ---------------------------------------------------------------------------------------
    def partial_steps(self, keys: list[str], newest: int | None = None, *,
                      uncommitted: dict[int, list[str]] | None = None) -> dict[int, list[str]]:
        """The uncommitted steps older than the newest committed one in the tier's listing ``keys`` (or than
        ``newest``, the newest this process committed), each with its keys: debris, since a tier takes a run's
        steps in order, so nothing older than its newest commit is still being written. A step directory that
        Megatron-LM, DLRover or DCP wrote is their checkpoint, never one of them (layouts/foreign.py).
        ``uncommitted``: :meth:`uncommitted_steps` of ``keys``, where the caller has it already."""
        committed = self.layout.committed_in(keys)
        if not committed:
            return {}
        newest = max(committed) if newest is None else newest
        if uncommitted is None:
            uncommitted = self.uncommitted_steps(keys)
        return {step: found for step, found in uncommitted.items() if step < newest}

    def uncommitted_steps(self, keys: list[str]) -> dict[int, list[str]]:
        """Every step directory in the tier's listing ``keys`` that holds no manifest and is not another
        program's checkpoint, each with its keys: the :meth:`partial_steps`, and those newer than every commit
        (a save in flight, or one killed before its commit)."""
        committed = self.layout.committed_in(keys)
        foreign = foreign_step_dirs(keys, self.tier)
        found: dict[int, list[str]] = {}
        for key in keys:
            top = key.split("/", 1)[0]
            step = self.layout.parse_step_dir(top)
            if step is not None and step not in committed and top not in foreign:
                found.setdefault(step, []).append(key)
        return found

    def uncommit_expired(self, keep: int | None, pinned: set[int], *, newest: int | None = None) -> list[int]:
        """Un-commit (delete the manifest of) each committed step beyond the newest ``keep`` (never the newest,
        never a pinned one); return those and the unpinned :meth:`partial_steps` (debris): the steps whose files
        :meth:`remove_steps` deletes. A crash in between leaves debris, never a committed step with missing
        files.

        ``newest``: the step this process committed here last. Steps are counted up to it; a committed step
        above it is from before (another run's, or this one's before it went back to an older step) and is left
        alone, with a warning: counting it would make the new steps the oldest, deleted right after their
        commit (found by a new-user trial)."""
        keys = self.tier.list("")
        committed = sorted(self.layout.committed_in(keys))
        self._held_back = False
        if newest is not None:
            above = tuple(s for s in committed if s > newest)
            if above and above != self._warned_newer:
                self._warned_newer = above
                log.warning("tier %r holds committed step(s) %s, newer than step %d this run saved: retention "
                            "leaves them alone and counts keep among the others. load() resumes from the newest "
                            "step, so a restart would resume from them, not from this run's steps: remove them "
                            "if they are not wanted", self.name, ", ".join(map(str, above[:8])), newest)
            committed = [s for s in committed if s <= newest]
        if not committed:
            return []
        newest = committed[-1]
        # Another job's steps (two jobs in one directory) count for neither keep nor retirement, nor are the
        # steps it is writing debris of this one's
        own = self._not_another_job_s(committed) if keep is not None else committed
        expired = [s for s in own[:-keep] if s != newest] if keep is not None else []
        partial = {s: found for s, found in self.partial_steps(keys, newest).items()
                   if not self._another_job_writes(found)}
        # read afresh before retiring: the cache may hold this job's own manifest of a step another job has
        # committed again since (a re-run trial)
        doomed = [s for s in expired if s not in pinned and self._not_another_job_s([s], fresh=True)]
        debris = sorted(s for s in partial if s not in pinned)
        # kept only for a tier below that has not taken them yet: retain() is asked again once it has
        self._held_back = self._held_back or not pinned.isdisjoint([*expired, *partial])
        uncommitted = []
        for step in doomed:
            try:
                self.tier.delete(self.layout.manifest_key(step))
            except TierError as exc:
                log.warning("retention on tier %r could not un-commit step %d: %s", self.name, step, exc)
                continue
            self._forget_manifest(step)  # a long run would otherwise cache every manifest it ever committed
            crash_point("store.retain_uncommitted")
            uncommitted.append(step)
        return uncommitted + debris

    def _not_another_job_s(self, steps: list[int], *, fresh: bool = False) -> list[int]:
        """``steps`` without those another job committed while this one runs (:meth:`_another_job_s`): keep is
        this job's to apply to its own steps and to earlier runs', never to a job saving beside it."""
        mine = []
        for step in steps:
            try:
                manifest = self.read_manifest(step, cached=not fresh)
            except (CorruptionError, BlobNotFoundError):
                mine.append(step)  # unreadable or gone: it vouches for nothing, as before
                continue
            except TierError:  # no answer now: not retired in this pass (the next one asks again)
                self._held_back = True
                continue
            if not self._another_job_s(manifest):
                mine.append(step)
            else:
                self._warn_another_job(manifest.run_id)
        return mine

    def _another_job_writes(self, keys: list[str]) -> bool:
        """Whether a partial step (its ``keys``) is being written by another job running beside this one: its
        first rank's start marker names another run_id and appeared after this store opened. One marker is read
        (a job's step has every rank's): debris of this job or of an earlier run is removed as before."""
        for key in keys:
            if not key.endswith(".started"):
                continue
            try:
                body = json.loads(bytes(as_memoryview(self.tier.read_blob_hashed(key, max_size=4096))).decode())
                run_id = body.get("run_id") if isinstance(body, dict) else None
                if run_id in (None, self.run_id):
                    return False
                when = self.tier.modified(key)
            except (TierError, CorruptionError, OSError, ValueError):  # gone, damaged, no answer: as before
                return False
            if when is not None and when > self._opened + CONCURRENT_JOB_MARGIN_S:
                self._warn_another_job(run_id)
                return True
            return False
        return False

    def _warn_another_job(self, run_id: str) -> None:
        if run_id not in self._warned_jobs:
            self._warned_jobs.add(run_id)
            log.warning("tier %r: another job (run_id %r) saves steps here while this one (%r) runs: retention "
                        "leaves its steps alone and counts keep among this job's. Two jobs saving into one "
                        "directory replace each other's steps: give each job its own", self.name, run_id,
                        self.run_id)

    def remove_steps(self, steps: list[int], rank: int) -> list[int]:
        """Delete the files of ``steps`` (un-committed or debris: :meth:`uncommit_expired`); those removed."""
        removed = []
        began = time.time()
        dead_writes = self._dead_writes_in(steps, began)
        for step in steps:
            t0 = time.perf_counter()
            for key in dead_writes.get(step, ()):
                try:
                    self.tier.remove_temp_file(key)
                except (TierError, OSError) as exc:  # debris for gc; the step's own files go all the same
                    log.warning("retention on tier %r could not remove %s: %s", self.name, key, exc)
            try:
                self.tier.delete_prefix(self.layout.step_dir(step))
            except TierError as exc:
                log.warning("retention on tier %r could not remove step %d: %s", self.name, step, exc)
                continue
            removed.append(step)
            # written again (a job rolled back re-saves it): its marker must be written again too
            with self._started_lock:
                self._started = {k for k in self._started if k[0] != step}
            self.emit(ev.Event(ev.EVICT, step=step, rank=rank, tier=self.name, seconds=time.perf_counter() - t0))
        self._abort_uploads_in(removed, began)
        return removed

    def _dead_writes_in(self, steps: list[int], before: float) -> dict[int, list[str]]:
        """Per step of ``steps``: the temporary files a killed writer left in it (last changed before ``before``,
        the deletion's start). Listings never show them, so deleting the step's keys left them, and their
        directory, for ever (found by a new user's trial: a partial file per crash, per rank). Nobody writes
        these steps any more (retention removes only steps below a commit every rank voted for)."""
        dirs = {self.layout.step_dir(s) + "/": s for s in steps}
        try:
            temps = [k for k in self.tier.temp_files() if k.startswith(tuple(dirs))]
        except (TierError, OSError) as exc:
            log.warning("retention on tier %r could not look for unfinished writes in the steps it removes "
                        "(tiered-ckpt gc removes them): %s", self.name, exc)
            return {}
        out: dict[int, list[str]] = {}
        for key in temps:
            when = self.tier.modified(key)
            if when is not None and when < before:
                out.setdefault(next(s for d, s in dirs.items() if key.startswith(d)), []).append(key)
        return out

    def _abort_uploads_in(self, steps: list[int], before: float) -> None:
        """Abort the uploads a killed save left open in ``steps``, whose files are gone: an object store bills
        their parts and no listing shows them (``gc`` finds them too, but only when someone runs it). Nobody
        should upload there any more (retention removes only steps below a commit every rank voted for); an
        upload that sent a part, or began, after ``before`` (the deletion's start) is left all the same: a rank
        saving the step again. A store that will not list them (permissions) is warned about once; the steps
        are removed all the same."""
        if not steps:
            return
        dirs = tuple(self.layout.step_dir(s) + "/" for s in steps)
        try:
            uploads = self.tier.unfinished_uploads(0.0, lambda key: key.startswith(dirs))
        except (TierError, OSError) as exc:
            if not self._warned_uploads:
                self._warned_uploads = True
                log.warning("retention on tier %r could not look for uploads left open in the steps it removed "
                            "(tiered-ckpt gc --delete aborts them, a bucket lifecycle rule too): %s", self.name, exc)
            return
        for upload in uploads:
            if not upload.key.startswith(dirs) or (upload.modified is not None and upload.modified >= before):
                continue
            try:
                self.tier.abort_upload(upload)
            except (TierError, OSError) as exc:
                log.warning("retention on tier %r could not abort the upload of %s left open: %s", self.name,
                            upload.key, exc)
