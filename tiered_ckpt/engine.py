"""The engine: one per rank. ``save`` blocks only for a memory-speed copy; ``load`` returns the newest verified step.

Where does a save block? :meth:`CheckpointEngine.save` — planning the items, waiting for a free slot (policy
``wait``), and copying into it. Everything after (encode, checksum, write, commit, retention) is the drain's.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any

import torch

from . import events as ev
from .codecs import flat
from .config import Config, TierConfig, load_config
from .crashpoints import crash_point
from .distributed import Coordinator
from .drain import DrainRequest
from .errors import (
    CorruptionError,
    DecodeError,
    LayoutMismatchError,
    NoCheckpointError,
    TieredCkptError,
    TierError,
    TierUnavailableError,
)
from .file_store import FileStore
from .handles import LoadResult, SaveHandle, SavesFailedError
from .layouts.base import MODEL_ITEM, OPTIM_ITEM
from .load_into import apply_into, check_into_names, tensors
from .locking import RunLock, shm_paths
from .memory_store import MemoryStore, SlotItem, SlotMeta, plan_items
from .parallel import ParallelLayout, RankCoords, detect, local_rank
from .pipeline import STAGING, Pipeline, build_pipeline
from .plugins import PluginManager, get_plugin_manager

log = logging.getLogger(__name__)
_live: weakref.WeakSet[CheckpointEngine] = weakref.WeakSet()


class CheckpointEngine:
    """Tiered checkpointing for one rank. See docs/architecture.md."""

    def __init__(self, config: Any, parallel: ParallelLayout | RankCoords | None = None, *,
                 rank: int | None = None, plugin_manager: PluginManager | None = None,
                 observers: Any = ()):
        self.pm = plugin_manager or get_plugin_manager()
        self.config: Config = load_config(config, registries=self.pm.registries)
        # plugins.py: this engine's own observers and run_id on its events; a plugin the drain worker could not
        # rebuild is a PluginError here, not a failed save.
        self.events = self.pm.for_engine(self.config, observers)
        self.coords = detect(parallel, rank)
        self._lock = RunLock(self.config.run_id, self.coords.rank, shm_paths(self.config))  # beside the slots
        self._lock.acquire()
        try:
            self.coordinator = Coordinator.create(self.coords)
            self.pipeline: Pipeline = build_pipeline(self.config, self.pm, self.coords, local_rank(), self._emit,
                                                     self.coordinator.node_ranks)
        except BaseException:
            self._detach()
            raise
        self._closed = False
        self._ordinal = 0
        self._handles: dict[int, list[SaveHandle]] = {}  # per step, oldest first: a step may be saved twice
        self._failures: dict[int, dict[str, str]] = {}  # since the last engine.wait(): step → tier → why
        self._fingerprints: tuple[str, ...] | None = None
        self._cond = threading.Condition()
        entry = self.pipeline.entry_store
        self._slot_step: dict[int, int] = {s: m.step for s, m in entry.metas().items()} if self._entry_persists else {}
        self._slot_busy: set[int] = set()
        self.recovered: list[SaveHandle] = []
        for store in self.pipeline.stores.values():
            if isinstance(store, MemoryStore) and store.tier.capabilities.survives_process:
                for rel in store.remove_temp_files():  # before the drain starts: no writer of ours is there yet
                    log.info("tier %r: removed %s, left by a killed process", store.name, rel)
        self._drain = self.pipeline.start_drain(self._tier_done, self._slot_released)
        _live.add(self)
        self._recover()

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
            if not ok:
                self._failures.setdefault(step, {})[tier] = error or "failed"
            handles = self._handles.get(step, [])
            handle = next((h for h in handles if tier in h.due and not h.done(tier)), None)
            if handle is not None:
                handle._resolve(tier, ok, error)
            handles[:] = [h for h in handles if not h.done()]
            if not handles:
                self._handles.pop(step, None)

    def _slot_released(self, tier: str, slot: int, step: int) -> None:
        if tier != self.pipeline.entry:
            return
        with self._cond:
            self._slot_busy.discard(slot)
            self._cond.notify_all()

    # ----- saving ------------------------------------------------------------------------------------------
    def prepare(self, template: dict[str, Any]) -> None:
        """Allocate and pre-fault every slot for items shaped like ``template``, so even the first save is fast."""
        _, total = plan_items(template)
        store = self.pipeline.entry_store
        for slot in range(store.nslots):
            store.buffer(slot, total)
        self.pipeline.prepare_memory_tiers(total)

    def _acquire_slot(self, step: int) -> tuple[int | None, float]:
        store = self.pipeline.entry_store
        policy = self.pipeline.entry_cfg.when_full
        t0 = time.perf_counter()
        waited = False
        with self._cond:
            while True:
                free = [s for s in range(store.nslots) if s not in self._slot_busy]
                if free:
                    # An empty slot first, then the one holding the oldest step.
                    slot = min(free, key=lambda s: (s in self._slot_step, self._slot_step.get(s, -1)))
                    self._slot_busy.add(slot)
                    break
                if policy == "skip":
                    self._emit(ev.Event(ev.SKIP, step=step, rank=self.coords.rank, tier=self.pipeline.entry,
                                        message="every slot is still draining; save skipped (when_full: skip)"))
                    return None, 0.0
                if not waited:
                    waited = True
                    log.info("step %d waits for a free slot on tier %r", step, self.pipeline.entry)
                self._cond.wait(0.5)
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
        if not isinstance(items, dict) or not items or not all(isinstance(k, str) and k for k in items):
            raise ValueError("items must be a non-empty dict of item name (str) → state")
        if all(isinstance(v, torch.Tensor) for v in items.values()):
            names = ", ".join(repr(k) for k in list(items)[:3]) + (", ..." if len(items) > 3 else "")
            raise ValueError(f"save({step}, items): every value of items is a tensor ({names}): this looks like one "
                             "state dict given as the items, which would store each tensor as an item of its own. "
                             f"Name it: save({step}, {{\"model\": model.state_dict()}})")
        t0 = time.perf_counter()
        placed, total = plan_items(items)
        fingerprints = tuple(p.fingerprint for _, p, _ in placed)
        if self._fingerprints is not None and fingerprints != self._fingerprints:
            self._emit(ev.Event(ev.REPLAN, step=step, rank=self.coords.rank, tier=self.pipeline.entry, nbytes=total,
                                message="the items' structure changed; the snapshot layout was re-planned"))
        self._fingerprints = fingerprints
        if persistent:
            self._ordinal += 1
            due = self.pipeline.due_tiers(self._ordinal)
        else:
            due = tuple(n for n in self.pipeline.order[1:] if isinstance(self.pipeline.stores[n], MemoryStore))
        slot, _ = self._acquire_slot(step)
        if slot is None:
            return SaveHandle(step, time.perf_counter() - t0, self.pipeline.entry, (), skipped=True)
        store = self.pipeline.entry_store
        try:
            store.invalidate(slot)  # the slot's old step is gone from here on
            crash_point("save.invalidated")
            self._slot_step.pop(slot, None)
            buf = store.buffer(slot, total)
            for _, plan, offset in placed:
                flat.copy_into(plan, buf[offset:offset + plan.total_bytes])
                crash_point("save.item_copied")
            meta = SlotMeta(step=step, rank=self.coords.rank, slot=slot, total_bytes=total,
                            items=[SlotItem(name, off, p.total_bytes, flat.encode_header(p).decode())
                                   for name, p, off in placed],
                            layout=self.config.layout, coords=self.coords.to_dict(),
                            parallel=self.coords.layout.to_dict(), run_id=self.config.run_id,
                            persistent=persistent)
            crash_point("save.before_publish")
            store.publish(meta)
        except BaseException:
            with self._cond:
                self._slot_busy.discard(slot)
                self._cond.notify_all()
            raise
        blocking = time.perf_counter() - t0
        self._slot_step[slot] = step
        handle = SaveHandle(step, blocking, self.pipeline.entry, due)
        with self._cond:
            self._handles.setdefault(step, []).append(handle)
        self._emit(ev.Event(ev.SNAPSHOT, step=step, rank=self.coords.rank, tier=self.pipeline.entry,
                            seconds=blocking, nbytes=total, detail={"slot": slot, "due": list(due)}))
        self._drain.submit(DrainRequest(step=step, source=self.pipeline.entry, slot=slot, due=due,
                                        created=handle.created))
        return handle

    def _recover(self) -> None:
        """Drain snapshots a previous process left in shared memory to the tiers they never reached."""
        if not self._entry_persists:
            return
        metas = sorted(self.pipeline.entry_store.metas().values(), key=lambda m: m.step)
        if not metas:
            return
        file_stores = self.pipeline.file_stores()
        committed = {name: set(fs.committed_steps()) for name, fs in file_stores.items()}
        for meta in metas:
            if not meta.persistent:
                continue  # saved for memory tiers only (a non-persistent step): no file tier ever takes it
            due = tuple(n for n in self.pipeline.order[1:] if n in file_stores
                        and meta.step not in committed[n] and max(committed[n], default=-1) < meta.step)
            if not due:
                continue
            with self._cond:
                self._slot_busy.add(meta.slot)
            handle = SaveHandle(meta.step, 0.0, self.pipeline.entry, due)
            with self._cond:
                self._handles.setdefault(meta.step, []).append(handle)
            self.recovered.append(handle)
            self._emit(ev.Event(ev.RECOVER, step=meta.step, rank=self.coords.rank, tier=self.pipeline.entry,
                                nbytes=meta.total_bytes, detail={"due": list(due), "slot": meta.slot},
                                message="a snapshot left in memory by an earlier process is drained"))
            self._drain.submit(DrainRequest(step=meta.step, source=self.pipeline.entry, slot=meta.slot, due=due,
                                            created=meta.created, recover=True))

    # ----- loading -----------------------------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        """The configured tiers that are enabled here, fastest first (without internal ones such as the hidden
        ``_staging`` buffers): the keys :meth:`available_steps` has when every tier could be listed."""
        return [n for n in self.pipeline.order if n != STAGING]

    def _list_tiers(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        out: dict[str, list[int]] = {}
        unreachable: dict[str, str] = {}
        for name in self.tiers:
            store = self.pipeline.stores[name]
            try:
                if isinstance(store, MemoryStore):
                    # A snapshot of another parallel layout is another rank's state: never a candidate.
                    here = self.coords.layout.to_dict()
                    out[name] = sorted({m.step for m in store.metas().values() if not m.parallel or all(
                        m.parallel.get(k) == v for k, v in here.items())})
                else:
                    steps = store.steps_for_rank(self.coords)
                    legacy = store.legacy_step() if not steps else None
                    out[name] = [legacy] if legacy is not None else steps
            except (TierError, OSError) as exc:
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
        tier of every rank was looked at and holds nothing; :class:`TierUnavailableError` (not a
        NoCheckpointError) that some tier could not be looked at: do not start from scratch on that one.

        ``into``: item name → state shaped like the one saved (the very dict passed to ``save``, say); its tensors
        receive the checkpoint's values in place, and the result's items hold them (see :mod:`.load_into`). If
        ``load`` raises, those tensors may hold partial data."""
        copy = self.config.load.copy if copy is None else copy
        if into is not None and (not isinstance(into, dict) or not all(isinstance(k, str) for k in into)):
            raise ValueError("into must be a dict of item name (str) → state, like the items given to save()")
        available, unreachable = self._list_tiers()
        for name, why in unreachable.items():
            self._emit(ev.Event(ev.TIER_UNREACHABLE, step=step, rank=self.coords.rank, tier=name, message=why))
        mine = {s for steps in available.values() for s in steps}
        rejected: set[int] = set()
        fallbacks: list[str] = []
        while True:
            chosen = self.coordinator.agree_on_step(mine - rejected, step)
            if chosen is None:
                what = f"step {step}" if step is not None else "a checkpoint"
                detail = f" ({'; '.join(fallbacks)})" if fallbacks else ""
                self._nothing_loadable(unreachable, f"no step that every rank can load: rank {self.coords.rank} "
                                                    f"found no loadable copy of {what} on any tier{detail}")
            result = self._load_step(chosen, available, copy, map_location, fallbacks, into)
            if self.coordinator.all_succeeded(result is not None):
                assert result is not None
                result.unreachable = dict(unreachable)
                if unreachable:
                    log.warning("load: step %d from tier %r without seeing tier(s) %s: a newer step may be there",
                                result.step, result.tier, ", ".join(repr(t) for t in unreachable))
                return result
            # Some rank could not read its part of this step anywhere: everyone moves to an older one together.
            rejected.add(chosen)
            if step is not None:
                self._nothing_loadable(unreachable, f"step {step} cannot be loaded by every rank "
                                                    f"({'; '.join(fallbacks)})")

    def _nothing_loadable(self, unreachable: dict[str, str], message: str) -> None:
        """Raise NoCheckpointError when every rank listed every tier, else TierUnavailableError (collective: every
        rank raises the same one)."""
        if self.coordinator.all_succeeded(not unreachable):
            raise NoCheckpointError(message)
        advice = ("This is not \"no checkpoint\": one may be on a tier that could not be looked at. Make it "
                  "reachable and load again (or set enabled: false on it to resume without it)")
        if unreachable:
            why = "; ".join(f"tier {t!r}: {r}" for t, r in unreachable.items())
            raise TierUnavailableError(f"rank {self.coords.rank} could not list {why}. Nothing loadable on the other "
                                       f"tiers: {message}. {advice}", unreachable)
        raise TierUnavailableError(f"another rank could not list every tier (its log and tier_unreachable events say "
                                   f"which). Nothing loadable on the tiers listed: {message}. {advice}", {})

    def _load_step(self, step: int, available: dict[str, list[int]], copy: bool, map_location: Any,
                   fallbacks: list[str], into: dict[str, Any] | None = None) -> LoadResult | None:
        for name in self.pipeline.order:
            if step not in available.get(name, []):
                continue
            t0 = time.perf_counter()
            try:
                items, verified, nbytes = self._load_from(name, step, copy, map_location, into)
            except (CorruptionError, DecodeError, TierError, OSError) as exc:
                fallbacks.append(f"tier {name!r} step {step}: {exc}")
                self._emit(ev.Event(ev.FALLBACK, step=step, rank=self.coords.rank, tier=name, message=str(exc),
                                    detail={"key": getattr(exc, "key", None)}))
                log.warning("load: tier %r step %d: %s; trying the next tier", name, step, exc)
                continue
            seconds = time.perf_counter() - t0
            self._emit(ev.Event(ev.LOAD, step=step, rank=self.coords.rank, tier=name, seconds=seconds,
                                nbytes=nbytes, detail={"verified": verified}))
            return LoadResult(step, items, name, verified, seconds, nbytes, list(fallbacks))
        return None

    def _layout_change(self, saved: dict[str, Any], step: int, tier: str) -> list[str]:
        """What differs between the checkpoint's parallel layout and this job's ("DP 4 → 2", ...)."""
        current = self.coords.layout.to_dict()
        changed = [f"{dim.upper()} {saved.get(dim, 1)} → {current[dim]}" for dim in ("tp", "pp", "dp", "ep", "cp")
                   if saved.get(dim, 1) != current[dim]]
        if saved.get("world_size", 1) != current["world_size"] and not changed:
            changed.append(f"world size {saved.get('world_size')} → {current['world_size']}")
        return changed

    def _refuse(self, changed: list[str], step: int, tier: str, why: str) -> LayoutMismatchError:
        return LayoutMismatchError(f"step {step} on tier {tier!r} was saved with another parallel layout "
                                   f"({', '.join(changed)}): {why}")

    def _load_from(self, name: str, step: int, copy: bool, map_location: Any,
                   into: dict[str, Any] | None = None) -> tuple[dict, bool, int]:
        if into is not None and not isinstance(self.pipeline.stores[name], MemoryStore):
            # From files: load as usual, then copy into the targets (the fused path is for memory snapshots).
            items, verified, nbytes = self._load_from(name, step, copy, map_location)
            return apply_into(items, into, f"step {step} on tier {name!r}"), verified, nbytes
        store = self.pipeline.stores[name]
        verify = self.config.load.verify
        trust = self.config.load.trust_pickles
        if isinstance(store, MemoryStore):
            metas = [m for m in store.metas().values() if m.step == step]
            if not metas:
                raise TierError(f"step {step} left the slots while loading", tier=name)
            meta = max(metas, key=lambda m: m.created)
            if meta.parallel and self._layout_change(meta.parallel, step, name):
                raise TierError(f"step {step} here is a snapshot of another parallel layout", tier=name)
            if into is not None:
                check_into_names(into, [it.name for it in meta.items], f"step {step} on tier {name!r}")
            items = store.load(meta, copy=copy, map_location=map_location, verify=verify, into=into)
            verified = verify and all(it.checksum for it in meta.items)
            return items, verified, meta.total_bytes
        if not store.tier.exists(store.layout.manifest_key(step)):
            return self._load_megatron(store, step, verify=verify, trust=trust)  # written by Megatron-LM itself
        manifest = store.read_manifest(step, cached=True)
        changed = self._layout_change(manifest.parallel, step, name)
        if changed:
            if any(not c.startswith("DP ") for c in changed):
                raise self._refuse(changed, step, name, "only a DP change can be re-split")
            items_saved = {f.item for f in manifest.files}
            if not items_saved <= {MODEL_ITEM, OPTIM_ITEM}:
                raise self._refuse(changed, step, name, f"items {sorted(items_saved - {MODEL_ITEM, OPTIM_ITEM})} "
                                   "were saved per rank and cannot be re-split (Megatron's items can)")
            return self._load_megatron(store, step, verify=verify, trust=trust)
        items = store.load_rank(manifest, self.coords, verify=verify, copy=copy, map_location=map_location,
                                trust_pickles=trust)
        mine = store.layout.files_for_rank(manifest.files, manifest.parallel, self.coords)
        return items, verify, sum(f.size for f in mine)

    def _load_megatron(self, store: FileStore, step: int, *, verify: bool, trust: bool) -> tuple[dict, bool, int]:
        """Megatron's items for this rank, re-split for this job's DP size where it changed; also reads
        checkpoints Megatron-LM wrote (no manifest: nothing to verify, and the result says so)."""
        from .megatron import legacy

        try:
            items = legacy.load_rank_items(store.tier, step, self.coords, trust_pickles=trust, verify=verify)
        except (LayoutMismatchError, NoCheckpointError) as exc:
            raise TierError(str(exc), tier=store.name) from None
        nbytes = sum(t.numel() * t.element_size() for t in tensors(items))
        return dict(items), bool(items.verified), nbytes

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
        the previous ``wait()``, as ``handle.wait()`` does for its own step. ``progress``: a bar on stderr
        counting the (step, tier) deliveries still due."""
        if progress:
            self._wait_with_bar(timeout)
        elif not self._drain.wait_idle(timeout):
            raise TimeoutError(f"drain still busy after {timeout} s")
        with self._cond:
            failures, self._failures = self._failures, {}
        if failures:
            raise SavesFailedError(failures)

    def _wait_with_bar(self, timeout: float | None) -> None:
        from tqdm import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        total = sum(map(len, self.pending().values()))
        with tqdm(total=total, desc=f"rank {self.coords.rank} drain", unit="delivery", leave=False) as bar:
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
        timeout = self.config.drain.close_timeout_s if timeout is None else timeout
        try:
            if not self._drain.close(timeout):
                log.warning("close(): drains still pending after %.0f s; the shm snapshot stays for recovery",
                            timeout)
            else:
                self._release_memory()
        finally:
            self.pipeline.close()
            self._detach()
            _live.discard(self)

    def _release_memory(self) -> None:
        """``on_close: release``: delete this rank's slots on memory tiers that outlive the process, where a file
        tier committed the step (a slot holding a step nothing else has stays: it is the only copy)."""
        tiers = [n for n in self.tiers if isinstance(self.pipeline.stores[n], MemoryStore)
                 and self.pipeline.cfgs[n].on_close == "release"
                 and self.pipeline.stores[n].tier.capabilities.survives_process]
        if not tiers:
            return
        durable: set[int] = set()
        for fs in self.pipeline.file_stores().values():
            try:
                durable.update(fs.committed_steps())
            except (TierError, OSError) as exc:
                log.warning("close(): cannot list tier %r (%s); slots it may hold stay in memory", fs.name, exc)
        for name in tiers:
            store = self.pipeline.stores[name]
            assert isinstance(store, MemoryStore)
            try:
                kept = store.release_slots(durable)
            except (TierError, OSError) as exc:
                log.warning("close(): tier %r: cannot release its slots: %s", name, exc)
                continue
            if kept:
                log.info("close(): tier %r keeps step(s) %s in memory: no file tier committed them", name,
                         ", ".join(map(str, kept)))

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def tier_config(self, name: str) -> TierConfig:
        return self.config.tier(name)


@atexit.register
def _close_all() -> None:
    # Runs before multiprocessing joins its children, so the drain worker gets its stop message.
    for engine in list(_live):
        try:
            engine.close()
        except Exception:
            log.exception("closing a checkpoint engine at exit failed")
