"""The drain: moves each saved step down the tiers in the background (docs/architecture.md).

A :class:`DrainRuntime` owns one thread per tier. Each tier takes the steps due to it in order, and writes each
from the *nearest tier above it that holds the step*: the snapshot slot for the first tier below it, otherwise
the closest tier that committed the step in this same drain. The runtime is the same code whether it runs as
threads of the training process (``drain.mode: thread``) or inside the drain worker process (``process``, see
``worker.py``), where it reads the shared-memory snapshot directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from . import events as ev
from .checksum import snapshot_checksum
from .crashpoints import crash_point
from .errors import TierError
from .file_store import FileStore
from .manifest import RankManifest
from .memory_store import MemoryStore, SlotMeta
from .parallel import RankCoords

log = logging.getLogger(__name__)

Store = MemoryStore | FileStore


@dataclass(frozen=True)
class DrainRequest:
    step: int
    source: str  # the memory tier holding the snapshot
    slot: int
    due: tuple[str, ...]  # tiers to write, in pipeline order
    created: float = field(default_factory=time.time)  # when the snapshot was taken (time to durable)
    recover: bool = False


@dataclass
class _Job:
    req: DrainRequest
    futures: dict[str, Future]
    memory_slots: dict[str, int]  # memory tier -> slot that holds this step there
    released: bool = False


class DrainRuntime:
    """Per-tier worker threads that drain steps; see the module docstring."""

    def __init__(self, stores: dict[str, Store], order: list[str], coords: RankCoords,
                 emit: Callable[[ev.Event], None],
                 on_tier_done: Callable[[int, str, bool, str | None], None],
                 on_slot_released: Callable[[str, int, int], None],
                 on_job_done: Callable[[DrainRequest, dict[str, bool], dict[str, int]], None] | None = None,
                 commit_wait_s: float = 120.0, node_ranks: list[int] | None = None):
        self.stores = stores
        self.order = order
        self.coords = coords
        self.emit = emit
        self.on_tier_done = on_tier_done
        self.on_slot_released = on_slot_released
        self.on_job_done = on_job_done
        self.commit_wait_s = commit_wait_s
        self.node_ranks = sorted(node_ranks or [coords.rank])
        self._cond = threading.Condition()
        self._pins: Counter[tuple[str, int]] = Counter()
        self._pending = 0
        self._queues: dict[str, queue.Queue] = {}
        self._threads: dict[str, threading.Thread] = {}
        # Memory tiers written by a hop (e.g. shm below gpu): which step each slot holds.
        self._mem_slots: dict[str, dict[int, int]] = {
            name: {slot: meta.step for slot, meta in store.metas().items()}
            for name, store in stores.items() if isinstance(store, MemoryStore)
        }
        self._closed = False
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-snapshot-hash")

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

    # ----- submitting --------------------------------------------------------------------------------------
    def submit(self, req: DrainRequest) -> None:
        if self._closed:
            raise RuntimeError("the drain is closed")
        job = _Job(req, {t: Future() for t in req.due}, {req.source: req.slot})
        with self._cond:
            for t in (req.source, *req.due):
                self._pins[(t, req.step)] += 1
            self._pending += 1
        if not req.due:
            self._finish(job)
            return
        for t in req.due:
            self._queue(t).put(job)

    def _queue(self, tier: str) -> queue.Queue:
        q = self._queues.get(tier)
        if q is None:
            q = self._queues[tier] = queue.Queue()
            th = threading.Thread(target=self._tier_loop, args=(tier, q), name=f"tiered_ckpt-drain-{tier}",
                                  daemon=True)
            self._threads[tier] = th
            th.start()
        return q

    def busy(self) -> bool:
        """Whether a submitted request has not finished on every due tier yet."""
        with self._cond:
            return self._pending > 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        idle = self.wait_idle(timeout)
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for th in self._threads.values():
            th.join(timeout=1.0 if not idle else None)
        self._hasher.shutdown(wait=idle)
        return idle

    # ----- the work ----------------------------------------------------------------------------------------
    def _tier_loop(self, tier: str, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            self._run(tier, job)

    def _source_for(self, tier: str, job: _Job) -> str:
        idx = self.order.index(tier)
        for upper in reversed(self.order[:idx]):
            if upper == job.req.source:
                return upper
            fut = job.futures.get(upper)
            if fut is not None and fut.result():
                return upper
        return job.req.source

    def _run(self, tier: str, job: _Job) -> None:
        req = job.req
        t0 = time.perf_counter()
        ok, error = False, None
        try:
            source = self._source_for(tier, job)
            store = self.stores[tier]
            if isinstance(store, MemoryStore):
                nbytes = self._hop_memory(source, store, job)
                self.emit(ev.Event(ev.DRAIN, step=req.step, rank=self.coords.rank, tier=tier,
                                   seconds=time.perf_counter() - t0, nbytes=nbytes, detail={"source": source}))
                self.emit(ev.Event(ev.COMMIT, step=req.step, rank=self.coords.rank, tier=tier,
                                   seconds=time.time() - req.created, nbytes=nbytes))
            else:
                self._write_file_tier(source, store, job, t0)
            ok = True
        except Exception as exc:  # a failing tier never stops the others
            error = f"{type(exc).__name__}: {exc}"
            log.warning("tier %r could not take step %d: %s", tier, req.step, error)
            self.emit(ev.Event(ev.COMMIT_FAILED, step=req.step, rank=self.coords.rank, tier=tier,
                               seconds=time.perf_counter() - t0, message=error))
        job.futures[tier].set_result(ok)
        self.on_tier_done(req.step, tier, ok, error)
        if ok or all(f.done() for f in job.futures.values()):
            self._release(job)
        if all(f.done() for f in job.futures.values()):
            self._finish(job)

    def _release(self, job: _Job) -> None:
        # Once one tier below holds the step, nothing will read the source slot again.
        with self._cond:
            if job.released:
                return
            job.released = True
        self.on_slot_released(job.req.source, job.req.slot, job.req.step)

    def _finish(self, job: _Job) -> None:
        self._release(job)
        results = {t: f.result() for t, f in job.futures.items()}
        if self.on_job_done is not None:
            self.on_job_done(job.req, results, dict(job.memory_slots))
        with self._cond:
            for t in (job.req.source, *job.req.due):
                self._pins[(t, job.req.step)] -= 1
                if self._pins[(t, job.req.step)] <= 0:
                    del self._pins[(t, job.req.step)]
            self._pending -= 1
            self._cond.notify_all()

    def _memory_meta(self, source: str, job: _Job) -> tuple[MemoryStore, SlotMeta]:
        store = self.stores[source]
        assert isinstance(store, MemoryStore)
        slot = job.memory_slots[source]
        meta = store.read_meta(slot)
        if meta is None or meta.step != job.req.step:
            raise TierError(f"snapshot of step {job.req.step} is no longer in slot {slot}", tier=source)
        return store, meta

    def _hop_memory(self, source: str, target: MemoryStore, job: _Job) -> int:
        """Copy a snapshot from one memory tier into a slot of another (e.g. gpu → shm)."""
        src_store, meta = self._memory_meta(source, job)
        data = src_store.data(meta)[:meta.total_bytes]
        tier = target.tier.name
        slots = self._mem_slots.setdefault(tier, {})
        with self._cond:
            while True:
                free = [s for s in range(target.nslots) if s not in slots]
                if free:
                    slot = free[0]
                    break
                movable = [s for s, st in slots.items() if (tier, st) not in self._pins or st == job.req.step]
                if movable:
                    slot = min(movable, key=lambda s: slots[s])
                    break
                self._cond.wait(1.0)
            slots.pop(slot, None)
        target.invalidate(slot)
        buf = target.buffer(slot, meta.total_bytes)
        from .cuda_streams import copy_bytes  # CUDA only when a side is on CUDA: on a side stream, event-waited

        copy_bytes(buf[:meta.total_bytes], data, purpose="drain")
        target.publish(replace(meta, slot=slot, rank=target.rank))
        with self._cond:
            slots[slot] = job.req.step
        job.memory_slots[tier] = slot
        return meta.total_bytes

    def _write_file_tier(self, source: str, store: FileStore, job: _Job, t0: float) -> None:
        req = job.req
        digests: Future | None = None
        crash_point("drain.before_write")
        try:
            if isinstance(self.stores[source], MemoryStore):
                mem, meta = self._memory_meta(source, job)
                sources = mem.item_sources(meta)
                # The snapshot's own checksums (for verified restores from memory) are computed on another core
                # while this tier is written; they are published once the tier committed.
                digests = self._digest_snapshot(mem, meta, sources)
                manifest = store.write_rank(req.step, self.coords, sources)
            else:
                upper = self.stores[source]
                assert isinstance(upper, FileStore)
                manifest = store.copy_rank_from(upper, req.step, self.coords)
            crash_point("drain.after_write")
            self._commit(store, job, manifest, source, t0)
            if digests is not None:
                self._record_snapshot_checksums(mem, meta, digests)
        finally:
            if digests is not None:
                digests.exception()  # wait: nothing may read the slot once this job lets it go

    def _commit(self, store: FileStore, job: _Job, manifest: RankManifest, source: str, t0: float) -> None:
        req = job.req
        nbytes = sum(f.size for f in manifest.files)
        self.emit(ev.Event(ev.DRAIN, step=req.step, rank=self.coords.rank, tier=store.name,
                           seconds=time.perf_counter() - t0, nbytes=nbytes, detail={"source": source}))
        # A shared tier is committed by global rank 0 for the job; a node-local one by each node's first rank.
        ranks = self.node_ranks if store.tier.capabilities.node_local else list(range(self.coords.world_size))
        if self.coords.rank != ranks[0]:
            return
        crash_point("drain.before_commit")
        committed = store.try_commit(req.step, self.coords, ranks, wait_s=self.commit_wait_s)
        if committed is None:
            raise TierError(f"step {req.step} not committed: not every rank's files arrived within "
                            f"{self.commit_wait_s:.0f} s", tier=store.name)
        self.emit(ev.Event(ev.COMMIT, step=req.step, rank=self.coords.rank, tier=store.name,
                           seconds=time.time() - req.created, nbytes=committed.total_bytes))
        store.retain(store.cfg.keep, self.pinned_steps(store.name) - {req.step}, self.coords.rank)

    def _digest_snapshot(self, mem: MemoryStore, meta: SlotMeta, sources: list) -> Future | None:
        if all(it.checksum for it in meta.items) or not mem.tier.capabilities.survives_process:
            return None
        return self._hasher.submit(lambda: [snapshot_checksum(src.data) for src in sources])

    @staticmethod
    def _record_snapshot_checksums(mem: MemoryStore, meta: SlotMeta, digests: Future | None) -> None:
        """Publish the snapshot's checksums, so that a restart can verify what it loads from memory."""
        if digests is None or digests.exception() is not None:
            return
        for it, checksum in zip(meta.items, digests.result(), strict=True):
            it.checksum = checksum
        current = mem.read_meta(meta.slot)
        if current is not None and current.step == meta.step and current.created == meta.created:
            mem.publish(meta)
