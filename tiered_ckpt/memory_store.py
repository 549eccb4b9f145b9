"""Snapshot slots on a memory tier (gpu, shm): what a save copies into, and what a restart finds again.

Per rank, slot ``i`` is two blobs: ``rank_RRRRR/slot_i.data`` (every item's tensor bytes, each item's region
64-byte aligned) and ``rank_RRRRR/slot_i.json`` (the step, each item's flat header and region, checksums once
the drain has computed them). The JSON is written last and deleted first: a slot without it holds nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .codecs import flat
from .codecs.file_codecs import ItemSource
from .crashpoints import crash_point
from .errors import BlobNotFoundError, CorruptionError, DecodeError, EncodeError
from .hostmem import private_copy
from .manifest import content_digest
from .tiers.base import IO_BLOCK, Tier

log = logging.getLogger(__name__)

FORMAT = "tiered_ckpt.snapshot"
VERSION = 1
ALIGN = 64
ITEM_ALIGN = IO_BLOCK  # where items start in a slot


@dataclass
class SlotItem:
    name: str
    offset: int
    nbytes: int
    header: str  # the flat codec's JSON header, as text
    checksum: str | None = None  # of the item's data region, filled in by the drain


@dataclass
class SlotMeta:
    step: int
    rank: int
    slot: int
    items: list[SlotItem]
    total_bytes: int
    layout: str = ""
    coords: dict[str, int] = field(default_factory=dict)
    parallel: dict[str, Any] = field(default_factory=dict)
    run_id: str = "default"
    created: float = field(default_factory=time.time)
    persistent: bool = True  # False: a non-persistent save (memory tiers only, never drained to a file tier)

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return json.dumps({**doc, "digest": content_digest(doc)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, tier: str) -> SlotMeta:
        try:
            d = json.loads(bytes(data).decode())
            if "digest" in d and d.pop("digest") != content_digest(d):  # its headers are not in the checksums
                raise ValueError("the record does not match its digest: it changed after it was written")
            if d.pop("format") != FORMAT or d.pop("version") != VERSION:
                raise ValueError("unknown format or version")
            d["items"] = [SlotItem(**it) for it in d["items"]]
            meta = cls(**d)
            if meta.step < 0 or any(it.offset < 0 or it.nbytes < 0 or it.offset + it.nbytes > meta.total_bytes
                                    for it in meta.items):
                raise ValueError("step or item region out of range")
            return meta
        except Exception as exc:  # any malformation means: this slot holds nothing usable
            raise CorruptionError(f"malformed snapshot record: {exc}", tier=tier, key=where) from None


def plan_items(items: dict[str, Any]) -> tuple[list[tuple[str, flat.SnapshotPlan, int]], int]:
    """Plan each item and place it in the slot: [(name, plan, offset)], total bytes."""
    placed, end = [], 0
    for name, value in items.items():
        try:
            plan = flat.plan_snapshot(value)
        except EncodeError as exc:
            raise EncodeError(exc.detail, path=exc.path or "", item=name) from None
        # Items start on a page boundary, so a file tier can write each one's bytes with O_DIRECT, no copy.
        offset = end + (-end) % ITEM_ALIGN
        placed.append((name, plan, offset))
        end = offset + plan.total_bytes
    return placed, end + (-end) % ALIGN


class MemoryStore:
    """The slots of one rank on one memory tier."""

    def __init__(self, tier: Tier, rank: int, nslots: int):
        self.tier = tier
        self.rank = rank
        self.nslots = nslots
        self._buffers: dict[int, torch.Tensor] = {}
        self._read_cache: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._reported: set[str] = set()  # malformed slot records already logged

    @property
    def name(self) -> str:
        return self.tier.name

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
        self.tier.delete(self.meta_key(slot))

    def publish(self, meta: SlotMeta) -> None:
        crash_point("memory.publish")
        self.tier.publish(self.meta_key(meta.slot), meta.to_json())

    def remove_temp_files(self) -> list[str]:
        """Temporary files in this rank's slot directory: slot records a killed process was writing. Only for the
        engine starting with this run's lock for this rank (nothing else writes there then); returns them."""
        files = getattr(self.tier, "files", None)
        if files is None or not hasattr(files, "temp_files"):
            return []
        prefix = f"rank_{self.rank:05d}/"
        gone = [rel for rel in files.temp_files() if rel.startswith(prefix)]
        for rel in gone:
            files.remove_temp_file(rel)
        return gone

    def release_slots(self, durable: set[int]) -> list[int]:
        """Delete this rank's slots (record first, then data) except those holding a step not in ``durable``;
        return the steps kept. Slots without a record hold nothing and go too, and so do non-persistent
        snapshots older than the newest durable step (superseded: no load would pick them)."""
        metas = self.metas()
        newest = max(durable, default=-1)

        def keep(m: SlotMeta) -> bool:
            return m.step not in durable and (m.persistent or m.step > newest)

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
            self.tier.delete(self.meta_key(slot))  # the record first: never a record without its data
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
        return SlotMeta.from_json(data, self.meta_key(slot), self.tier.name)

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
        zero-copy views (copy-on-write keeps the slot intact, but a kept mapping would show their changes)."""
        buf = self._buffers.get(meta.slot)
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
        ident = self.tier.blob_identity(key)
        cached = self._read_cache.get(slot)
        if ident is not None and cached is not None and cached[0] == ident:
            return cached[1]
        buf = self.tier.read_blob(key)
        if ident is not None:
            self._read_cache[slot] = (ident, buf)
        return buf

    def item_sources(self, meta: SlotMeta, *, cached: bool = True) -> list[ItemSource]:
        buf = self.data(meta, cached=cached)
        return [ItemSource(it.name, it.header.encode(), buf[it.offset:it.offset + it.nbytes]) for it in meta.items]

    def load(self, meta: SlotMeta, *, copy: bool, map_location: Any = None, verify: bool = True,
             into: dict[str, Any] | None = None, only: set[str] | None = None) -> dict[str, Any]:
        """The snapshot's items (those named in ``only``, if given). ``into``: restore the tensors it holds in
        place (see :mod:`.load_into`)."""
        from .checksum import snapshot_matches

        out = {}
        # Views handed to the caller need a mapping of their own (see ``data``); a load into the caller's tensors
        # with copies of the rest hands out none, and the kept mapping spares populating a new one.
        cached = into is not None and copy
        for src, it in zip(self.item_sources(meta, cached=cached), meta.items, strict=True):
            if only is not None and it.name not in only:
                continue
            target = into.get(it.name) if into is not None else None
            if target is not None:
                out[it.name] = self._load_into(meta, src, it, target, copy=copy, verify=verify)
                continue
            if verify and it.checksum:
                if not snapshot_matches(src.data, it.checksum):
                    raise self._mismatch(meta, it)
            try:
                info = flat.decode_header(src.header)
                data = src.data
                if copy and data.device.type == "cpu" and map_location is None:
                    # One populated buffer and one memcpy, then views into our own copy.
                    data, copy = private_copy(data), False
                out[it.name] = flat.restore(info, data, copy=copy, map_location=map_location)
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
