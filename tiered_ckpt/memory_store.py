"""Snapshot slots on a memory tier (gpu, shm): what a save copies into, and what a restart finds again.

Per rank, slot ``i`` is two blobs: ``rank_RRRRR/slot_i.data`` (every item's tensor bytes, each item's region
64-byte aligned) and ``rank_RRRRR/slot_i.json`` (the step, each item's flat header and region, its checksums).
The JSON is written last and deleted first: a slot without it holds nothing.

Checksums are born with the data (docs/architecture.md, "Snapshot checksums and layouts"): on a tier that outlives the
process, each item is hashed from the slot right after the save's copy, on a background thread (the save
returns after the copy), and the record is published again with them (``checksums: "saved"``). The drain waits
for them, and checks the slot against them while it writes a file tier: damage in memory after the save is
never stamped verified. A record still ``"pending"`` after its writer died has no trustworthy checksums: it is
never recovered to a file tier and loads as unverified.

:class:`MemoryStore` implements the :class:`~tiered_ckpt.store.Store` protocol (docs/architecture.md); which slot
a save or a memory-to-memory hop writes into is chosen here (:meth:`MemoryStore.acquire_slot`). The slot record
itself (:class:`SlotMeta`, its JSON form, :func:`snapshot_layout_changes`) is in :mod:`tiered_ckpt.snapshot_record`.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from . import copy_gate, snapshot_hash
from .checksum import LazyPool, snapshot_checksum
from .codecs import flat
from .codecs.file_codecs import ItemSource
from .crashpoints import crash_point
from .errors import BlobNotFoundError, CorruptionError, DecodeError, EncodeError, TierError
from .parallel import RankCoords
from .snapshot_record import UNVERIFIED, SlotItem, SlotMeta, snapshot_layout_changes
from .store import Store, Written
from .tiers.base import IO_BLOCK, Tier

if TYPE_CHECKING:
    from .config import TierConfig

log = logging.getLogger(__name__)

ALIGN = 64
ITEM_ALIGN = IO_BLOCK  # where items start in a slot: a multiple of flat.PLACEMENT_MODULUS, so placements hold


# The thread that takes snapshots' checksums after their copy (it fans the pieces out to the hash pool).
_born_pool = LazyPool(1, "tiered_ckpt-snapshot-checksums").get


#: ``(item name, value) -> {id(tensor): offset modulo a page}`` or None: where a layout wants tensors of an item
#: to sit in the slot (:func:`~tiered_ckpt.codecs.flat.plan_snapshot`'s ``placement``; ``Layout.placement``).
ItemPlacement = Callable[[str, Any], Mapping[int, int] | None]


def plan_items(items: dict[str, Any], memos: dict[str, flat.PlanMemo] | None = None,
               placement: ItemPlacement | None = None) -> tuple[list[tuple[str, flat.SnapshotPlan, int]], int]:
    """Plan each item and place it in the slot: [(name, plan, offset)], total bytes. ``memos``: each item's
    last plan's ``memo`` (what planning it again may reuse). ``placement``: asked about an item only when its
    plan places a tensor anew."""
    placed, end = [], 0
    for name, value in items.items():
        ask = None if placement is None else functools.partial(placement, name, value)
        try:
            plan = flat.plan_snapshot(value, previous=memos.get(name) if memos else None, placement=ask)
        except EncodeError as exc:
            raise EncodeError(exc.detail, path=exc.path or "", item=name) from None
        # Items start on a page boundary, so a file tier can write each one's bytes with O_DIRECT, no copy.
        offset = end + (-end) % ITEM_ALIGN
        placed.append((name, plan, offset))
        end = offset + plan.total_bytes
    return placed, end + (-end) % ALIGN


class MemoryStore:
    """The slots of one rank on one memory tier. ``cfg``: the tier's configuration (its ``on_close``); readers'
    views of other ranks' slots have none."""

    durable = False  # a snapshot lives as long as the machine's memory

    def __init__(self, tier: Tier, rank: int, nslots: int, cfg: TierConfig | None = None):
        self.tier = tier
        self.rank = rank
        self.nslots = nslots
        self.cfg = cfg
        self._buffers: dict[int, torch.Tensor] = {}
        self._read_cache: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._map_locks: dict[int, threading.Lock] = {}  # one mapping per slot file, whichever thread asks first
        self._reported: set[str] = set()  # malformed slot records already logged
        self._parsed: dict[int, tuple[bytes, SlotMeta]] = {}  # slot -> its record's bytes and what they say
        # Slot allocation: which step each slot holds (read from the records on first use: a restart finds the
        # slots of the process before it), and the slots a writer or the drain still holds.
        self._slot_cond = threading.Condition()
        self._slot_step: dict[int, int] | None = None
        self._held: set[int] = set()
        self._hashing: dict[int, Future] = {}  # slot -> the checksums being taken after its save's copy
        self._stop_hashing: dict[int, threading.Event] = {}  # slot -> set when its snapshot is overwritten

    @property
    def name(self) -> str:
        return self.tier.name

    # ----- the Store protocol ------------------------------------------------------------------------------
    def slots(self) -> MemoryStore:
        return self

    def files(self) -> None:
        return None

    def for_rank(self, rank: int) -> MemoryStore:
        return self if rank == self.rank else MemoryStore(self.tier, rank, self.nslots)

    def clean_start(self) -> list[str]:
        return self.remove_temp_files() if self.tier.capabilities.survives_process else []

    def prepare(self, nbytes: int) -> None:
        for slot in range(self.nslots):
            self.buffer(slot, nbytes)

    def due(self, ordinal: int, persistent: bool) -> bool:
        return True  # memory tiers take every save, persistent or not

    def durable_steps(self) -> list[int]:
        return []

    def release_on_close(self, durable: Callable[[], set[int]]) -> list[int] | None:
        if self.cfg is None or self.cfg.on_close != "release" or not self.tier.capabilities.survives_process:
            return None
        return self.release_slots(durable())

    def close(self) -> None:
        for slot in list(self._hashing):
            self.settle_hash(slot)  # a record left for a restart carries its checksums
        self.tier.close()

    def loadable_steps(self, coords: RankCoords) -> list[int]:
        # A snapshot of another parallel layout is another rank's state: never a candidate.
        return sorted({m.step for m in self.metas().values() if not snapshot_layout_changes(m, coords)})

    def read_step(self, step: int, coords: RankCoords, *, copy: bool, map_location: Any, verify: bool,
                  trust_pickles: bool, into: dict[str, Any] | None) -> tuple[dict[str, Any], bool, int]:
        from .load_into import check_into_names

        metas = [m for m in self.metas().values() if m.step == step]
        if not metas:
            raise TierError(f"step {step} left the slots while loading", tier=self.name)
        meta = max(metas, key=lambda m: m.created)
        changed = snapshot_layout_changes(meta, coords)
        if changed:
            raise TierError(f"step {step} in slot {meta.slot} is a snapshot of another parallel layout "
                            f"({', '.join(changed)}): not this rank's state", tier=self.name,
                            key=self.meta_key(meta.slot))
        if into is not None:
            check_into_names(into, [it.name for it in meta.items], f"step {step} on tier {self.name!r}")
        if meta.checksums == "pending" and meta.slot in self._hashing:
            meta = self.settle_hash(meta.slot) or meta  # taken by this process: in within a copy's time
        items = self.load(meta, copy=copy, map_location=map_location, verify=verify, into=into)
        return items, verify and meta.verified_origin, meta.total_bytes

    def write_step(self, step: int, coords: RankCoords, source: Store, *, slot: int | None,
                   pinned: Callable[[int], bool], hasher: Executor, node_ranks: list[int] | None = None,
                   wait_s: float = 0.0) -> Written:
        """Copy a snapshot from the memory tier above (e.g. gpu → shm) into a slot here."""
        src = source.slots()
        if src is None or slot is None:
            raise TierError(f"a memory tier takes snapshots from a memory tier above it; tier {source.name!r} "
                            "holds files: put memory tiers first in the tier list", tier=self.name)
        assert isinstance(src, MemoryStore)
        meta = src.snapshot(step, slot)
        src.check_layout(meta, coords)
        data = src.data(meta)[:meta.total_bytes]
        mine = self.acquire_slot(step, wait=True, pinned=pinned)
        assert mine is not None
        try:
            self.invalidate(mine)
            buf = self.buffer(mine, meta.total_bytes)
            from .cuda_streams import copy_bytes  # CUDA only when a side is on CUDA: on a side stream, event-waited

            copy_bytes(buf[:meta.total_bytes], data, purpose="drain")
            mine_meta = replace(meta, slot=mine, rank=self.rank, items=[replace(it) for it in meta.items])
            # (a hop keeps UNVERIFIED: the status travels with the bytes)
            if self.tier.capabilities.survives_process and not meta.checksummed:
                # the tier above (gpu) took none: this copy is where they are born, before anything reads it
                for it in mine_meta.items:
                    it.checksum = snapshot_checksum(buf[it.offset:it.offset + it.nbytes])
                mine_meta.checksums = "copied"
            self.publish(mine_meta)
        finally:
            self.release_slot(mine)
        return Written(step, meta.total_bytes, slot=mine)

    def commit(self, written: Written, coords: RankCoords, *, node_ranks: list[int], wait_s: float,
               pinned: Callable[[], set[int]], on_committed: Callable[[int], None], fail_fast: bool = False
               ) -> None:
        on_committed(written.nbytes)  # the published slot record is the commit; old slots are reused, not evicted

    def write_failed(self, step: int, coords: RankCoords, *, node_ranks: list[int], save_id: str,
                     reason: str) -> None:
        pass  # each rank's slots are its own: no other rank waits for them

    def retain(self, coords: RankCoords, *, node_ranks: list[int], pinned: Callable[[], set[int]]
               ) -> list[Callable[[], None]]:
        return []  # slots are reused, never evicted

    # ----- slot allocation ---------------------------------------------------------------------------------
    def acquire_slot(self, step: int, *, wait: bool, pinned: Callable[[int], bool] | None = None,
                     on_wait: Callable[[], None] | None = None) -> int | None:
        """See :meth:`tiered_ckpt.store.SnapshotStore.acquire_slot`. A slot holding ``step`` itself may be
        reused even when pinned (the same step saved again)."""
        with self._slot_cond:
            if self._slot_step is None:
                self._slot_step = {s: m.step for s, m in self.metas().items()}
            while True:
                held = self._slot_step
                free = [s for s in range(self.nslots) if s not in self._held and (
                    s not in held or pinned is None or held[s] == step or not pinned(held[s]))]
                if free:
                    # Empty first, then unpinned (the oldest first); a pinned slot of this very step last: a drain
                    # may still be sending views of it (StableChunks), so it is taken only when nothing else is free.
                    slot = min(free, key=lambda s: (s in held, s in held and pinned is not None and pinned(held[s]),
                                                    held.get(s, -1)))
                    self._held.add(slot)
                    return slot
                if not wait:
                    return None
                if on_wait is not None:
                    on_wait()
                # Pins are released by the drain, which does not notify us: look again every half second.
                self._slot_cond.wait(0.5)

    def hold_slot(self, slot: int) -> None:
        with self._slot_cond:
            self._held.add(slot)

    def release_slot(self, slot: int) -> None:
        with self._slot_cond:
            self._held.discard(slot)
            self._slot_cond.notify_all()

    def _slot_holds(self, slot: int, step: int | None) -> None:
        with self._slot_cond:
            if self._slot_step is None:
                return
            if step is None:
                self._slot_step.pop(slot, None)
            else:
                self._slot_step[slot] = step

    def write_snapshot(self, step: int, slot: int, placed: list, total: int, *, coords: RankCoords, layout: str,
                       run_id: str, persistent: bool, save_id: str = "",
                       skipped: Sequence[str] = ()) -> SlotMeta:
        self.invalidate(slot)  # the slot's old step is gone from here on (and its old hashing done)
        crash_point("save.invalidated")
        buf = self.buffer(slot, total)
        with copy_gate.copying(total):  # the drain of earlier steps sleeps meanwhile (copy_gate.py)
            for _, plan, offset in placed:
                flat.copy_into(plan, buf[offset:offset + plan.total_bytes])
                crash_point("save.item_copied")
        meta = SlotMeta(step=step, rank=coords.rank, slot=slot, total_bytes=total,
                        items=[SlotItem(name, off, p.total_bytes, flat.encode_header(p).decode())
                               for name, p, off in placed],
                        layout=layout, coords=coords.to_dict(), parallel=coords.layout.to_dict(), run_id=run_id,
                        persistent=persistent, checksums="pending" if self.tier.capabilities.survives_process else "",
                        save_id=save_id, skipped=list(skipped))
        crash_point("save.before_publish")
        self.publish(meta)
        if meta.checksums == "pending":
            # Off the blocking path, but from the slot right after the copy: what is hashed is what was saved.
            stop = self._stop_hashing[slot] = threading.Event()
            self._hashing[slot] = _born_pool().submit(self._take_checksums, meta, buf, stop)
        return meta

    def _take_checksums(self, meta: SlotMeta, buf: torch.Tensor, stop: threading.Event) -> SlotMeta | None:
        try:
            done = replace(meta, checksums="saved", items=[  # yielding to a later save's copy (snapshot_hash.py)
                replace(it, checksum=snapshot_hash.checksum(buf[it.offset:it.offset + it.nbytes], stop))
                for it in meta.items])
        except snapshot_hash.Stopped:
            return None  # a new save overwrites the slot (invalidate): its record is deleted, not published
        # Nothing else writes this slot meanwhile: a new save or a release first waits for this (settle_hash).
        self.publish(done)
        return done

    def mark_unverified(self, meta: SlotMeta) -> SlotMeta:
        """A restart's record of a snapshot whose process died before its checksums were in: hashed now, so
        later damage is caught, with status UNVERIFIED, so no load of it (or of files drained from it) says
        verified."""
        buf = self.data(meta)
        done = replace(meta, checksums=UNVERIFIED, items=[
            replace(it, checksum=snapshot_checksum(buf[it.offset:it.offset + it.nbytes])) for it in meta.items])
        self.publish(done)
        return done

    def settle_hash(self, slot: int) -> SlotMeta | None:
        """Wait for the checksums of the slot's save, if this process is taking them; the record with them."""
        fut = self._hashing.get(slot)
        if fut is None:
            return None
        try:
            return fut.result()
        except Exception as exc:  # noqa: BLE001 - the record stays "pending": never verified, never recovered
            log.warning("tier %r: checksums of slot %d could not be taken: %s", self.name, slot, exc)
            return None
        finally:
            if self._hashing.get(slot) is fut:  # a caller in another thread may have settled it already
                self._hashing.pop(slot, None)

    def await_checksums(self, meta: SlotMeta, timeout_s: float = 120.0, poll_s: float = 0.01) -> SlotMeta:
        """``meta`` once its save-time checksums are in (taken here or by the saving process, whose record is
        polled); TierError when the slot moved on or they did not arrive in ``timeout_s``."""
        if meta.checksums != "pending":
            return meta
        mine = self.settle_hash(meta.slot)
        if mine is not None and mine.created == meta.created:
            return mine
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.read_meta(meta.slot)
            if current is None or current.step != meta.step or current.created != meta.created:
                raise TierError(f"snapshot of step {meta.step} left slot {meta.slot} before its checksums were in",
                                tier=self.name, key=self.meta_key(meta.slot))
            if current.checksums != "pending":
                return current
            if time.monotonic() >= deadline:
                raise TierError(f"the checksums of step {meta.step} in slot {meta.slot} were not taken within "
                                f"{timeout_s:.0f} s of the save (is the training process alive?): not drained "
                                "unverified", tier=self.name, key=self.meta_key(meta.slot))
            time.sleep(poll_s)

    def check_sources(self, meta: SlotMeta, sources: list[ItemSource]) -> None:
        """CorruptionError naming the item unless every item's bytes still match the checksums taken at save."""
        for src, it in zip(sources, meta.items, strict=True):
            if it.checksum and not snapshot_hash.matches(src.data, it.checksum):  # yields to a save's copy
                raise CorruptionError(f"snapshot of step {meta.step}, item {it.name!r} (rank {meta.rank}) no longer "
                                      "matches the checksum taken when it was saved: the memory copy was damaged "
                                      "after save(); it is not written to any tier. Load an older step",
                                      tier=self.name, key=self.data_key(meta.slot))

    def snapshot(self, step: int, slot: int) -> SlotMeta:
        """The record of ``step`` in ``slot``; TierError when the slot holds another step by now."""
        meta = self.read_meta(slot)
        if meta is None or meta.step != step:
            raise TierError(f"snapshot of step {step} is no longer in slot {slot}", tier=self.name)
        return meta

    def check_layout(self, meta: SlotMeta, coords: RankCoords) -> None:
        """Refuse to drain a snapshot of another layout as this rank's state (an elastic restart's leftovers)."""
        changed = snapshot_layout_changes(meta, coords)
        if changed:
            raise TierError(f"the snapshot of step {meta.step} in slot {meta.slot} was saved with another parallel "
                            f"layout ({', '.join(changed)}): it is not drained as this job's state",
                            tier=self.name, key=self.meta_key(meta.slot))

    def data_key(self, slot: int) -> str:
        return f"rank_{self.rank:05d}/slot_{slot}.data"

    def meta_key(self, slot: int) -> str:
        return f"rank_{self.rank:05d}/slot_{slot}.json"

    # ----- writing -----------------------------------------------------------------------------------------
    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """The slot's writable buffer, allocated (and pre-faulted) once; grown when the items grew.

        The tier is asked every time (it hands back the same memory while it is big enough): that lets it notice
        a slot file replaced behind its back, and page-lock (``pin: auto``) a slot made before CUDA was up."""
        buf = self._buffers[slot] = self.tier.allocate_slot(self.data_key(slot), nbytes)
        return buf

    def invalidate(self, slot: int) -> None:
        # The old snapshot is overwritten now: its checksums, still being taken (saves back to back, with no
        # drain that needed them), are of no use, and the save would wait for them. Called off, then waited for:
        # its hashing thread would publish the old record again.
        stop = self._stop_hashing.pop(slot, None)
        if stop is not None:
            stop.set()
        self.settle_hash(slot)
        self.tier.delete(self.meta_key(slot))
        self._slot_holds(slot, None)

    def publish(self, meta: SlotMeta) -> None:
        crash_point("memory.publish")
        self.tier.publish(self.meta_key(meta.slot), meta.to_json())
        self._slot_holds(meta.slot, meta.step)

    def remove_temp_files(self) -> list[str]:
        """Temporary files in this rank's slot directory: slot records a killed process was writing. Only for the
        engine starting with this run's lock for this rank (nothing else writes there then); returns them."""
        prefix = f"rank_{self.rank:05d}/"
        gone = [rel for rel in self.tier.temp_files() if rel.startswith(prefix)]  # the Tier interface
        for rel in gone:
            self.tier.remove_temp_file(rel)
        return gone

    def release_slots(self, durable: set[int]) -> list[int]:
        """Delete this rank's slots (record first, then data) except those holding a step newer than every step
        in ``durable``; return the steps kept. Slots without a record hold nothing and go too, and so do snapshots
        of steps older than the newest durable step, whether committed and retired since by ``keep`` or never
        committed: superseded, no load would pick them (a trial: with ``keep`` below ``slots`` a committed step,
        retired, stayed in memory for ever)."""
        metas = self.metas()
        newest = max(durable, default=-1)

        def keep(m: SlotMeta) -> bool:
            return m.step not in durable and m.step > newest

        kept = sorted(m.step for m in metas.values() if keep(m))
        slots = set()
        for key in self.tier.list(f"rank_{self.rank:05d}/"):
            name = key.rsplit("/", 1)[-1]
            stem, _, ext = name.partition(".")
            if stem.startswith("slot_") and stem[5:].isdigit() and ext in ("json", "data"):
                slots.add(int(stem[5:]))
        for slot in sorted(slots):
            if slot in metas and keep(metas[slot]):
                continue
            self.settle_hash(slot)
            self.tier.delete(self.meta_key(slot))  # the record first: never a record without its data
            self._slot_holds(slot, None)
            self.tier.delete(self.data_key(slot))
            self._buffers.pop(slot, None)
            self._read_cache.pop(slot, None)
        return kept

    # ----- reading -----------------------------------------------------------------------------------------
    def read_meta(self, slot: int) -> SlotMeta | None:
        try:
            raw = self.tier.read_blob(self.meta_key(slot))
        except BlobNotFoundError:
            return None
        data = bytes(raw.cpu().numpy()) if raw.numel() else b""
        # A load lists the slots and reads them again; the record of thousands of tensors takes tens of ms to
        # parse and check: the same bytes give the same record (a copy: callers may change theirs).
        seen = self._parsed.get(slot)
        if seen is None or seen[0] != data:
            seen = (data, SlotMeta.from_json(data, self.meta_key(slot), self.tier.name))
            self._parsed[slot] = seen
        return copy.deepcopy(seen[1])

    def metas(self) -> dict[int, SlotMeta]:
        """Every slot of this rank holding a complete snapshot (malformed records are skipped)."""
        found = {}
        for key in self.tier.list(f"rank_{self.rank:05d}/"):
            name = key.rsplit("/", 1)[-1]
            if not (name.startswith("slot_") and name.endswith(".json")):
                continue
            try:
                slot = int(name[5:-5])
                meta = self.read_meta(slot)
            except (ValueError, CorruptionError) as exc:
                if key not in self._reported:  # once per record: metas() runs at every load and listing
                    self._reported.add(key)
                    log.warning("tier %r: slot record %s is unreadable and is ignored: %s", self.tier.name, key, exc)
                continue
            if meta is not None:
                found[slot] = meta
        return found

    def data(self, meta: SlotMeta, *, cached: bool = True) -> torch.Tensor:
        """The slot's bytes. ``cached=False`` maps them afresh: what ``load`` hands to users, who may write into
        zero-copy views (copy-on-write keeps the slot intact, but a kept mapping would show their changes, and in
        the saving process its own buffer is the slot itself)."""
        buf = self._buffers.get(meta.slot) if cached else None
        if buf is None or buf.numel() < meta.total_bytes:
            buf = self._mapped(meta.slot) if cached else self.tier.read_blob(self.data_key(meta.slot))
        if buf.numel() < meta.total_bytes:
            raise CorruptionError(f"slot holds {buf.numel()} bytes, its record says {meta.total_bytes}",
                                  tier=self.tier.name, key=self.data_key(meta.slot))
        return buf

    def _mapped(self, slot: int) -> torch.Tensor:
        """A reader's view of a slot written by another process, mapped once while the file stays the same:
        the saver rewrites slots in place, and a shared mapping sees what it writes."""
        key = self.data_key(slot)
        with self._slot_cond:
            lock = self._map_locks.setdefault(slot, threading.Lock())
        with lock:
            ident = self.tier.blob_identity(key)
            cached = self._read_cache.get(slot)
            if ident is not None and cached is not None and cached[0] == ident:
                return cached[1]
            buf = self.tier.read_blob(key)
            if ident is not None:
                self._read_cache[slot] = (ident, buf)
            return buf

    def map_slots(self, before_each: Callable[[], bool] | None = None) -> int:
        """In a process that reads the slots another one writes (the drain worker): map every slot file there is
        now, so that the first drain from each does not pay for it (the page tables of the whole slot, about
        0.1 s per GiB); how many were mapped. Only files with an identity (:meth:`Tier.blob_identity`) are kept
        mapped. ``before_each``: called before each slot; False stops. A slot that cannot be mapped is left to
        the drain that reads it (which reports what is wrong); the others are still mapped."""
        mapped = 0
        for slot in range(self.nslots):
            if before_each is not None and not before_each():
                break
            if slot in self._buffers or self.tier.blob_identity(self.data_key(slot)) is None:
                continue
            try:
                self._mapped(slot)
            except Exception as exc:  # noqa: BLE001 - best effort, see above
                log.debug("tier %r: slot %d not mapped ahead: %s", self.name, slot, exc)
                continue
            mapped += 1
        return mapped

    def item_sources(self, meta: SlotMeta, *, cached: bool = True) -> list[ItemSource]:
        buf = self.data(meta, cached=cached)
        return [ItemSource(it.name, it.header.encode(), buf[it.offset:it.offset + it.nbytes]) for it in meta.items]

    def load(self, meta: SlotMeta, *, copy: bool, map_location: Any = None, verify: bool = True,
             into: dict[str, Any] | None = None, only: set[str] | None = None) -> dict[str, Any]:
        """The snapshot's items (those named in ``only``, if given). ``into``: restore the tensors it holds in
        place (see :mod:`.load_into`)."""
        from .checksum import snapshot_matches
        from .load_into import copy_out, copy_out_verified

        out = {}
        # Views handed to the caller need a mapping of their own (see ``data``): writing into them must never
        # change the snapshot (a user's trial: in the saving process, an optimizer step on tensors from
        # load(copy=False) damaged the checkpoint). With ``copy``, or ``into`` (which copies into the caller's
        # tensors, and copies what has no target there), nothing handed out points into the mapping, and the kept
        # one spares populating a new one.
        cached = copy or into is not None
        for src, it in zip(self.item_sources(meta, cached=cached), meta.items, strict=True):
            if only is not None and it.name not in only:
                continue
            target = into.get(it.name) if into is not None else None
            if target is not None:
                out[it.name] = self._load_into(meta, src, it, target, copy=cached, verify=verify)
                continue
            data, copy_item = src.data, cached
            check = verify and bool(it.checksum)
            if copy_item and data.device.type == "cpu" and map_location is None:
                # One populated buffer, copied on every core and verified as it is copied; views into it after.
                data = copy_out_verified(data, it.checksum) if check else copy_out(data)
                if data is None:
                    raise self._mismatch(meta, it)
                copy_item = False
            elif check and not snapshot_matches(data, it.checksum):
                raise self._mismatch(meta, it)
            try:
                info = flat.decode_header(src.header)
                out[it.name] = flat.restore(info, data, copy=copy_item, map_location=map_location)
            except DecodeError as exc:
                raise CorruptionError(str(exc), tier=self.tier.name, key=self.meta_key(meta.slot)) from None
        return out

    def _load_into(self, meta: SlotMeta, src: ItemSource, it: SlotItem, target: Any, *, copy: bool,
                   verify: bool) -> Any:
        from .load_into import copy_pairs, copy_verified, pair_into

        try:
            views = flat.restore(flat.decode_header(src.header), src.data, copy=False)
        except DecodeError as exc:
            raise CorruptionError(str(exc), tier=self.tier.name, key=self.meta_key(meta.slot)) from None
        # with copy, what has no target gets memory of its own: it would otherwise point into the slot
        result, pairs = pair_into(views, target, f"item {it.name!r}", torch.Tensor.clone if copy else None)
        if verify and it.checksum:
            if not copy_verified(src.data, it.checksum, pairs):
                raise self._mismatch(meta, it)
        else:
            copy_pairs(pairs)
        return result

    def _mismatch(self, meta: SlotMeta, it: SlotItem) -> CorruptionError:
        return CorruptionError(f"snapshot of item {it.name!r} does not match its checksum", tier=self.tier.name,
                               key=self.data_key(meta.slot))
