"""The drain worker process: the drain runs here so its Python work never competes with training for the GIL.

It is started with ``spawn`` (never ``fork``: a forked copy of a CUDA or multi-threaded training process is
unsafe), builds its own tier objects from the configuration, and reads the shared-memory snapshot directly — no
tensor ever travels through a pipe. Only small messages do: requests in, events and outcomes out. If the
training process dies, the worker exits at once without writing more (``fencing.py``): a newer owner of the run
may already be reusing its slots. ``close()`` and interpreter exit end a worker in bounded time whatever its
state (SIGKILL after the deadline: a stopped process cannot take SIGTERM, but is killed by SIGKILL).

:func:`open_drain` picks the drain for a pipeline; all three (:class:`~tiered_ckpt.drain.DrainRuntime`,
:class:`ProcessDrain`, :class:`SplitDrain`) implement :class:`~tiered_ckpt.drain_protocol.Drain`
(docs/architecture.md, "The two protocols").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import logging.handlers
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from . import copy_gate
from . import events as ev
from .config import Config
from .drain import DrainRuntime
from .drain_protocol import Drain, DrainRequest, OnSlotReleased, OnTierDone
from .errors import BlobNotFoundError, DrainClosedError, TieredCkptError
from .fencing import hold_worker_lock, owner_alive, release_worker_lock, watch_parent, worker_lock_path
from .manifest import SAVE_KEY
from .parallel import RankCoords
from .pipeline import Pipeline, build_stores
from .plugins import manager_for_worker
from .store import Store
from .tiers.base import worker_source
from .worker_channel import QueuedSender, channels, close_child_ends

log = logging.getLogger(__name__)
#: After its stop message (or the close deadline), how long a worker gets to exit before it is SIGKILLed.
STOP_GRACE_S = 10.0
#: The request that asks the worker to map its source tier's slots ahead of the first drain from each.
MAP_SLOTS = "map_slots"
_drains: weakref.WeakSet[ProcessDrain] = weakref.WeakSet()
# A forked child (a DataLoader worker) shares the parent's request queue: a stop message from its exit hook
# would stop the parent's drain worker.
os.register_at_fork(after_in_child=_drains.clear)


def open_drain(pipeline: Pipeline, on_tier_done: OnTierDone, on_slot_released: OnSlotReleased) -> Drain:
    """The drain for ``pipeline``: the worker process (``drain.mode: process``) where a shared-memory tier can
    hand it the snapshot (behind threads for an in-process tier above it), threads of this process otherwise."""
    stores, order = pipeline.stores, pipeline.order
    caps = [stores[n].tier.capabilities for n in order]
    shared = worker_source(caps)
    if pipeline.config.drain.mode == "process" and shared is not None:
        if shared == 0:
            return ProcessDrain(pipeline.config, pipeline.coords, order, pipeline.local_rank, pipeline.node_ranks,
                                pipeline.emit, on_tier_done, on_slot_released, stores=stores)
        return SplitDrain(pipeline, shared, on_tier_done, on_slot_released)
    if pipeline.config.drain.mode == "process":
        volatile = [n for n, c in zip(order, caps, strict=True) if not c.survives_process and not c.memory]
        shm = any(c.memory and c.survives_process for c in caps)
        log.info("%s: the drain runs as threads of this process", f"tier(s) {', '.join(map(repr, volatile))} keep "
                 "their files in this process's memory, where a worker process could not write them"
                 if shm and volatile else "no shared-memory tier to hand the snapshot to a worker process")
    return DrainRuntime(stores, order, pipeline.coords, pipeline.emit, on_tier_done, on_slot_released,
                        **pipeline.drain_options())


def _map_slots(store: Store, stopping: threading.Event) -> None:
    """The worker's side of :meth:`ProcessDrain.slots_ready`: map the source tier's slots (best effort: a slot
    that cannot be mapped now is mapped, or its error reported, by the drain that reads it). Before each slot it
    steps aside while a save copies (the mapping is kernel work on a core the copy may want) and stops once the
    worker is stopping."""
    slots = store.slots()
    if slots is None:
        return

    def before_each() -> bool:
        copy_gate.wait_clear()
        return not stopping.is_set()

    t0 = time.perf_counter()
    n = slots.map_slots(before_each)
    log.debug("drain worker: mapped %d slot(s) of tier %r in %.3f s", n, store.name, time.perf_counter() - t0)


class _LogsToParent(logging.handlers.QueueHandler):
    """The worker's log records, sent to the training process to be handled there (its handlers, its format, its
    log files): the worker itself has no logging set up, so they went to stderr bare."""

    def enqueue(self, record: logging.LogRecord) -> None:
        self.queue.put(("log", record))


@contextlib.contextmanager
def _worker_process(results: Any, log_level: int) -> Iterator[None]:
    """What the worker sets in its own process (signals, logging), put back when it ends: it makes no difference
    to a worker process, which exits then, but the tests run :func:`worker_main` in pytest's own process."""
    import signal

    ours = logging.getLogger("tiered_ckpt")
    before = ours.level, ours.propagate
    to_parent = _LogsToParent(results)
    ours.setLevel(log_level)  # what the training process would let through, decided there
    ours.addHandler(to_parent)
    ours.propagate = False
    # Ctrl-C in a terminal reaches the whole process group: the training process decides (its close() finishes
    # or abandons the drain); the worker neither dies mid-write nor prints a KeyboardInterrupt traceback.
    # The same for SIGTERM, which a scheduler (SLURM, torchrun) sends to the whole process group: a training
    # process that handles it (Megatron-LM's --exit-signal-handler saves a last checkpoint, then exits) needs its
    # drain to go on; one that dies of it takes the worker with it (watch_parent), which then writes nothing more.
    signals = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in signals.items():
            signal.signal(sig, handler)
        ours.removeHandler(to_parent)
        ours.setLevel(before[0])
        ours.propagate = before[1]


def worker_main(config: Config, coords: RankCoords, order: list[str], local_rank: int, node_ranks: list[int],
                requests: Any, results: Any, parent_pid: int, gate: Any = None, log_level: int = logging.WARNING
                ) -> None:
    with _worker_process(results, log_level):
        _drain_requests(config, coords, order, local_rank, node_ranks, requests, results, parent_pid, gate)


def _drain_requests(config: Config, coords: RankCoords, order: list[str], local_rank: int, node_ranks: list[int],
                    requests: Any, results: Any, parent_pid: int, gate: Any) -> None:
    watch_parent(parent_pid)  # an orphan exits at once: it never writes what a newer owner may own
    import torch

    torch.set_num_threads(1)  # leave the cores to training
    if gate is not None:
        copy_gate.install(gate)  # the training process's saves mark their copies there: the drain sleeps meanwhile

    def emit(event: ev.Event) -> None:
        results.put(("event", event))

    def fence() -> None:  # before each write and commit (the watcher may be a poll interval late)
        if not owner_alive(parent_pid):
            raise TieredCkptError(f"drain worker {os.getpid()}: its training process {parent_pid} is gone; "
                                  "fenced, nothing more is written")

    lock_fd = None
    lock_path = worker_lock_path(config, coords.rank, create=False)
    try:
        if lock_path is not None:
            lock_fd = hold_worker_lock(lock_path)
        pm = manager_for_worker(config.plugins)  # the training process's plugins (plugins.py)
        stores = build_stores(config, pm, coords, local_rank, order, emit)
        runtime = DrainRuntime(
            stores, order, coords, emit,
            on_tier_done=lambda step, tier, ok, err: results.put(("tier_done", step, tier, ok, err)),
            on_slot_released=lambda tier, slot, step: results.put(("slot_released", tier, slot, step)),
            on_job_done=lambda req, res, slots: results.put(("job_done", req.step, req.created)),
            commit_wait_s=config.drain.commit_timeout_s, node_ranks=node_ranks, fence=fence,
        )
    except BaseException as exc:
        results.put(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    results.put(("ready", os.getpid()))
    stopping = threading.Event()  # ends a mapping of the slots ahead (MAP_SLOTS) between two slots
    while True:
        try:
            req = requests.get(timeout=1.0)
        except queue.Empty:
            continue
        except EOFError:  # the training process let go of its end: it died (the watcher ends this process, and
            if not owner_alive(parent_pid):  # fence() stops every write before), or its drain was dropped
                time.sleep(1.0)
                continue
            break
        if req is None:
            break
        if req == MAP_SLOTS:
            threading.Thread(target=_map_slots, args=(stores[order[0]], stopping), name="tiered_ckpt-map-slots",
                             daemon=True).start()
            continue
        runtime.submit(req)
    stopping.set()
    runtime.close()
    for store in stores.values():
        store.close()
    if lock_fd is not None:
        release_worker_lock(lock_path, lock_fd)
    results.put(("closed", os.getpid()))


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the worker is spawned: the new interpreter inherits the disposition, so a Ctrl-C
    during its start-up (imports take seconds) prints no KeyboardInterrupt traceback either. Only the main
    thread may change signal handlers; from another thread the worker sets it itself, a little later."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawned worker without re-running the user's script in it.

    ``spawn`` re-imports ``__main__`` in the child: a training script without an ``if __name__ == "__main__"``
    guard would build a second engine there. The worker needs nothing from it (its target and arguments live in
    tiered_ckpt), so the parent hides where ``__main__`` came from while the child's start-up data is taken.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            if "__spec__" in saved:
                main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class ProcessDrain:
    """The training-process side of the worker: submits requests, relays events and outcomes.

    The worker takes a second or more to come up (``spawn``, then importing torch). Until it says it is ready,
    requests are drained by threads of this process (a :class:`DrainRuntime` over ``stores``, the training
    process's own tier objects), so the first saves never wait for a slot on the worker's start-up. Once it is
    ready, every later request goes to the worker, as soon as those threads have finished what they took: the
    two never drain at the same time, so each tier still takes its steps in order. Only where every tier
    below the shared-memory one is a file tier (a memory hop needs the worker's own slots); otherwise requests
    queue for the worker as they always did.
    """

    def __init__(self, config: Config, coords: RankCoords, order: list[str], local_rank: int, node_ranks: list[int],
                 emit: Callable[[ev.Event], None], on_tier_done: OnTierDone, on_slot_released: OnSlotReleased,
                 stores: dict[str, Store] | None = None):
        self.config, self.coords, self.order, self.local_rank = config, coords, order, local_rank
        self.node_ranks = node_ranks
        self.emit = emit
        self.on_tier_done = on_tier_done
        self.on_slot_released = on_slot_released
        self._cond = threading.Condition(threading.RLock())
        # (step, created) -> request, tiers still due, slot released?, the worker process it was handed to: a
        # worker's death fails only its own requests, never those its replacement already took.
        self._outstanding: dict[tuple[int, float], tuple[DrainRequest, set[str], bool, Any]] = {}
        self._all_stores = stores or {}  # to tell, after a worker died, what it committed before it could say so
        self._proc: Any = None
        self._requests: QueuedSender | None = None
        self._closing = False
        self._ready = threading.Event()
        # Threads here can drain only into tiers without slots: a memory hop needs the worker's own slots.
        self._stores = stores if stores is not None and all(
            n in stores and stores[n].slots() is None for n in order[1:]) else None
        self._local: DrainRuntime | None = None
        self._here_pending = 0  # requests the threads here took and have not finished
        self._held: list[DrainRequest] = []  # for the worker, once the threads here are done
        self.drained_here = 0  # requests drained by this process's threads while the worker was starting
        self._slots_ready = False  # prepare() has run: every worker started maps the slots ahead
        self._start()
        _drains.add(self)

    def _local_runtime(self) -> DrainRuntime:
        if self._local is None:
            assert self._stores is not None
            self._local = DrainRuntime(self._stores, self.order, self.coords, self.emit, self.on_tier_done,
                                       self.on_slot_released, on_job_done=self._local_job_done,
                                       commit_wait_s=self.config.drain.commit_timeout_s, node_ranks=self.node_ranks)
        return self._local

    def _drain_here(self, req: DrainRequest) -> None:
        # Called with self._cond held (an RLock: a request with no due tier finishes inside submit).
        self.drained_here += 1
        self._here_pending += 1
        self._local_runtime().submit(req)

    def _local_job_done(self, req: DrainRequest, results: dict, slots: dict) -> None:
        dropped: list[DrainRequest] = []
        with self._cond:
            self._here_pending -= 1
            if self._here_pending == 0 and self._held:
                held, self._held = self._held, []
                for r in held:
                    if self._closing:  # close() gave up waiting: nothing takes these any more
                        dropped.append(r)
                    elif self._ready.is_set():
                        self._outstanding[(r.step, r.created)] = (r, set(r.due), False, self._proc)
                        # in order, ahead of any later save's request, and never behind the stop message: sent
                        # under the lock, as submit() sends (put never blocks: worker_channel.py)
                        self._requests.put(r)
                    else:  # the worker went away meanwhile: keep draining here
                        self._drain_here(r)
            self._cond.notify_all()
        for r in dropped:  # each reported whatever the others do: a handle no one resolves would hang wait()
            try:
                self.on_slot_released(r.source, r.slot, r.step)
            except Exception:  # noqa: BLE001
                log.exception("step %d: releasing its slot after close() failed", r.step)
            for tier in r.due:
                try:
                    self.on_tier_done(r.step, tier, False, "the engine closed before this step was drained")
                except Exception:  # noqa: BLE001
                    log.exception("step %d: reporting tier %r after close() failed", r.step, tier)

    def _start(self) -> None:
        self._ready.clear()
        ctx = mp.get_context("spawn")
        if self._requests is not None:  # a dead worker's: its feeder ends
            self._requests.close()
        self._requests, requests, results, worker_results = channels(f"tiered_ckpt-drain-feeder-{self.coords.rank}")
        self._proc = ctx.Process(target=worker_main, name=f"tiered_ckpt-drain-{self.coords.rank}",
                                 args=(self.config, self.coords, self.order, self.local_rank, self.node_ranks,
                                       requests, worker_results, os.getpid(), copy_gate.shared(),
                                       logging.getLogger("tiered_ckpt").getEffectiveLevel()),
                                 daemon=False)
        try:
            with _main_module_hidden(), _sigint_ignored():
                self._proc.start()
        except BaseException:
            self._requests.close()
            results.close()
            raise
        finally:
            close_child_ends(requests, worker_results)  # the worker holds its own duplicates
        if self._slots_ready:
            self._requests.put(MAP_SLOTS)
        self._listener = threading.Thread(target=self._listen, args=(self._proc, results),
                                          name="tiered_ckpt-drain-listener", daemon=True)
        self._listener.start()

    def submit(self, req: DrainRequest) -> None:
        with self._cond:
            if self._closing:  # close() has run or runs: no new worker, nothing queued behind the stop message
                raise DrainClosedError(req.step)
            if self._proc is None or not self._proc.is_alive():
                log.warning("the drain worker is not running; starting a new one")
                self._start()
            if self._stores is not None and not self._ready.is_set():
                self._drain_here(req)
                return
            if self._here_pending or self._held:  # the worker is up: it takes this once the threads are done
                self._held.append(req)
                return
            self._outstanding[(req.step, req.created)] = (req, set(req.due), False, self._proc)
            # Sent under the lock (put never blocks, never raises: worker_channel.py): close() sets _closing under
            # it before its stop message, so a request goes ahead of that message or is refused above.
            self._requests.put(req)

    def slots_ready(self) -> None:
        """Tell the worker to map the slots now (it does so on a thread of its own, after what is queued); a
        worker started later to replace this one is told at its start."""
        with self._cond:
            self._slots_ready = True
            if self._proc is not None and self._proc.is_alive():
                self._requests.put(MAP_SLOTS)

    def worker_note(self) -> str | None:
        proc = self._proc
        pid = proc.pid if proc is not None else None
        state = process_state(pid) if pid is not None else None
        if state in ("T", "t"):
            return (f"the drain worker (process {pid}) is stopped (a SIGSTOP, or a debugger): `kill -CONT {pid}` "
                    "lets it go on; `kill -9` it and the next save starts another")
        if state == "D":
            return (f"the drain worker (process {pid}) is in an uninterruptible wait (a hung filesystem or device "
                    "behind a tier)")
        return None

    def _listen(self, proc: Any, results: Any) -> None:
        try:
            self._relay(proc, results)
        finally:
            results.close()  # the one reader of this worker's results

    def _relay(self, proc: Any, results: Any) -> None:
        while True:
            try:
                msg = results.get(timeout=0.5)
            except queue.Empty:
                if not proc.is_alive():
                    self._worker_died(proc)
                    return
                continue
            except (EOFError, OSError):
                self._worker_died(proc)
                return
            except Exception:  # noqa: BLE001 - a message that cannot be unpickled here: read whole, so the next
                log.exception("a message from the drain worker could not be read; it is dropped")  # one is sound
                continue
            kind = msg[0]
            if kind == "ready":
                if proc is self._proc:
                    self._ready.set()
            elif kind == "event":
                self.emit(msg[1])
            elif kind == "log":  # the worker's record, handled by this process's loggers and handlers
                record = msg[1]
                logging.getLogger(record.name).handle(record)
            elif kind == "tier_done":
                _, step, tier, ok, err = msg
                with self._cond:  # the oldest request of that step still due there (each tier keeps order)
                    for (s, _), (_req, left, _rel, owner) in self._outstanding.items():
                        if s == step and tier in left and owner is proc:
                            left.discard(tier)
                            break
                self.on_tier_done(step, tier, ok, err)
            elif kind == "slot_released":
                _, tier, slot, step = msg
                with self._cond:
                    for key, (req, left, _rel, owner) in list(self._outstanding.items()):
                        if req.step == step and req.slot == slot and owner is proc:
                            self._outstanding[key] = (req, left, True, owner)
                self.on_slot_released(tier, slot, step)
            elif kind == "job_done":
                with self._cond:
                    entry = self._outstanding.get((msg[1], msg[2]))
                    if entry is not None and entry[3] is proc:
                        del self._outstanding[(msg[1], msg[2])]
                    self._cond.notify_all()
            elif kind == "fatal":
                log.error("the drain worker could not start: %s", msg[1])
                self._worker_died(proc, msg[1])
                return
            elif kind == "closed":  # it reported every request it took first: any still here came too late
                with self._cond:
                    left = any(owner is proc for _r, _l, _rel, owner in self._outstanding.values())
                if left:
                    self._worker_died(proc, "the drain worker stopped before it took this step")
                return

    def _worker_died(self, proc: Any, why: str | None = None) -> None:
        if proc.is_alive():  # it said it failed, or its pipe broke: nothing of it may read a slot from now on
            proc.kill()
        proc.join(STOP_GRACE_S)
        reason = why or f"the drain worker exited (code {proc.exitcode})"
        with self._cond:
            if proc is self._proc:
                self._ready.clear()
            lost = [(k, v) for k, v in self._outstanding.items() if v[3] is proc]  # its replacement's stay
        if lost and not self._closing:
            log.error("%s with %d drains pending; those not committed are reported failed (the shm snapshot stays "
                      "loadable)", reason, len(lost))
        try:
            # Reported before the requests leave _outstanding: wait_idle() must not return (and engine.wait()
            # find no failure) while a dead worker's steps are still being looked up.
            for _, (req, left, released, _owner) in lost:
                if not released:  # the worker is dead: nothing reads the slot for this request any more (freed
                    self.on_slot_released(req.source, req.slot, req.step)  # before the handle resolves: drain.py)
                for tier in req.due:
                    if tier in left:
                        ok = self._committed(tier, req)
                        self.on_tier_done(req.step, tier, ok, None if ok else reason)
        finally:
            with self._cond:
                for key, _ in lost:
                    self._outstanding.pop(key, None)
                self._cond.notify_all()

    def _committed(self, tier: str, req: DrainRequest) -> bool:
        """Whether ``tier`` committed this save of ``req.step`` (a worker killed between its commit and its
        report); a commit of another save of the step (one this save was to replace) is not this save's."""
        store = self._all_stores.get(tier)
        files = store.files() if store is not None else None
        if files is None:
            return False
        try:
            manifest = files.read_manifest(req.step)
        except BlobNotFoundError:
            return False
        except Exception as exc:  # cannot tell: reported failed, which is what a reader must assume
            log.warning("tier %r: cannot tell whether it committed step %d after the drain worker died: %s", tier,
                        req.step, exc)
            return False
        return not req.save_id or manifest.extra.get(SAVE_KEY) == req.save_id

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._local is not None and not self._local.wait_idle(timeout):
            return False
        with self._cond:
            while self._outstanding or self._held:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def close(self, timeout: float | None = None) -> bool:
        idle = self.wait_idle(timeout)
        with self._cond:  # submit() checks it under the lock
            self._closing = True
        if self._local is not None:
            self._local.close(None if idle else 0)
        self._stop(STOP_GRACE_S if idle else 0.0)
        _drains.discard(self)
        return idle

    def _stop(self, grace: float) -> None:
        """Stop the worker in bounded time: the stop message, ``grace`` to exit, then SIGKILL (which ends a
        stopped process too, unlike SIGTERM). What it had not committed stays in shm for recovery."""
        try:
            self._stop_worker(grace)
        finally:
            if self._requests is not None:  # its feeder sends what is queued (the stop message), then ends
                self._requests.close()

    def _stop_worker(self, grace: float) -> None:
        proc = self._proc
        if proc is None or not proc.is_alive():
            return
        with self._cond:
            unused = not self._ready.is_set() and not self._outstanding and not self._held
        if unused:  # still starting and never given anything: no need to wait for its start-up
            grace = 0.0
        with contextlib.suppress(Exception):
            self._requests.put(None)
        proc.join(grace)
        if proc.is_alive():
            if grace > 0:
                log.warning("the drain worker (process %d) did not exit within %.0f s; it is killed", proc.pid, grace)
            proc.kill()
            proc.join(STOP_GRACE_S)


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``/proc/PID/stat``: R, S, D, T, Z, ...), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@atexit.register
def _stop_workers() -> None:
    # Before multiprocessing's own exit handler (registered earlier, run later), which joins every child with
    # no timeout: a worker still here (its engine never closed) is stopped in bounded time.
    for drain in list(_drains):
        with contextlib.suppress(Exception):
            drain._closing = True
            drain._stop(STOP_GRACE_S)


class SplitDrain:
    """In-process memory tiers (gpu) hop to shm in threads here; the worker drains shm onwards."""

    def __init__(self, pipeline: Pipeline, shared: int, on_tier_done: OnTierDone, on_slot_released: OnSlotReleased):
        order = pipeline.order
        self.near_names = order[:shared + 1]
        self.shared = order[shared]
        self.on_tier_done = on_tier_done
        self._rest: dict[tuple[int, float], tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self.local = DrainRuntime({n: pipeline.stores[n] for n in self.near_names}, self.near_names,
                                  pipeline.coords, pipeline.emit, on_tier_done, on_slot_released,
                                  on_job_done=self._forward, **pipeline.drain_options())
        self.proc = ProcessDrain(pipeline.config, pipeline.coords, order[shared:], pipeline.local_rank,
                                 pipeline.node_ranks, pipeline.emit, on_tier_done, self._far_slot_released,
                                 stores={n: pipeline.stores[n] for n in order[shared:]})

    def submit(self, req: DrainRequest) -> None:
        near = tuple(t for t in req.due if t in self.near_names)
        rest = tuple(t for t in req.due if t not in self.near_names)
        with self._lock:
            self._rest[(req.step, req.created)] = rest
        try:
            self.local.submit(replace(req, due=near))
        except BaseException:  # refused (the drain is closing): nothing will forward it
            with self._lock:
                self._rest.pop((req.step, req.created), None)
            raise

    def _forward(self, req: DrainRequest, results: dict[str, bool], slots: dict[str, int]) -> None:
        with self._lock:
            rest = self._rest.pop((req.step, req.created), ())
        if not rest:
            return
        why = f"the snapshot never reached tier {self.shared!r}"
        if results.get(self.shared):
            self.local.pin(self.shared, req.step)  # released when the worker is done reading it
            try:
                self.proc.submit(replace(req, source=self.shared, slot=slots[self.shared], due=rest))
                return
            except Exception as exc:  # no worker to hand it to: those tiers failed the step, said so, never hung
                self.local.unpin(self.shared, req.step)
                log.exception("step %d: could not hand the snapshot on tier %r to the drain worker",
                              req.step, self.shared)
                why = f"the drain worker could not take it: {type(exc).__name__}: {exc}"
        for tier in rest:
            self.on_tier_done(req.step, tier, False, why)

    def _far_slot_released(self, tier: str, slot: int, step: int) -> None:
        if tier == self.shared:
            self.local.unpin(tier, step)

    def slots_ready(self) -> None:
        self.proc.slots_ready()  # the worker's source is the shared tier; the threads here read their own buffers

    def worker_note(self) -> str | None:
        return self.proc.worker_note()

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.local.wait_idle(timeout):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.proc.wait_idle(left)

    def close(self, timeout: float | None = None) -> bool:
        idle = self.wait_idle(timeout)
        self.local.close(0 if not idle else None)
        return self.proc.close(0 if not idle else None) and idle
