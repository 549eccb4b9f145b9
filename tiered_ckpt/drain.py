"""The drain: moves each saved step down the tiers in the background (docs/architecture.md).

A :class:`DrainRuntime` owns one thread per tier. Each tier takes the steps due to it in order, and writes each
from the *nearest tier above it that holds the step*: the snapshot slot for the first tier below it, otherwise
the closest tier that committed the step in this same drain. The runtime is the same code whether it runs as
threads of the training process (``drain.mode: thread``) or inside the drain worker process (``process``, see
``worker.py``), where it reads the shared-memory snapshot directly. It implements the
:class:`~tiered_ckpt.drain_protocol.Drain` protocol and sees tiers only through the
:class:`~tiered_ckpt.store.Store` protocol: how a tier takes a step and who commits it are the stores' business.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from . import events as ev
from .drain_protocol import DrainRequest, OnSlotReleased, OnTierDone
from .errors import DrainClosedError, TierError
from .parallel import RankCoords
from .store import Store

log = logging.getLogger(__name__)
__all__ = ["DrainRequest", "DrainRuntime"]
BEHIND_WARN = 4  # a tier with this many steps still to take is warned about (then at twice as many, ...)


@dataclass
class _Job:
    req: DrainRequest
    futures: dict[str, Future]
    memory_slots: dict[str, int]  # memory tier -> slot that holds this step there
    released: bool = False
    tiers_left: int = 0  # due tiers whose thread has not finished with this job (its deletions may run on)
    ended: set[str] = field(default_factory=set)  # due tiers that ended it (_end)


class DrainRuntime:
    """Per-tier worker threads that drain steps; see the module docstring."""

    def __init__(self, stores: dict[str, Store], order: list[str], coords: RankCoords,
                 emit: Callable[[ev.Event], None],
                 on_tier_done: OnTierDone,
                 on_slot_released: OnSlotReleased,
                 on_job_done: Callable[[DrainRequest, dict[str, bool], dict[str, int]], None] | None = None,
                 commit_wait_s: float = 120.0, node_ranks: list[int] | None = None,
                 fence: Callable[[], None] | None = None):
        self.stores = stores
        self.order = order
        self.coords = coords
        self.emit = emit
        self.on_tier_done = on_tier_done
        self.on_slot_released = on_slot_released
        self.on_job_done = on_job_done
        self.commit_wait_s = commit_wait_s
        self.node_ranks = sorted(node_ranks or [coords.rank])
        # Raises once this drain may no longer write (a worker whose training process is gone: fencing.py).
        self.fence = fence or (lambda: None)
        self._cond = threading.Condition()
        self._pins: Counter[tuple[str, int]] = Counter()
        self._pending = 0
        self._backlog: Counter[str] = Counter()  # tier -> steps submitted to it and not finished there
        self._warned_at: dict[str, int] = {}  # tier -> the backlog it was last warned about
        self._queues: dict[str, queue.Queue] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._closed = False
        self._submitting = threading.RLock()  # submit() against close(): no job is queued behind a stop mark
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-snapshot-hash")
        # tier -> the thread running what its last commit left (retention's deletions; _run): an S3 step's
        # deletion took 0.2-0.4 s of a 3 s drain on the development VM, now beside the tier's next write
        self._deletions: dict[str, threading.Thread] = {}
        self._newest_taken: dict[str, int] = {}  # tier -> the newest step its thread took
        self._kept_from: dict[str, int] = {}  # node-local tier -> its retention keeps this step and newer ones

    # ----- pins: a pinned (tier, step) is never evicted or overwritten -------------------------------------
    def pin(self, tier: str, step: int) -> None:
        with self._cond:
            self._pins[(tier, step)] += 1

    def unpin(self, tier: str, step: int) -> None:
        with self._cond:
            self._pins[(tier, step)] -= 1
            if self._pins[(tier, step)] <= 0:
                del self._pins[(tier, step)]
            self._cond.notify_all()

    def pinned_steps(self, tier: str) -> set[int]:
        with self._cond:
            return {s for (t, s) in self._pins if t == tier}

    def _kept_for(self, tier: str) -> set[int]:
        """The steps retention must leave on ``tier``: this rank's pins, what other ranks of this node may
        still copy from it (:meth:`_needed_below`), and on a node-local tier of a job on several nodes the steps
        from the newest one every node has committed on (:meth:`_kept_for_other_nodes`)."""
        return self.pinned_steps(tier) | self._needed_below(tier) | self._kept_for_other_nodes(tier)

    def _kept_for_other_nodes(self, tier: str) -> set[int]:
        with self._cond:
            floor = self._kept_from.get(tier)
        files = self.stores[tier].files()
        if floor is None or files is None:
            return set()
        try:
            return {s for s in files.committed_steps() if s >= floor}
        except Exception as exc:  # fail closed: retention stops here and is tried again later
            raise TierError(f"cannot list the steps the other nodes still need ({exc}): nothing is retired now",
                            tier=tier) from exc

    def _needed_below(self, tier: str) -> set[int]:
        """Steps of a node-local tier that ranks of this node may still be copying to a shared tier below it.

        This rank's pins cover only its own copies. Global rank 0's do cover everyone's (it commits the shared
        tiers, and a commit waits for every rank's part), but on another node the node-local tier's committing
        rank finishes its own part of the shared tier and lets the step go while its neighbours still read
        theirs from the node-local tier. So such a rank keeps every step newer than the shared tier's newest
        commit (each rank's tier thread takes steps in order: a newer commit there means every rank is done
        with the older ones), for at most twice the commit timeout, so that a shared tier that stays down does
        not stop retention for good."""
        files = self.stores[tier].files()
        if (files is None or self.coords.rank == 0 or not files.tier.capabilities.node_local
                or len(self.node_ranks) == self.coords.world_size):
            return set()
        below = [self.stores[t].files() for t in self.order[self.order.index(tier) + 1:]]
        shared = [f for f in below if f is not None and not f.tier.capabilities.node_local]
        if not shared:
            return set()
        try:
            mine = files.committed_steps()
        except Exception:  # noqa: BLE001 - retention's own listing fails the same way and says so
            return set()
        try:
            newest = min(max(f.committed_steps(), default=-1) for f in shared)
        except Exception as exc:  # noqa: BLE001 - cannot tell: keep what is young enough to be in use
            log.warning("tier %r: cannot tell which steps the tiers below still copy from it: %s", tier, exc)
            newest = -1
        deadline = time.time() - 2 * self.commit_wait_s
        held = set()
        for step in (s for s in mine if s > newest):
            try:
                made = files.tier.modified(files.layout.manifest_key(step))
            except Exception:  # noqa: BLE001 - gone meanwhile, or no answer: an age that cannot be told
                made = None
            if made is not None and made > deadline:  # an unknown age never stops retention for good
                held.add(step)
        return held

    def is_pinned(self, tier: str, step: int) -> bool:
        with self._cond:
            return (tier, step) in self._pins

    # ----- submitting --------------------------------------------------------------------------------------
    def submit(self, req: DrainRequest) -> None:
        with self._cond:
            self._kept_from.update(req.kept_from)  # the newest the engine knows (node_commits.py)
        job = _Job(req, {t: Future() for t in req.due}, {req.source: req.slot}, tiers_left=len(req.due))
        with self._submitting:
            if self._closed:
                raise DrainClosedError(req.step)
            with self._cond:
                for t in (req.source, *req.due):
                    self._pins[(t, req.step)] += 1
                self._pending += 1
            if req.due:
                for t in req.due:
                    self._note_backlog(t, +1, req.step)  # before the put: the tier's thread may finish it at once
                    self._queue(t).put(job)
                return
        self._finish(job)

    def _note_backlog(self, tier: str, change: int, step: int) -> None:
        """Count the steps a tier still has to take; warn at 4, 8, 16, ... of them (saves outpace it)."""
        with self._cond:
            self._backlog[tier] += change
            behind = self._backlog[tier]
            warned = self._warned_at.get(tier, BEHIND_WARN // 2)
            if behind < warned // 2:
                self._warned_at[tier] = max(BEHIND_WARN // 2, warned // 2)  # caught up: warn again if it falls back
            if change < 0 or behind < 2 * warned:
                return
            self._warned_at[tier] = behind
        message = (f"tier {tier!r} has {behind} steps still to take: saves come faster than it takes them. The tiers "
                   "above keep those steps (beyond their keep) until it has them; save to it less often (every:) "
                   "or make it faster")
        log.warning(message)
        self.emit(ev.Event(ev.TIER_BEHIND, step=step, rank=self.coords.rank, tier=tier, message=message,
                           detail={"steps": behind}))

    def _queue(self, tier: str) -> queue.Queue:
        q = self._queues.get(tier)
        if q is None:
            q = self._queues[tier] = queue.Queue()
            th = threading.Thread(target=self._tier_loop, args=(tier, q), name=f"tiered_ckpt-drain-{tier}",
                                  daemon=True)
            self._threads[tier] = th
            th.start()
        return q

    def slots_ready(self) -> None:
        """Nothing to map: the threads here read the saver's own slot buffers."""

    def worker_note(self) -> str | None:
        return None  # threads of this process: no worker

    def busy(self) -> bool:
        """Whether a submitted request has not finished on every due tier yet."""
        with self._cond:
            return self._pending > 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether every submitted request finished, retention's deletions included, within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._deletions:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        idle = self.wait_idle(timeout)
        with self._submitting:  # a submit() either queued its job ahead of the stop marks, or is refused
            self._closed = True
            for q in self._queues.values():
                q.put(None)
        for th in self._threads.values():
            th.join(timeout=1.0 if not idle else None)
        with self._cond:
            deleting = list(self._deletions.values())
        for th in deleting:  # daemon threads: a process that exits meanwhile leaves debris, never waits
            th.join(timeout=1.0 if not idle else None)
        self._hasher.shutdown(wait=idle)
        return idle

    # ----- the work ----------------------------------------------------------------------------------------
    def _tier_loop(self, tier: str, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                self._run(tier, job)
            except Exception as exc:  # a bug past _run's own handling: later jobs must still run, this one end
                log.exception("tier %r: the drain of step %d failed unexpectedly", tier, job.req.step)
                self._end_after_bug(tier, job, exc)

    def _end_after_bug(self, tier: str, job: _Job, exc: Exception) -> None:
        """End ``job`` on ``tier`` as failed if ``_run`` had not ended it there, so wait() never hangs on it."""
        req = job.req
        if not job.futures[tier].done():
            error = f"the drain failed unexpectedly: {type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):  # observers are guarded; emit itself may be what failed
                self.emit(ev.Event(ev.COMMIT_FAILED, step=req.step, rank=self.coords.rank, tier=tier, message=error))
            self._report(tier, job, False, error)
        elif all(f.done() for f in job.futures.values()):
            self._release(job)  # (a no-op where _run had released it)
        try:
            self._settle_deletion(tier)  # jobs end in order
        except Exception:
            log.exception("tier %r: waiting for the deletion before step %d's failed", tier, req.step)
        self._end(tier, job, [])  # once per tier: a no-op where _run had ended it

    def _report(self, tier: str, job: _Job, ok: bool, error: str | None) -> None:
        """``job``'s outcome on ``tier``: its future, the slot's release once a tier below holds the step (or every
        tier is done with it), then the engine's callback. In that order: a save that waited for this one's handle
        finds its slot free (the callback first, a save right after the handle could still wait for a slot)."""
        job.futures[tier].set_result(ok)
        if ok or all(f.done() for f in job.futures.values()):
            self._release(job)
        try:
            self.on_tier_done(job.req.step, tier, ok, error)
        except Exception:  # the job must still end
            log.exception("tier %r: reporting step %d's outcome failed", tier, job.req.step)

    def _source_for(self, tier: str, job: _Job) -> str:
        idx = self.order.index(tier)
        for upper in reversed(self.order[:idx]):
            if upper == job.req.source:
                return upper
            fut = job.futures.get(upper)
            if fut is not None and fut.result():
                return upper
        return job.req.source

    # ----- retention's deletions beside the next write ----------------------------------------------------
    def _settle_deletion(self, tier: str) -> None:
        """Wait until ``tier``'s deletion thread (if any) is done, the end of its job included."""
        with self._cond:
            th = self._deletions.get(tier)
        if th is not None:
            th.join()

    def _run(self, tier: str, job: _Job) -> None:
        req = job.req
        t0 = time.perf_counter()
        ok, error = False, None
        housekeeping: list[Callable[[], None]] = []
        newest = self._newest_taken.get(tier)
        self._newest_taken[tier] = req.step if newest is None else max(newest, req.step)
        if newest is not None and req.step <= newest:
            # A job that went back saves a step again, perhaps one whose old files are being deleted: the new
            # files are written once that deletion is over (retention deletes only steps older than the newest).
            self._settle_deletion(tier)
        try:
            source = self._source_for(tier, job)
            housekeeping = self._deliver(tier, source, job, t0)
            ok = True
        except Exception as exc:  # a failing tier never stops the others
            error = f"{type(exc).__name__}: {exc}"
            log.warning("tier %r could not take step %d: %s", tier, req.step, error)
            self.emit(ev.Event(ev.COMMIT_FAILED, step=req.step, rank=self.coords.rank, tier=tier,
                               seconds=time.perf_counter() - t0, message=error))
        self._report(tier, job, ok, error)
        if error is not None:
            self._record_failure(tier, req, error)
        # The save is reported and its slot free. What its commit left (retention's deletions) may take time: on a
        # thread of its own, beside this tier's next write, and the job ends after it (engine.wait() covers it).
        # One such thread per tier at a time, and the tier's next commit waits for it (_deliver): retention
        # lists the tier only when no deletion runs, and never falls more than one step behind.
        self._settle_deletion(tier)  # jobs end in order
        if not housekeeping:
            self._end(tier, job, housekeeping)
            return
        th = threading.Thread(target=self._end, args=(tier, job, housekeeping), name=f"tiered_ckpt-delete-{tier}",
                              daemon=True)  # a process exiting meanwhile leaves debris (gc), never waits
        with self._cond:  # registered once started: whoever sees it may join it
            try:
                th.start()
            except RuntimeError:  # no new threads at interpreter shutdown (close() from atexit): here, then
                started = False
            else:
                started = True
                self._deletions[tier] = th
        if not started:
            self._end(tier, job, housekeeping)

    def _record_failure(self, tier: str, req: DrainRequest, error: str) -> None:
        """Tell the ranks that would wait for this rank's part of ``req`` on ``tier`` that it failed (the store
        records it: failure_records.py). After the report: a tier that just failed may take its time to refuse
        the record too (its retry policy, seconds), and the handle and the slot must not wait for that; the job's
        end (``engine.wait()``) and the tier's next step do. Not from a fenced worker, which writes nothing
        more."""
        try:
            self.fence()
        except Exception:  # noqa: BLE001 - fenced: its training process is gone, another may own the tiers
            return
        self.stores[tier].write_failed(req.step, self.coords, node_ranks=self.node_ranks, save_id=req.save_id,
                                       reason=error)

    def _end(self, tier: str, job: _Job, housekeeping: list[Callable[[], None]]) -> None:
        """Run ``housekeeping``, then end ``job`` on ``tier`` (the whole job once every due tier has)."""
        req = job.req
        try:
            for task in housekeeping:
                try:
                    task()
                except Exception as exc:  # noqa: BLE001 - the step is committed; what is left is debris for gc
                    log.warning("tier %r: housekeeping after step %d failed: %s", tier, req.step, exc)
            with self._cond:
                if tier in job.ended:
                    return
                job.ended.add(tier)
            self._note_backlog(tier, -1, req.step)
            with self._cond:
                job.tiers_left -= 1
                last = job.tiers_left == 0
            if last:
                self._finish(job)
        finally:
            with self._cond:
                if self._deletions.get(tier) is threading.current_thread():
                    del self._deletions[tier]
                    self._cond.notify_all()

    def _deliver(self, tier: str, source: str, job: _Job, t0: float) -> list[Callable[[], None]]:
        """Write the step on ``tier`` from ``source``, then commit it there (the stores decide how); what the
        commit left for later (``Written.housekeeping``)."""
        req, store = job.req, self.stores[tier]
        self.fence()
        written = store.write_step(req.step, self.coords, self.stores[source], slot=job.memory_slots.get(source),
                                   pinned=lambda step: self.is_pinned(tier, step), hasher=self._hasher,
                                   node_ranks=self.node_ranks, wait_s=self.commit_wait_s)
        try:
            if written.slot is not None:
                job.memory_slots[tier] = written.slot
            self.emit(ev.Event(ev.DRAIN, step=req.step, rank=self.coords.rank, tier=tier,
                               seconds=time.perf_counter() - t0, nbytes=written.nbytes, detail={"source": source}))

            def committed(nbytes: int) -> None:
                self.emit(ev.Event(ev.COMMIT, step=req.step, rank=self.coords.rank, tier=tier,
                                   seconds=time.time() - req.created, nbytes=nbytes))

            self.fence()
            self._settle_deletion(tier)  # retention lists the tier at commit: never while it deletes there
            store.commit(written, self.coords, node_ranks=self.node_ranks, wait_s=self.commit_wait_s,
                         pinned=lambda: self._kept_for(tier) - {req.step}, on_committed=committed,
                         fail_fast=not req.recover)
            written.committed()
        finally:
            written.close()  # nothing may read the source slot once this job lets it go
        return written.housekeeping

    def _release(self, job: _Job) -> None:
        # Once one tier below holds the step, nothing will read the source slot again.
        with self._cond:
            if job.released:
                return
            job.released = True
        try:
            self.on_slot_released(job.req.source, job.req.slot, job.req.step)
        except Exception:  # the tier's thread goes on: its job must still end, or wait() never returns
            log.exception("step %d: releasing its slot %s on tier %r failed; that slot may stay taken",
                          job.req.step, job.req.slot, job.req.source)

    def _finish(self, job: _Job) -> None:
        try:
            self._release(job)
            results = {t: f.result() for t, f in job.futures.items()}
            with self._cond:
                for t in (job.req.source, *job.req.due):
                    self._pins[(t, job.req.step)] -= 1
                    if self._pins[(t, job.req.step)] <= 0:
                        del self._pins[(t, job.req.step)]
            # The job's tiers may have kept steps beyond their ``keep`` for it (a tier below still had to copy
            # them from there): retention again, before the job counts as done, so wait() returns once they are
            # gone.
            for t in (job.req.source, *job.req.due):
                self._retain(t)
            if self.on_job_done is not None:
                self.on_job_done(job.req, results, dict(job.memory_slots))
        except Exception:  # the job still ends: wait() and close() must never hang on it
            log.exception("step %d: ending its drain job failed", job.req.step)
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _retain(self, tier: str) -> None:
        try:
            for task in self.stores[tier].retain(self.coords, node_ranks=self.node_ranks,
                                                 pinned=lambda: self._kept_for(tier)):
                task()
        except Exception as exc:  # noqa: BLE001 - what is left goes at the next commit, or is debris for gc
            log.warning("tier %r: retention failed: %s", tier, exc)
