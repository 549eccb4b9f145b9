"""The engine: one per rank. ``save`` blocks only for a memory-speed copy; ``load`` returns the newest verified step.

Where does a save block? :meth:`CheckpointEngine.save` — planning the items, waiting for a free slot (policy
``wait``), and copying into it. Everything after (encode, checksum, write, commit, retention) is the drain's.
The engine sees its tiers only through the :class:`~tiered_ckpt.store.Store` protocol and its drain through
:class:`~tiered_ckpt.drain_protocol.Drain` (docs/architecture.md: the data path of a save and of a load).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import events as ev
from . import node_commits
from .codecs.flat import PlanMemo
from .config import Config, TierConfig, load_config
from .distributed import Coordinator
from .drain_protocol import Drain, DrainRequest
from .errors import (
    BlobNotFoundError,
    CheckpointUnreadableError,
    CorruptionError,
    DecodeError,
    LoadIntoError,
    NoCheckpointError,
    RangeError,
    StepNotFoundError,
    TieredCkptError,
    TierError,
    TierUnavailableError,
)
from .fencing import fence_previous_worker
from .handles import LoadResult, SaveError, SaveHandle, SavesFailedError
from .load_into import unfilled_targets
from .locking import RunLock, shm_paths
from .manifest import SAVE_KEY
from .memory_store import plan_items
from .parallel import ParallelLayout, RankCoords, detect, local_rank
from .pipeline import STAGING, Pipeline, build_pipeline
from .plugins import PluginManager, get_plugin_manager
from .snapshot_record import SlotMeta, snapshot_layout_changes, undrained_tiers
from .store import Store
from .tiers.base import check_key
from .worker import open_drain

log = logging.getLogger(__name__)
#: A save waiting this long for a free slot warns (then every SLOT_WAIT_WARN_EVERY_S): a drain that makes no
#: progress (a stopped worker, a hung tier) would otherwise stop training without a word.
SLOT_WAIT_WARN_S = 30.0
SLOT_WAIT_WARN_EVERY_S = 60.0
CLOSE_NOTICE_S = 3.0  # a close() still waiting for drains after this long says what it waits for, and how long
# load(): listings again after every step listed vanished, before "no checkpoint". Each one found a step not
# tried yet (a saver's newer commit), so the bound only matters against a saver that keeps committing faster than
# a read ends (keep: 1 on a loaded machine lost 16 races in a row: a test run beside three trials)
_MAX_RELISTS = 64
_live: weakref.WeakSet[CheckpointEngine] = weakref.WeakSet()


class _Listing:
    """One tier's listing of its steps (``list_steps()``) on a daemon thread: ``steps`` or ``error`` once ``done``
    is set. load()'s listings (_list_tiers) and the start-up recovery's (_recover) run on these."""

    def __init__(self, list_steps: Callable[[], list[int]], name: str):
        self.steps: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(list_steps,), name=f"tiered_ckpt-list-{name}", daemon=True).start()

    def _run(self, list_steps: Callable[[], list[int]]) -> None:
        try:
            self.steps = list_steps()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that asked
            self.error = exc
        finally:
            self.done.set()

    def unexpected(self) -> bool:
        """Failed with something other than a tier's error (a bug): raised, never a tier left out."""
        return self.error is not None and not isinstance(self.error, TierError | OSError)


#: How long load() waits for a new listing of a tier whose listing at the engine's start did not answer within
#: load.list_timeout_s and still has not (when that is shorter): long enough for a store that is back to answer,
#: and a restart with the store still down does not wait the whole limit twice.
RELIST_AFTER_STALL_S = 10.0


def _await_listings(waits: Iterable[tuple[_Listing, float | None]]) -> None:
    """Wait for each listing until its limit in seconds from now (None: for ever), or until one of them met a
    bug (raised by the caller at once, not after the slow tiers' limits)."""
    now = time.monotonic()
    for listing, limit in sorted(waits, key=lambda w: float("inf") if w[1] is None else w[1]):
        listing.done.wait(None if limit is None else max(0.0, now + limit - time.monotonic()))
        if listing.done.is_set() and listing.unexpected():
            return


class CheckpointEngine:
    """Tiered checkpointing for one rank. See docs/architecture.md."""

    def __init__(self, config: Any, parallel: ParallelLayout | RankCoords | None = None, *,
                 rank: int | None = None, plugin_manager: PluginManager | None = None,
                 observers: Any = ()):
        self._pid = os.getpid()  # close() in a forked child leaves the parent's engine alone
        self._started = time.time()  # snapshots created before it are an earlier process's
        self.pm = plugin_manager or get_plugin_manager()
        self._listings: dict[str, _Listing] = {}  # per tier, the newest listing (in flight or done): _list_tiers
        self._listings_lock = threading.Lock()
        # per tier, the start-up recovery's listing that did not answer within load.list_timeout_s (_recover):
        # while it still has not, load() waits RELIST_AFTER_STALL_S for a new listing, not that long again
        self._stalled_at_start: dict[str, _Listing] = {}
        lock: RunLock | None = None
        self._node_commits: node_commits.NodeCommits | None = None
        try:
            self.config: Config = load_config(config, registries=self.pm.registries)
            # plugins.py: this engine's own observers and run_id on its events; a plugin the drain worker could
            # not rebuild is a PluginError here, not a failed save.
            self.events = self.pm.for_engine(self.config, observers)
            self.coords = detect(parallel, rank)
            lock = self._lock = RunLock(self.config.run_id, self.coords.rank, shm_paths(self.config))  # by the slots
            lock.acquire()
            fence_previous_worker(self.config, self.coords.rank)  # issue #15: an old worker never writes again
        except BaseException as exc:
            if lock is not None:
                self._detach()
            if isinstance(exc, Exception):  # the other ranks wait for this one at the start-up exchange: tell them
                Coordinator.start_failed(f"{type(exc).__name__}: {exc}")
            raise
        try:
            self.coordinator = Coordinator.create(self.coords)
            if self.coordinator.incarnation:  # before any save: other ranks tell its death by it (gone_ranks)
                lock.stamp(self.coordinator.incarnation)
            # alone(): should the tiers fail to build here, the others learn it at the recovery's exchange
            self.pipeline: Pipeline = self.coordinator.alone(build_pipeline, self.config, self.pm, self.coords,
                                                             local_rank(), self._emit, self.coordinator.node_ranks)
        except BaseException:
            self._detach()
            raise
        self._closed = False
        self._ordinal = 0
        # save identity (docs/architecture.md, "Save identity"): the generation moves on whenever a save goes back
        # to a step not above the highest of the current generation, so no two saves of one step share an id
        self._generation = 0
        self._generation_high = -1
        self._handles: dict[int, list[SaveHandle]] = {}  # per step, oldest first: a step may be saved twice
        self._failures: dict[int, dict[str, str]] = {}  # since the last engine.wait(): step → tier → why
        self._recovered_failures: set[tuple[int, str]] = set()  # those of _failures from start-up recovery
        self._not_durable: dict[int, dict[str, str]] = {}  # saves no durable tier took (take_not_durable)
        self._fingerprints: tuple[str, ...] | None = None
        self._plan_memos: dict[str, PlanMemo] = {}  # what planning each item at the next save may reuse
        self._cond = threading.Condition()
        self.recovered: list[SaveHandle] = []
        self._only_in_memory: set[int] = set()  # steps found in memory at start while every file tier was empty
        self._commit_threads: list[threading.Thread] = []  # commits of what other ranks recovered (_recover)
        # whether some rank recovered at start-up a step another rank no longer holds in memory (alike on every
        # rank: the start-up exchange says): only then does load() wait for the recovery, with one barrier (one
        # process holds what it recovers in memory)
        self._recovering = False
        try:
            # alone(): the other ranks learn of a failure here at the recovery's exchange, as for build_pipeline
            self._drain: Drain = self.coordinator.alone(self._start_drain)
        except BaseException:
            # Not yet in _live (nothing closes it at exit) and no drain to close: without this the rank lock's fd
            # stayed open for the life of the process, and the next engine of the run (a retry in this process,
            # or another process while this one lives) was refused with RunLockedError naming this process.
            try:
                self.pipeline.close()
            finally:
                self._detach()
            raise
        _live.add(self)
        try:
            # a job on several nodes: each node's retention of its node-local tiers learns what the others hold
            self._node_commits = node_commits.start(
                self.coordinator, {n: f for n, s in self.pipeline.durable_stores().items()
                                   if (f := s.files()) is not None}, self.coords)
            self._recover()
        except BaseException:  # a failed start-up exchange (another rank failed): let the lock and worker go
            self.close(timeout=0)
            raise

    def _start_drain(self) -> Drain:
        for store in self.pipeline.stores.values():
            for rel in store.clean_start():  # before the drain starts: no writer of ours is there yet
                log.info("tier %r: removed %s, left by a killed process", store.name, rel)
        return open_drain(self.pipeline, self._tier_done, self._slot_released)

    # ----- events ------------------------------------------------------------------------------------------
    def _emit(self, event: ev.Event) -> None:
        self.events.emit(event)

    def _detach(self) -> None:
        self.events.close()
        self._lock.release()

    @property
    def _entry_persists(self) -> bool:
        return self.pipeline.entry_store.tier.capabilities.survives_process

    # ----- drain callbacks ---------------------------------------------------------------------------------
    def _tier_done(self, step: int, tier: str, ok: bool, error: str | None) -> None:
        # Each tier drains its steps in order, so an outcome is the oldest pending save of that step on that tier.
        with self._cond:
            handles = self._handles.get(step, [])
            handle = next((h for h in handles if tier in h.due and not h.done(tier)), None)
            recovered = handle is not None and any(handle is h for h in self.recovered)
            if not ok:
                why = error or "failed"
                if recovered:  # not a save of this process: say so, or a restart reads it as its own step failing
                    why += (" (the snapshot of this step an earlier process left in shared memory, drained at "
                            "start-up)")
                    self._recovered_failures.add((step, tier))
                else:  # this process's own save failed: a later success must not clear it
                    self._recovered_failures.discard((step, tier))
                self._failures.setdefault(step, {})[tier] = why
            elif (step, tier) in self._recovered_failures:
                # This process saved the step again and the tier committed that save: the failed recovery of the
                # earlier process's snapshot is superseded, not a step the tier lacks.
                self._recovered_failures.discard((step, tier))
                failed = self._failures.get(step, {})
                failed.pop(tier, None)
                if not failed:
                    self._failures.pop(step, None)
            if handle is not None:
                handle._resolve(tier, ok, error)
                durable = [t for t in handle.due if self.pipeline.stores[t].durable]
                if not ok and durable and handle.done() and all(t in handle._errors for t in durable):
                    self._not_durable[step] = {t: handle._errors[t] for t in durable}
            self._drop_handles(step, SaveHandle.done)

    def _slot_released(self, tier: str, slot: int, step: int) -> None:
        if tier == self.pipeline.entry:
            self.pipeline.entry_store.release_slot(slot)

    # ----- saving ------------------------------------------------------------------------------------------
    def prepare(self, template: dict[str, Any]) -> None:
        """Allocate and pre-fault every slot for items shaped like ``template``, so even the first save is fast."""
        if self._closed:  # its slots would stay in shared memory, released by nothing
            raise TieredCkptError("prepare() on a closed engine")
        _, total = plan_items(template, placement=self.pipeline.placement)
        self.pipeline.prepare(total)
        self._drain.slots_ready()

    def _acquire_slot(self, step: int) -> tuple[int | None, float]:
        wait = self.pipeline.entry_cfg.when_full != "skip"
        t0 = time.perf_counter()
        waited = False
        warn_at = SLOT_WAIT_WARN_S

        def on_wait() -> None:  # each look while it waits (every half second)
            nonlocal waited, warn_at
            if not waited:
                log.info("step %d waits for a free slot on tier %r", step, self.pipeline.entry)
            waited = True
            waiting_s = time.perf_counter() - t0
            if waiting_s < warn_at:
                return
            warn_at = waiting_s + SLOT_WAIT_WARN_EVERY_S  # a save that never ends says so, again and again
            note = self._drain.worker_note()
            log.warning("step %d has waited %.0f s for a free slot on tier %r (when_full: wait): every slot still "
                        "holds a step the drain has not taken to the tier below. %s", step, waiting_s,
                        self.pipeline.entry, f"{note[0].upper()}{note[1:]}." if note else
                        "The drain's own warnings say why (a slow or failing tier below)")

        slot = self.pipeline.entry_store.acquire_slot(step, wait=wait, on_wait=on_wait)
        if slot is None:
            self._emit(ev.Event(ev.SKIP, step=step, rank=self.coords.rank, tier=self.pipeline.entry,
                                message="every slot is still draining; save skipped (when_full: skip)"))
            return None, 0.0
        wait_s = time.perf_counter() - t0
        if waited:
            self._emit(ev.Event(ev.SLOT_WAIT, step=step, rank=self.coords.rank, tier=self.pipeline.entry,
                                seconds=wait_s, message="every slot was still draining; save() waited"))
        return slot, wait_s

    def save(self, step: int, items: dict[str, Any], *, persistent: bool = True) -> SaveHandle:
        """Snapshot ``items`` (item name → state dict) into the fastest tier; drain the rest in the background.

        ``persistent=False``: memory tiers only (Megatron's non-persistent checkpoints): no file tier takes this
        step, and it does not count for their ``every``."""
        if self._closed:
            raise TieredCkptError("save() on a closed engine")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(items, dict) or not all(isinstance(k, str) and k for k in items):
            raise ValueError("items must be a dict of item name (str) → state")
        if not items and self.coords.layout.world_size == 1:
            raise ValueError(f"save({step}, {{}}): nothing to save; items maps item names to state dicts")
        if items and all(isinstance(v, torch.Tensor) for v in items.values()):
            names = ", ".join(repr(k) for k in list(items)[:3]) + (", ..." if len(items) > 3 else "")
            raise ValueError(f"save({step}, items): every value of items is a tensor ({names}): this looks like one "
                             "state dict given as the items, which would store each tensor as an item of its own. "
                             f"Name it: save({step}, {{\"model\": model.state_dict()}})")
        for name in items:
            check_item_name(name)
        self.pipeline.check_items(list(items))
        t0 = time.perf_counter()
        placed, total = plan_items(items, self._plan_memos, self.pipeline.placement)
        self._plan_memos = {name: plan.memo for name, plan, _ in placed}
        fingerprints = tuple(p.fingerprint for _, p, _ in placed)
        if self._fingerprints is not None and fingerprints != self._fingerprints:
            self._emit(ev.Event(ev.REPLAN, step=step, rank=self.coords.rank, tier=self.pipeline.entry, nbytes=total,
                                message="the items' structure changed; the snapshot layout was re-planned"))
        self._fingerprints = fingerprints
        if persistent:
            self._ordinal += 1
        # a non-persistent save goes to the memory tiers only, and does not count for the file tiers' ``every``
        due = self.pipeline.due_tiers(self._ordinal, persistent)
        save_id = self._save_id(step)
        slot, _ = self._acquire_slot(step)
        if slot is None:
            return SaveHandle(step, time.perf_counter() - t0, self.pipeline.entry, (), skipped=True)
        store = self.pipeline.entry_store
        try:
            store.write_snapshot(step, slot, placed, total, coords=self.coords, layout=self.config.layout,
                                 run_id=self.config.run_id, persistent=persistent, save_id=save_id,
                                 skipped=[n for n in self.pipeline.order[1:] if n not in due])
        except BaseException:
            store.release_slot(slot)
            raise
        blocking = time.perf_counter() - t0
        handle = SaveHandle(step, blocking, self.pipeline.entry, due)
        handle.save_id = save_id
        try:
            if due:  # one with no tier due is done already: nothing reports on it, so nothing would drop it
                with self._cond:
                    self._handles.setdefault(step, []).append(handle)
            self._emit(ev.Event(ev.SNAPSHOT, step=step, rank=self.coords.rank, tier=self.pipeline.entry,
                                seconds=blocking, nbytes=total, detail={"slot": slot, "due": list(due)}))
            self._drain.submit(DrainRequest(step=step, source=self.pipeline.entry, slot=slot, due=due,
                                            created=handle.created, save_id=save_id,
                                            kept_from=self._kept_from(save_id)))
        except BaseException:
            # Not handed to the drain (its worker could not be started, an interrupt): nothing would ever release
            # the slot or report on the handle, and a later save would wait for the slot for ever. The snapshot
            # stays loadable from memory until the slot is reused.
            self._forget(handle)
            store.release_slot(slot)
            raise
        return handle

    def _kept_from(self, save_id: str | None) -> dict[str, int]:
        """What retention of each node-local tier keeps for the other nodes (node_commits.py): for the save
        ``save_id``; None (a snapshot an earlier process left): every step."""
        commits = self._node_commits
        if commits is None:
            return {}
        return commits.kept_from(save_id) if save_id else dict.fromkeys(commits.stores, node_commits.UNKNOWN)

    def _forget(self, handle: SaveHandle) -> None:
        with self._cond:
            self._drop_handles(handle.step, lambda h: h is handle)

    def _drop_handles(self, step: int, drop: Callable[[SaveHandle], bool]) -> None:
        """Drop ``step``'s handles for which ``drop`` is true (with ``_cond`` held), and the step with its last."""
        handles = self._handles.get(step, [])
        handles[:] = [h for h in handles if not drop(h)]
        if not handles:
            self._handles.pop(step, None)

    def _save_id(self, step: int) -> str:
        """This save's identity, the same on every rank that saves the same steps in the same order; "" where
        the ranks cannot agree on one (no ``torch.distributed`` with several ranks)."""
        if step <= self._generation_high:
            self._generation += 1
        self._generation_high = step
        incarnation = self.coordinator.incarnation
        return f"{incarnation}.{self._generation}" if incarnation else ""

    def _recover(self) -> None:
        """Drain snapshots a previous process left in shared memory to the tiers they never reached: only where
        every rank whose part the tier's commit needs has that save too, in memory or on the tier already (a rank
        killed earlier than the others never saved their last steps: the committing rank would wait
        ``drain.commit_timeout_s`` for each, holding the slots the job's first saves need)."""
        if not self._entry_persists:
            return  # alike on every rank (one configuration)
        found = self.coordinator.alone(self._recovery_candidates)
        entry = self.pipeline.entry_store
        if self.coordinator.group is not None:  # every rank, with or without snapshots: one exchange
            held = [(m.step, m.save_id) for m in entry.metas().values() if not snapshot_layout_changes(m, self.coords)]
            everyone = self.coordinator.all_gather(([(m.step, m.save_id) for m, _ in found], held), "recover")
            recovered = [mine for mine, _ in everyone]
            self._recovering = any(not all(_holds(theirs, step, save) for _, theirs in everyone)
                                   for mine in recovered for step, save in mine)
            found = self.coordinator.alone(self._completable, found, recovered)
            self.coordinator.alone(self._commit_for_others, recovered, everyone[self.coords.rank][1])
        for meta, due in found:
            entry.hold_slot(meta.slot)
            handle = SaveHandle(meta.step, 0.0, self.pipeline.entry, due)
            with self._cond:
                self._handles.setdefault(meta.step, []).append(handle)
            self.recovered.append(handle)
            self._emit(ev.Event(ev.RECOVER, step=meta.step, rank=self.coords.rank, tier=self.pipeline.entry,
                                nbytes=meta.total_bytes, detail={"due": list(due), "slot": meta.slot},
                                message="a snapshot left in memory by an earlier process is drained"))
            self._drain.submit(DrainRequest(step=meta.step, source=self.pipeline.entry, slot=meta.slot, due=due,
                                            created=meta.created, recover=True, save_id=meta.save_id,
                                            kept_from=self._kept_from(None)))

    def _voters(self, store: Store) -> list[int]:
        """The ranks whose parts a commit of ``store`` needs, the committing one first: a shared tier's are the
        job's, a node-local one's the node's (as ``FileStore`` counts them)."""
        if store.tier.capabilities.node_local:
            return sorted(self.pipeline.node_ranks)
        return list(range(self.coords.world_size))

    def _commit_for_others(self, recovered: list[list[tuple[int, str]]], held: list[tuple[int, str]]) -> None:
        """As the committing rank of a file tier: commit the saves other ranks recover at start-up that this rank
        no longer holds in memory (its slots reused by later saves) but whose part it put on the tier before it
        stopped. Nothing else would commit them: the others' recovery writes their parts, and the job resumed
        from an older step (a fault trial). Each commit waits, on a thread of its own, for the parts of every rank
        that has the save in memory or on the tier already; ``load()`` waits for it as for a recovery."""
        others = sorted({(step, save) for r, pairs in enumerate(recovered) if r != self.coords.rank
                         for step, save in pairs if save and not _holds(held, step, save)})
        for name, store in self.pipeline.durable_stores().items():
            files, voters = store.files(), self._voters(store)
            if files is None or voters[0] != self.coords.rank:
                continue
            for step, save in others:
                try:
                    rank = self.coords.rank
                    if not _vote_of(files, step, save, rank) or files.committed_save(step, rank) == save:
                        continue
                except (TierError, OSError) as exc:  # the tier cannot say: no commit from here, as before
                    log.warning("tier %r: cannot tell whether step %d, which other ranks recover, is committed: "
                                "%s", name, step, exc)
                    continue
                if not all(_holds(recovered[r], step, save) or _vote_of(files, step, save, r) for r in voters):
                    continue  # some rank has neither: the commit could never happen (_completable said so there)
                handle = SaveHandle(step, 0.0, self.pipeline.entry, (name,))
                handle.save_id = save
                with self._cond:
                    self._handles.setdefault(step, []).append(handle)
                self.recovered.append(handle)
                log.info("tier %r: committing step %d, which other ranks recover (this rank's part is there)",
                         name, step)
                thread = threading.Thread(target=self._commit_recovered, args=(files, name, handle, voters),
                                          name=f"tiered_ckpt-commit-{step}", daemon=True)
                self._commit_threads.append(thread)
                thread.start()

    def _commit_recovered(self, files: Any, tier: str, handle: SaveHandle, voters: list[int]) -> None:
        wait_s = self.config.drain.commit_timeout_s
        try:
            manifest = files.try_commit(handle.step, self.coords, voters, wait_s=wait_s, save_id=handle.save_id)
        except Exception as exc:  # noqa: BLE001 - reported on the handle, as a drain's failure is
            manifest, error = None, str(exc)
        else:
            error = None if manifest is not None else f"not every rank's part arrived within {wait_s:.0f} s"
        if manifest is not None:
            self._emit(ev.Event(ev.COMMIT, step=handle.step, rank=self.coords.rank, tier=tier,
                                nbytes=manifest.total_bytes, message="committed at start-up for the ranks that "
                                "recovered it"))
        else:
            log.warning("tier %r: step %d, recovered by other ranks, was not committed: %s", tier, handle.step, error)
        self._tier_done(handle.step, tier, manifest is not None, error)

    def _completable(self, found: list[tuple[SlotMeta, tuple[str, ...]]], everyone: list[list[tuple[int, str]]]
                     ) -> list[tuple[SlotMeta, tuple[str, ...]]]:
        """``found`` without the tiers whose commit of the step cannot happen: a rank it needs has neither a
        snapshot of that save (``everyone``: each rank's recovered step → save) nor its part on the tier."""
        out = []
        for meta, due in found:
            keep = []
            for name in due:
                store = self.pipeline.stores[name]
                lacking = [r for r in self._voters(store) if r != self.coords.rank
                           and not _holds(everyone[r], meta.step, meta.save_id) and not _voted(store.files(), meta, r)]
                if lacking:
                    log.warning("tier %r: the snapshot of step %d left in memory is not drained there: rank(s) %s "
                                "have neither that save in memory nor their part on the tier (they stopped before "
                                "saving it), so it could never commit. It stays in memory until its slot is "
                                "reused", name, meta.step, ", ".join(map(str, lacking[:8])))
                else:
                    keep.append(name)
            if keep:
                out.append((meta, tuple(keep)))
        return out

    def _recovery_candidates(self) -> list[tuple[SlotMeta, tuple[str, ...]]]:
        """This rank's snapshots left in memory, each with the tiers it never reached."""
        entry = self.pipeline.entry_store
        metas = sorted(entry.metas().values(), key=lambda m: m.step)
        if not metas:
            return []
        durable = self.pipeline.durable_stores()
        committed: dict[str, set[int]] = {}
        # Listed at once, each bounded by load.list_timeout_s as load()'s listings are: a stalled store must not
        # hold the engine's construction for its timeouts times its retries.
        listings = {name: _Listing(store.durable_steps, name) for name, store in durable.items()}
        limit = self.config.load.list_timeout_s
        _await_listings((listing, limit) for listing in listings.values())
        for name, listing in listings.items():
            answered = listing.done.is_set()  # once: the listing may end while this looks at it
            if answered and listing.error is None:
                committed[name] = set(listing.steps)
                continue
            if answered and listing.unexpected():
                raise listing.error
            # An unreachable tier (an object store down) must not stop the restart: load() names it, and the
            # snapshots stay in memory for a later start to drain there while their slots are not reused.
            why = str(listing.error) if answered else \
                f"no answer to its listing within {limit:g} s (load.list_timeout_s)"
            del durable[name]
            if not answered:
                self._stalled_at_start[name] = listing
            log.warning("tier %r cannot be listed, so the snapshots in memory are not recovered to it now: %s",
                        name, why)
            self._emit(ev.Event(ev.TIER_UNREACHABLE, rank=self.coords.rank, tier=name, message=why))
        if durable and len(durable) == len(self.pipeline.durable_stores()) and not any(committed.values()):
            # every file tier answered, and holds nothing: a load of these steps resumes from memory alone
            self._only_in_memory = {m.step for m in metas}
        other_layout: list[str] = []
        found: list[tuple[SlotMeta, tuple[str, ...]]] = []
        for meta in metas:
            changed = snapshot_layout_changes(meta, self.coords)
            if changed:
                # An elastic restart: this slot holds a rank of the old layout, a part of another job's state.
                # It is never committed as this layout's (the drain refuses it too); it stays, overwritten in time.
                # A non-persistent one is named too: no file tier holds that step, so it is lost with its slot.
                memory_only = "" if meta.persistent else ", non-persistent: held nowhere else"
                other_layout.append(f"step {meta.step} (slot {meta.slot}: {', '.join(changed)}{memory_only})")
                continue
            if not meta.persistent:
                continue  # saved for memory tiers only (a non-persistent step): no file tier ever takes it
            if not meta.checksummed or meta.checksums == "pending":
                # The process died before the checksums taken after the copy were in: nothing shows these bytes
                # are the ones saved. They are hashed now and drained marked so: every load of them, from memory
                # or a file tier, says verified=False (docs/architecture.md).
                log.warning("tier %r: the snapshot of step %d in slot %d (rank %d) has no checksums from its save "
                            "(its process died before they were taken): recovered with status 'unverified "
                            "origin', and every load of it reports verified=False", self.pipeline.entry, meta.step,
                            meta.slot, meta.rank)
                meta = entry.mark_unverified(meta)
            # the tiers that lack it, but not those its save skipped (their `every`), each once it could be listed
            due = tuple(undrained_tiers(meta, {n: committed[n] for n in self.pipeline.order[1:] if n in durable}))
            if due:
                found.append((meta, due))
        if other_layout:  # one line for all of them (an elastic restart finds one per slot)
            log.warning("tier %r: %d snapshot(s) of this rank (%s) are not recovered: saved with another parallel "
                        "layout than this job's (rank %d of %s). They stay in memory, are never loaded as this "
                        "job's state, and their slots are reused by later saves; to keep them, restart with their "
                        "layout", self.pipeline.entry, len(other_layout), "; ".join(other_layout), self.coords.rank,
                        self.coords.layout.to_dict())
        return found

    # ----- loading -----------------------------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        """The configured tiers that are enabled here, fastest first (without internal ones such as the hidden
        ``_staging`` buffers): the keys :meth:`available_steps` has when every tier could be listed."""
        return [n for n in self.pipeline.order if n != STAGING]

    def _list_tiers(self, skip: dict[str, str] | None = None) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Every tier listed at once, each on a thread of its own: a slow tier costs its own time, not the sum,
        and one that has not answered within ``load.list_timeout_s`` is unreachable for this call. Its listing
        goes on in the background, and the next call waits for that one instead of starting another.
        ``skip``: tiers already found unreachable (tier -> why), reported so again without being listed."""
        skip = skip or {}
        names = [n for n in self.tiers if n not in skip]
        limit = self.config.load.list_timeout_s
        limits: dict[str, float | None] = dict.fromkeys(names, limit)
        with self._listings_lock:
            for name in names:
                stalled = self._stalled_at_start.get(name)
                if stalled is not None and stalled.done.is_set():  # it answered at last
                    del self._stalled_at_start[name]
                elif stalled is not None and (limit is None or limit > RELIST_AFTER_STALL_S):
                    limits[name] = RELIST_AFTER_STALL_S  # waited for once already, at the start: not as long
            listings = {}
            for name in names:
                listing = self._listings.get(name)
                if listing is None or listing.done.is_set():
                    listing = _Listing(functools.partial(self.pipeline.stores[name].loadable_steps, self.coords),
                                       name)
                    self._listings[name] = listing
                listings[name] = listing
        _await_listings((listings[name], limits[name]) for name in names)
        out: dict[str, list[int]] = {}
        unreachable: dict[str, str] = {}
        for name in self.tiers:
            if name in skip:
                unreachable[name] = skip[name]
                continue
            listing = listings[name]
            if not listing.done.is_set():
                waited = limits[name]
                why = (f"no answer to its listing within {limit:g} s (load.list_timeout_s) at the engine's start, "
                       f"nor within {waited:g} s now" if waited != limit else
                       f"no answer to its listing within {limit:g} s (load.list_timeout_s)")
                why += ": stalled or slow; raise load.list_timeout_s if it is only slow"
                log.warning("cannot list tier %r: %s", name, why)
                unreachable[name] = why
            elif listing.error is None:
                out[name] = listing.steps
                with self._listings_lock:
                    self._stalled_at_start.pop(name, None)  # answered now: waited for as long as any other
            elif listing.unexpected():
                raise listing.error
            else:
                exc = listing.error
                log.warning("cannot list tier %r: %s", name, exc)
                why = str(exc).removeprefix(f"tier {name!r}: ")
                unreachable[name] = why if isinstance(exc, TierError) else f"{type(exc).__name__}: {why}"
        return out, unreachable

    def available_steps(self) -> dict[str, list[int]]:
        """Per configured tier (fastest first) that could be listed: the committed steps holding this rank's
        part. A tier that could not be listed is left out (:meth:`unreachable_tiers` says why), so
        ``set(available_steps()) == set(engine.tiers)`` means every tier was looked at."""
        return self._list_tiers()[0]

    def unreachable_tiers(self) -> dict[str, str]:
        """The configured tiers that cannot be listed right now (tier → why); empty when every tier can."""
        return self._list_tiers()[1]

    def load(self, step: int | None = None, *, copy: bool | None = None, map_location: Any = None,
             into: dict[str, Any] | None = None) -> LoadResult:
        """The newest step every rank can read (or ``step``), each rank from its fastest tier holding a verified
        copy. With several ranks this is collective: every rank must call it, and all resume at the same step.

        A tier that cannot be listed (an unreachable object store, say) is left out: the step loaded is then
        the newest the other tiers hold, ``result.unreachable`` names what was not seen (and a
        ``tier_unreachable`` event). Where nothing loadable is found, :class:`NoCheckpointError` means every
        tier of every rank was looked at and holds nothing; :class:`CheckpointUnreadableError` that steps are
        there and none could be loaded, or that a file tier failed to read the newest one with its own errors (an
        older step is taken in place of a damaged one, never of one a tier would not serve);
        :class:`TierUnavailableError` that some tier could not be looked at.
        Neither of the last two is a NoCheckpointError: do not start from scratch on them.

        ``into``: item name → state shaped like the one saved (the very dict passed to ``save``, say); its tensors
        receive the checkpoint's values in place, and the result's items hold them (see :mod:`.load_into`). If
        ``load`` raises, those tensors may hold partial data."""
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be a non-negative integer or None, got {step!r}")
        copy = self.config.load.copy if copy is None else copy
        if self._recovering:
            self._await_recovery()
            # every rank lists after every rank's recovery: a rank without any would list before the commit of a
            # step another rank's recovery makes, and the ranks would agree on an older one
            self.coordinator.all_succeeded(True, "recovery awaited")
        # What each rank does alone between the collectives goes through alone(): a rank that fails there tells
        # the others (PeerFailedError on every rank) instead of leaving them waiting in the next one.
        available, unreachable = self.coordinator.alone(self._checked_lists, into, step)
        mine = {s for steps in available.values() for s in steps}
        rejected: set[int] = set()
        fallbacks: list[str] = []
        damaged: list[str] = []  # per failed read: "damage" (checksums, decoding), "layout" or "error"
        written_into: list[int] = []  # steps whose failed reads may have written into the targets of ``into``
        relists = 0
        while True:
            chosen = self.coordinator.agree_on_step(mine - rejected, step)
            if chosen is None and step is None and relists < _MAX_RELISTS:
                # The steps listed may have gone since (retention after a newer commit, in another process):
                # only a listing that shows no step not tried yet may say "no checkpoint". Collective: every rank
                # lists again when any rank sees a new step.
                # A tier that did not answer is not waited for again: it stays unreachable for this load.
                fresh, fresh_unreachable = self.coordinator.alone(self._list_tiers, unreachable)
                new = {s for steps in fresh.values() for s in steps} - rejected
                if not self.coordinator.all_succeeded(not new, "relist"):
                    relists += 1
                    available, unreachable, mine = fresh, fresh_unreachable, new | rejected
                    continue
            if chosen is None:
                what = f"step {step}" if step is not None else "a checkpoint"
                detail = f" ({'; '.join(fallbacks)})" if fallbacks else ""
                if step is not None and step not in mine:  # say what is there: a typo, or a step long evicted
                    held_here = "; ".join(f"{name}: {_steps_text(held)}" for name, held in available.items())
                    detail += f" (the tiers hold steps {held_here})" if held_here else ""
                self._nothing_loadable(unreachable, f"no step that every rank can load: rank {self.coords.rank} "
                                                    f"found no loadable copy of {what} on any tier{detail}",
                                       tried=sorted(rejected), fallbacks=fallbacks, damaged=damaged,
                                       held=sorted(mine) if step is None else sorted(mine & {step}), requested=step)
            tried_from = len(damaged)
            result = self.coordinator.alone(self._load_step, chosen, available, copy, map_location, fallbacks, into,
                                            damaged, step is not None, written_into)
            if self.coordinator.all_succeeded(result is not None, "loaded"):
                assert result is not None
                # emitted once every rank has its part: a step some rank could not read is not loaded here either
                self._emit(ev.Event(ev.LOAD, step=result.step, rank=self.coords.rank, tier=result.tier,
                                    seconds=result.seconds, nbytes=result.nbytes, detail={"verified": result.verified}))
                result.unreachable = dict(unreachable)
                newer = self.coordinator.newer_elsewhere if step is None else {}
                if newer and self.coords.rank == min(newer):
                    # The job resumes from an older step than some ranks hold: never without a word (a tier that
                    # failed on one node, or another node's retention removed the step this one still has).
                    held = "; ".join(f"rank {r}: {_steps_text(s)}" for r, s in list(newer.items())[:8])
                    log.warning("load: step %d is the newest step every rank holds; newer steps are held by some "
                                "ranks only (%s): their other ranks' parts are missing on every tier",
                                result.step, held)
                if self.coords.rank == 0 and result.step in self._only_in_memory:
                    # A job launched again after its checkpoint directory was emptied (to start over) resumes
                    # from what its previous process left in memory (drained back there at start-up): a resume,
                    # never a silent one.
                    log.warning("load: step %d was only in memory when this process started (tier %r, run_id %r): "
                                "the file tiers held no step. This resumes the run, it does not start over. To "
                                "start over, remove the run's snapshots first (`tiered-ckpt gc --config ... --stale "
                                "--delete --force`) or give the job a new run_id", result.step, result.tier,
                                self.config.run_id)
                if unreachable:
                    log.warning("load: step %d from tier %r without seeing tier(s) %s: a newer step may be there",
                                result.step, result.tier, ", ".join(repr(t) for t in unreachable))
                if step is None and self.coords.rank == 0:
                    self._warn_if_gone_back_past(result.step, available)
                return result
            # Some rank could not read its part of this step anywhere: everyone moves to an older one together,
            # unless a file tier failed with its own errors (throttled, unreachable, permission denied): the step is
            # there, and an older one would lose the progress since (its saves then replace this step).
            if step is None:
                unsure = result is None and "error" in damaged[tried_from:]
                if not self.coordinator.all_succeeded(not unsure, "tier errors"):
                    self._tier_errors(chosen, sorted(s for s in mine - rejected if s < chosen), unsure, fallbacks)
            if result is not None:  # this rank read its part: say why it is not used
                why = f"step {chosen}: another rank could not load its part of it (its log says why)"
                fallbacks.append(why)
                self._emit(ev.Event(ev.FALLBACK, step=chosen, rank=self.coords.rank, tier=result.tier, message=why))
                log.warning("load: %s; this rank read its part from tier %r, but every rank moves on together%s",
                            why, result.tier, "" if step is not None else " to an older step")
            rejected.add(chosen)
            if step is not None:
                self._nothing_loadable(unreachable, f"step {step} cannot be loaded by every rank "
                                                    f"({'; '.join(fallbacks)})", tried=[step], fallbacks=fallbacks,
                                       damaged=damaged)

    def _warn_if_gone_back_past(self, step: int, available: dict[str, list[int]]) -> None:
        """A Megatron user's trial: a run resumed with --ckpt-step 4 below steps 6 and 8, saved step 6 again, and a
        plain restart then resumed from step 8, the abandoned run, without a word (Megatron-LM, which follows its
        tracker, would take 6). load() still takes the newest step; it says so when a lower step was committed
        after it, on the first file tier holding the step (from the manifests this load read already)."""
        name = next((n for n in self.pipeline.order if self.pipeline.stores[n].durable
                     and step in available.get(n, [])), None)
        if name is None:
            return
        store = self.pipeline.stores[name]
        try:
            taken = store.read_manifest(step, cached=True).created
            later = [s for s in available[name] if s < step and store.read_manifest(s, cached=True).created > taken]
        except (TieredCkptError, OSError):
            return  # a warning only: what could not be read was said by the load
        if later:
            log.warning("load: step %d is the newest step, but step(s) %s on tier %r were committed after it: a run "
                        "went back below step %d (load(step=...), Megatron's --ckpt-step) and saved since. This "
                        "resumes from step %d; to go on with the later run, load(step=%d) (--ckpt-step %d), or "
                        "remove the steps above it", step, ", ".join(map(str, later)), name, step, step, max(later),
                        max(later))

    def _await_recovery(self) -> None:
        """Wait (up to ``load.list_timeout_s``) for the start-up recovery to finish on each recovered step's first
        tier: a step that only its recovery commits there (a rank killed before draining its part, the others'
        parts on the tier) would otherwise be missed by a load listing the tiers a moment before, and the job
        would resume from an older step."""
        pending = [(h, h.due[0]) for h in self.recovered if h.due and not h.done(h.due[0])]
        if not pending:
            return
        limit = self.config.load.list_timeout_s
        log.info("load: waiting up to %g s for the start-up recovery of step(s) %s", limit,
                 ", ".join(str(h.step) for h, _ in pending))
        deadline = time.monotonic() + limit
        for handle, tier in pending:
            try:
                handle.wait(tier, timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("load: the start-up recovery of step %d to tier %r has not finished within %g s "
                            "(load.list_timeout_s): loading without it", handle.step, tier, limit)
                return
            except SaveError:
                pass  # said by the drain; the step is not on that tier, which the listing shows

    def _checked_lists(self, into: dict[str, Any] | None, step: int | None
                       ) -> tuple[dict[str, list[int]], dict[str, str]]:
        if into is not None and (not isinstance(into, dict) or not all(isinstance(k, str) for k in into)):
            raise ValueError("into must be a dict of item name (str) → state, like the items given to save()")
        for name, target in (into or {}).items():
            if not isinstance(target, dict | list | tuple | torch.Tensor | int | float | str | bytes | None):
                # a module, an optimizer: nothing is copied into it, and the load would leave it as it was, silently
                # (a plain value, as save() got it, is fine: the checkpoint's comes back in result.items)
                hint = (f"pass its state_dict() (into={{{name!r}: obj.state_dict()}}: a module's shares its "
                        "tensors, which receive the values in place) or restore it with tiered_ckpt.state.apply"
                        if hasattr(target, "state_dict") else
                        "into maps an item to the state whose tensors receive the values in place (a dict, a list "
                        "or a tensor); leave other items out, load() returns them in result.items")
                raise LoadIntoError(f"load(into=...): item {name!r} is {type(target).__name__}, not state: {hint}")
        available, unreachable = self._list_tiers()
        for name, why in unreachable.items():
            self._emit(ev.Event(ev.TIER_UNREACHABLE, step=step, rank=self.coords.rank, tier=name, message=why))
        return available, unreachable

    def _tier_errors(self, step: int, older: list[int], here: bool, fallbacks: list[str]) -> None:
        """Raise CheckpointUnreadableError, on every rank, for ``step``: a file tier holds it and failed to read
        it with its own errors (``here``: on this rank), not proof of damage (a new user's trial: a throttled
        object store made a restart resume from the step before, and the next save replaced the newest)."""
        who = "this rank" if here else "another rank (its log says which tier and why)"
        then = (f"; to resume from an older step anyway, load(step={older[-1]}) (the newest older step this rank "
                "holds)" if older else "")
        raise CheckpointUnreadableError(
            f"step {step} could not be read by {who}: its tier answered with errors, not proven damage "
            f"({'; '.join(fallbacks[-3:]) if here else 'see that rank'}). Not moving to an older step: the step is "
            "there, and resuming before it would lose the training since (and the next saves would replace it): "
            f"load again once the tier answers; tiered-ckpt verify says whether its files are intact{then}",
            fallbacks)

    def _nothing_loadable(self, unreachable: dict[str, str], message: str, *, tried: list[int] | None = None,
                          fallbacks: list[str] | None = None, damaged: list[str] | None = None,
                          held: list[int] | None = None, requested: int | None = None) -> None:
        """Raise NoCheckpointError when every rank listed every tier and no rank found a step (StepNotFoundError
        when a step was ``requested``: not "nothing there", only not that step); else
        CheckpointUnreadableError when steps were there and none could be loaded (``tried``: the same on every
        rank, agreed step by step) or some ranks hold steps that others lack (``held``: this rank's); else
        TierUnavailableError (collective: every rank raises the same one)."""
        if self.coordinator.all_succeeded(not unreachable):
            if tried:
                steps = ", ".join(map(str, tried))
                if damaged and all(d == "damage" for d in damaged):
                    advice = ("Repair or remove them (tiered-ckpt verify and ls say what is wrong; remove a step's "
                              "directory, or point the tiers at a new path), or load an older step")
                elif damaged and all(d == "layout" for d in damaged):
                    advice = ("They were saved with another parallel layout than this job's (the reasons above say "
                              "what changed): resume with that layout, or from a checkpoint saved with this one")
                else:  # a timeout or an error of the tier is no proof of damage: never advise removing
                    advice = ("Some reads failed with the tier's errors, not proven damage: load again once the "
                              "tier answers (tiered-ckpt verify says whether the files are intact); do not remove "
                              "them for this")
                raise CheckpointUnreadableError(
                    f"{message}. Step(s) {steps} are checkpoints that could not be loaded: this is not \"no "
                    "checkpoint\", so do not start from scratch here (a new run's saves would land beside them, "
                    f"and they still count as the newest). {advice}", fallbacks)
            if not self.coordinator.all_succeeded(not held, "held"):
                raise CheckpointUnreadableError(
                    f"{message}. Some ranks hold steps (rank {self.coords.rank}: "
                    f"{', '.join(map(str, (held or [])[-8:])) or 'none'}) that not every rank holds (a replaced "
                    "node's node-local tier, a rank-count change?): this is not \"no checkpoint\", so do not start "
                    "from scratch here. Give every rank a tier holding the step (a shared tier), or load with the "
                    "ranks that saved it", fallbacks)
            if requested is None:  # where it looked: a wrong path or run_id shows here
                raise NoCheckpointError(f"{message} (looked in {self._where()})")
            raise StepNotFoundError(message)
        everywhere = set(unreachable) >= set(self.tiers)
        advice = ("This is not \"no checkpoint\": one may be on a tier that could not be looked at. Make it "
                  "reachable and load again" + ("" if everywhere else
                                                " (or set enabled: false on it to resume without it)"))
        if unreachable:
            why = "; ".join(f"tier {t!r}: {r}" for t, r in unreachable.items())
            rest = "No other tier to look at" if everywhere else f"Nothing loadable on the other tiers: {message}"
            raise TierUnavailableError(f"rank {self.coords.rank} could not list {why}. {rest}. {advice}",
                                       unreachable)
        raise TierUnavailableError(f"another rank could not list every tier (its log and tier_unreachable events say "
                                   f"which). Nothing loadable on the tiers listed: {message}. {advice}", {})

    def _where(self) -> str:
        """The tiers load() lists, as they describe themselves (their paths, URLs), with this run_id."""
        tiers = ", ".join(f"{name!r} ({self.pipeline.stores[name].tier.describe()})" for name in self.tiers)
        return f"{tiers}; run_id {self.config.run_id!r}"

    def _load_step(self, step: int, available: dict[str, list[int]], copy: bool, map_location: Any,
                   fallbacks: list[str], into: dict[str, Any] | None = None, damaged: list[str] | None = None,
                   explicit: bool = False, written_into: list[int] | None = None) -> LoadResult | None:
        for name in self.pipeline.order:
            if step not in available.get(name, []):
                continue
            t0 = time.perf_counter()
            try:
                items, verified, nbytes = self._load_from(name, step, copy, map_location, into)
            except (CorruptionError, DecodeError, TierError, OSError) as exc:
                if into is not None and written_into is not None and self.pipeline.stores[name].slots() is not None:
                    written_into.append(step)  # a memory snapshot's fused copy writes the targets before its verdict
                fallbacks.append(f"tier {name!r} step {step}: {exc}")
                kind = ("damage" if isinstance(exc, CorruptionError | DecodeError | BlobNotFoundError | RangeError
                                               | FileNotFoundError)  # (a step retired since the listing, too)
                        else "layout" if getattr(exc, "layout_mismatch", False)
                        else "error" if self.pipeline.stores[name].slots() is None else "memory")
                if damaged is not None:
                    damaged.append(kind)
                self._emit(ev.Event(ev.FALLBACK, step=step, rank=self.coords.rank, tier=name, message=str(exc),
                                    detail={"key": getattr(exc, "key", None)}))
                order = self.pipeline.order
                later = [t for t in order[order.index(name) + 1:] if step in available.get(t, [])]
                then = (f"trying tier {later[0]!r}" if later else "no other tier holds it" + (
                    "" if explicit else ", and a tier's error is no damage: not moving to an older step"
                    if kind == "error" else ": trying an older step, if every rank has one"))
                log.warning("load: tier %r step %d: %s; %s", name, step, exc, then)
                continue
            seconds = time.perf_counter() - t0
            others = [s for s in (written_into or []) if s != step]
            if into is not None and others:
                left = unfilled_targets(into, items)
                if left:
                    # They keep bytes of the failed read, not values of their own: never hand them on as loaded.
                    raise LoadIntoError(
                        f"load(into=...): step {step} from tier {name!r} does not hold {left[0]}"
                        f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}, which a failed read of step "
                        f"{others[-1]} from memory may have written part-way (copied before its checksum verdict): "
                        "its values are neither the checkpoint's nor the ones it had. Load without into= (then "
                        "load_state_dict), or give into= only what the checkpoint holds")
            return LoadResult(step, items, name, verified, seconds, nbytes, list(fallbacks))
        return None

    def _load_from(self, name: str, step: int, copy: bool, map_location: Any,
                   into: dict[str, Any] | None = None) -> tuple[dict, bool, int]:
        return self.pipeline.stores[name].read_step(step, self.coords, copy=copy, map_location=map_location,
                                                    verify=self.config.load.verify,
                                                    trust_pickles=self.config.load.trust_pickles, into=into)

    # ----- lifecycle ---------------------------------------------------------------------------------------
    def pending(self) -> dict[int, list[str]]:
        """Drain progress: step → the tiers that have not finished it yet (committed or failed), oldest first."""
        with self._cond:
            handles = [h for hs in self._handles.values() for h in hs]
        out: dict[int, list[str]] = {}
        for h in handles:
            left = [t for t in h.due if not h.done(t)]
            if left:
                out.setdefault(h.step, []).extend(t for t in left if t not in out.get(h.step, []))
        return dict(sorted(out.items()))

    def wait(self, timeout: float | None = None, *, progress: bool = False) -> None:
        """Wait until every save so far has drained (committed or failed) on every due tier; then raise
        :class:`~tiered_ckpt.handles.SavesFailedError` (a SaveError) naming every step and tier that failed since
        the previous ``wait()``, as ``handle.wait()`` does for its own step (on ranks that do not commit a tier:
        their part written and voted, see :meth:`SaveHandle.wait`). A snapshot that an earlier process left in
        shared memory and that could not be drained at start-up is named as such, and not at all once this
        process saved its step again and the tier committed that save. ``progress``: a bar on stderr counting the
        (step, tier) deliveries still due."""
        if progress:
            self._wait_with_bar(timeout)
        elif not self._drain.wait_idle(timeout):
            raise TimeoutError(f"drain still busy after {timeout} s")
        with self._cond:
            failures, self._failures = self._failures, {}
            self._recovered_failures.clear()
            self._not_durable.clear()  # reported here, with the rest
        if failures:
            raise SavesFailedError(failures)

    def take_not_durable(self) -> dict[int, dict[str, str]]:
        """The steps saved since the last call (or ``engine.wait()``, which raises them with the rest) whose
        every due durable tier failed (step → tier → why): they are in memory only. For callers that never wait
        on their saves (Megatron-LM ignores what ``save_checkpoint`` returns): the drop-in raises on them at the
        next save."""
        with self._cond:
            lost, self._not_durable = self._not_durable, {}
        return lost

    def wait_committed(self, handle: SaveHandle, timeout: float | None = None) -> None:
        """``handle.wait(timeout=timeout)``, then, on a rank that does not commit a due file tier's steps, until
        the committing rank has committed this save there: what ``handle.wait()`` tells only on the committing
        rank (elsewhere it means this rank's part is written and voted). Raises :class:`SaveError` naming the
        tier where the commit did not come within ``timeout`` (default: twice ``drain.commit_timeout_s`` and
        10 s: the committing rank's own part may take as long as the wait for the others'), and
        :class:`TimeoutError` where the drain itself did not finish. Call it on every rank, or on those that act
        on the commit (a load right after it, a copy elsewhere): it runs no collective. A commit that retention
        has retired since counts (each commit's manifest names the saves committed before it). A commit that
        failed is known here as soon as the committing rank records it (a rank's part that could not be
        written, the committing rank's own failure), or once the committing rank's engine is seen dead on this
        node; one whose committing rank died on another node is known at the deadline only, and so is the failure
        of a save recovered at start-up: in a training loop, give a ``timeout`` within the time between saves."""
        limit = 2 * self.config.drain.commit_timeout_s + 10
        deadline = time.monotonic() + (limit if timeout is None else timeout)
        handle.wait(timeout=timeout)
        failures = {}
        for name in handle.due:  # one deadline for every tier: the committing rank commits them at once
            store = self.pipeline.stores[name]
            files, committer = store.files(), self._voters(store)[0]
            if files is None or committer == self.coords.rank:
                continue  # the committing rank: its handle said committed
            try:
                files.wait_committed(handle.step, self.coords.rank, max(0.0, deadline - time.monotonic()),
                                     save_id=handle.save_id, fail_fast=handle not in self.recovered,
                                     why=f" (the committing rank is rank {committer}; its log says more)",
                                     committer=committer,
                                     gone=files.gone_probe(self.coords, self.coordinator.node_ranks, handle.save_id))
            except TierError as exc:
                failures[name] = str(exc)
        if failures:
            raise SaveError(handle.step, failures)

    def _wait_with_bar(self, timeout: float | None) -> None:
        from .progress import sized_bar

        deadline = None if timeout is None else time.monotonic() + timeout
        total = sum(map(len, self.pending().values()))
        # counts of deliveries, no rate: a delivery takes seconds, and tqdm's "3.27s/ deliveries" reads badly
        with sized_bar(total=total, desc=f"rank {self.coords.rank} drain", leave=False,
                       bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} deliveries [{elapsed}]{postfix}") as bar:
            while True:
                left = self.pending()
                bar.set_postfix_str(", ".join(f"step {s}: {'/'.join(t)}" for s, t in list(left.items())[:3]))
                bar.update(max(0, total - sum(map(len, left.values())) - bar.n))
                slice_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                if self._drain.wait_idle(slice_s):
                    bar.update(total - bar.n)
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"drain still busy after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) holds a copy of the parent's engine: closing it would delete
            # the parent's slots, unlock its run lock (flock is shared with the child) and stop its drain.
            return
        timeout = self.config.drain.close_timeout_s if timeout is None else timeout
        notice = self._close_notice(timeout)
        try:
            for thread in self._commit_threads:  # each is bounded by commit_timeout_s
                thread.join(timeout)
            if not self._drain.close(timeout):
                log.warning("close(): drains still pending after %.0f s; the shm snapshot stays for recovery",
                            timeout)
            else:
                self._release_memory()
            with self._cond:
                unsaid = dict(self._failures)
            if unsaid:  # failures no wait() reported: said once more, as an error (warnings scroll past)
                said = "; ".join(f"step {s}: {', '.join(f'{t!r} ({why[:200]})' for t, why in f.items())}"
                                 for s, f in list(sorted(unsaid.items()))[-4:])
                log.error("close(): %d save(s) failed on a tier since the last engine.wait(): %s%s", len(unsaid), said,
                          " (the older ones in the log)" if len(unsaid) > 4 else "")
        finally:
            if notice is not None:
                notice.cancel()
            if self._node_commits is not None:
                self._node_commits.close()
            self.pipeline.close()
            self._detach()
            _live.discard(self)

    def _close_notice(self, timeout: float) -> threading.Timer | None:
        """A warning, should close() still wait after CLOSE_NOTICE_S, naming what it waits for: a script stopped
        with Ctrl-C (its engines close at exit) otherwise sat silent for up to ``close_timeout_s``."""
        def say() -> None:
            left = self.pending()
            if not left:
                return
            what = "; ".join(f"step {s} to {', '.join(map(repr, t))}" for s, t in list(left.items())[:4])
            kept = self.pipeline.entry_store.tier.capabilities.survives_process
            after = (f"what is not drained stays in shared memory, and the next engine of run_id "
                     f"{self.config.run_id!r} drains it" if kept else
                     "those tiers do not get the step (it is in this process's memory only)")
            log.warning("close() waits for the drain of %s (drain.close_timeout_s: %.0f s); interrupting it "
                        "(Ctrl-C again) stops the wait: %s", what, timeout, after)

        timer = threading.Timer(CLOSE_NOTICE_S, say)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # no new thread at interpreter shutdown: no notice
            return None
        return timer

    def _release_memory(self) -> None:
        """``on_close: release``: delete this rank's slots on memory tiers that outlive the process, where a file
        tier committed the step (a slot holding a step nothing else has stays: it is the only copy)."""
        found: set[int] | None = None

        def durable() -> set[int]:  # listed once, and only if some tier releases anything
            nonlocal found
            if found is None:
                found = set()
                deadline = time.monotonic() + self.config.drain.commit_timeout_s  # once, for every tier
                for store in self.pipeline.durable_stores().values():
                    try:
                        self._await_commits(store, deadline)
                        found.update(store.durable_steps())
                    except (TierError, OSError) as exc:
                        log.warning("close(): cannot list tier %r (%s); slots it may hold stay in memory",
                                    store.name, exc)
            return found

        for name in self.tiers:
            try:
                kept = self.pipeline.stores[name].release_on_close(durable)
            except (TierError, OSError) as exc:
                log.warning("close(): tier %r: cannot release its slots: %s", name, exc)
                continue
            if kept:
                log.info("close(): tier %r keeps step(s) %s in memory: no file tier committed them", name,
                         ", ".join(map(str, kept)))

    def _await_commits(self, store: Any, deadline: float) -> None:
        """On a rank that does not commit ``store``'s steps: wait (until ``deadline``, a monotonic time) for the
        commit of the newest persistent step this process saved into its slots and put its part of on the tier
        (the committing rank commits in order: the older ones are settled by then). The drain's end here means
        this rank voted, not that the committing rank has committed yet: ``on_close: release`` would keep that
        slot for ever (found by a trial of the DCP writer: every rank but 0 left its slot behind). An earlier
        process's snapshots are not waited for: the start-up may have found them uncommittable, or of another
        layout (a trial: 120 s at every close of a restarted job)."""
        files, committer = store.files(), self._voters(store)[0]
        if files is None or committer == self.coords.rank:
            return
        metas = sorted((m for m in self.pipeline.entry_store.metas().values()
                        if m.persistent and m.created >= self._started), key=lambda m: (m.step, m.created))
        voted = [m for m in metas[-1:] if _voted(files, m, self.coords.rank)]
        for meta in voted:
            try:
                files.wait_committed(meta.step, self.coords.rank, max(0.0, deadline - time.monotonic()),
                                     save_id=meta.save_id, fail_fast=True,  # this process's save: its first drain
                                     committer=committer,
                                     gone=files.gone_probe(self.coords, self.coordinator.node_ranks, meta.save_id))
            except TierError as exc:
                log.info("close(): tier %r: %s; its slot stays in memory", store.name, exc)

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def tier_config(self, name: str) -> TierConfig:
        return self.config.tier(name)


def _close_all() -> None:
    # Runs before multiprocessing joins its children, so the drain worker gets its stop message.
    for engine in list(_live):  # none in a forked child (_forget_engines_in_child)
        try:
            engine.close()
        except Exception:
            log.exception("closing a checkpoint engine at exit failed")


def _close_all_at_exit() -> None:
    """Close the live engines when the interpreter exits, while thread pools still take work.

    An ``atexit`` handler runs too late: by then ``concurrent.futures`` has stopped every thread pool (its own
    hook, in ``threading``'s exit phase), and a script that saved and returned without ``close()`` lost the
    saves still draining ("cannot schedule new futures after interpreter shutdown"). ``threading``'s exit hooks
    run last-registered first, so this registers after ``concurrent.futures.thread`` has registered its own; the
    ``atexit`` registration stays for interpreters without that hook."""
    import concurrent.futures.thread  # noqa: F401  (registers its hook now, if not yet: ours must come after)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_close_all)
        except RuntimeError:  # the interpreter is already shutting down: atexit's turn is all that is left
            pass
    atexit.register(_close_all)  # a second call closes nothing more: close() is idempotent


_close_all_at_exit()


def _forget_engines_in_child() -> None:
    """A forked child (a DataLoader worker: fork is Linux's default) runs ``threading``'s exit hooks when it ends;
    the parent's engines it inherited are not its own to close."""
    _live.clear()


os.register_at_fork(after_in_child=_forget_engines_in_child)


#: Bytes of an item name (of each ``/`` part): with the layouts' extensions and temporary-file suffixes, a file
#: name stays within the 255 bytes of common file systems.
MAX_ITEM_NAME_BYTES = 200


def check_item_name(name: str) -> None:
    """ValueError at ``save()`` for an item name no tier could store as a file name (an item name becomes one:
    ``rank_00000/<name>.flat``), instead of a failure of each tier's write in the background."""
    where = f"item name {name[:60]!r}{'...' if len(name) > 60 else ''}"
    try:
        check_key(name)  # what every tier refuses in a key: a leading '/', backslashes, NUL, empty/./.. parts
    except ValueError as exc:
        raise ValueError(f"{where}: cannot be a file name ({exc}); rename the item") from None
    for part in name.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_ITEM_NAME_BYTES:
            raise ValueError(f"{where}: longer than {MAX_ITEM_NAME_BYTES} bytes, too long for a file name; "
                             "use a shorter name")


def _holds(held: list[tuple[int, str]], step: int, save: str) -> bool:
    """Whether a rank's snapshots in memory ((step, save) pairs) hold the save ``save`` of ``step`` (by step alone
    where either save has no identity)."""
    return any(s == step and (sid == save or "" in (sid, save)) for s, sid in held)


_UNREADABLE = object()


def _vote_save(files: Any, step: int, rank: int) -> Any:
    """The save of ``rank``'s manifest of ``step`` on the file store ``files`` ("" where it has no identity): None
    where there is none, ``_UNREADABLE`` where it cannot be read (unreachable, damaged)."""
    try:
        return files.read_rank_manifest(step, rank).extra.get(SAVE_KEY, "")
    except BlobNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - unreadable or unreachable: each caller says what that counts as
        return _UNREADABLE


def _vote_of(files: Any, step: int, save: str, rank: int) -> bool:
    """Whether ``rank``'s part of the save ``save`` of ``step`` is on ``files``; False where it cannot be read."""
    return _vote_save(files, step, rank) == save


def _voted(files: Any, meta: SlotMeta, rank: int) -> bool:
    """Whether ``rank``'s part of the save of ``meta`` is on the file store ``files`` (its rank manifest); a store
    that cannot be asked counts as yes: the drain then finds out, as before."""
    if files is None:
        return True
    vote = _vote_save(files, meta.step, rank)
    if vote is None or vote is _UNREADABLE:
        return vote is _UNREADABLE
    return not meta.save_id or vote in ("", meta.save_id)


def _steps_text(steps: list[int], most: int = 8) -> str:
    """``10, 20`` or, for a long list, its newest ``most`` steps and how many there are."""
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-most:]))
    return shown if len(steps) <= most else f"{len(steps)} steps, the newest {shown}"
