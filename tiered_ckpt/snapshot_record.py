"""A snapshot's slot record (``rank_RRRRR/slot_i.json``): :class:`SlotMeta` and its items, their JSON form with
its digest and field checks, and which parallel layout a snapshot belongs to (:func:`snapshot_layout_changes`).
The slots themselves, and where the checksums come from: :mod:`tiered_ckpt.memory_store` (docs/architecture.md,
"Snapshot checksums and layouts")."""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import CorruptionError
from .manifest import content_digest, dump_with_digest
from .parallel import RankCoords, layout_changes

UNVERIFIED = "unverified origin"
FORMAT = "tiered_ckpt.snapshot"
VERSION = 1


@dataclass
class SlotItem:
    name: str
    offset: int
    nbytes: int
    header: str  # the flat codec's JSON header, as text
    checksum: str | None = None  # of the item's data region, taken from the slot right after the save's copy


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
    # Where the items' checksums come from: "pending" (being taken after the save's copy), "saved" (taken from
    # the slot right after it), "copied" (taken after a copy from a memory tier above that had none),
    # UNVERIFIED (taken by a restart from a slot whose process died first: they prove nothing about the save),
    # "" (none: a tier that does not outlive the process, or a record of an older version).
    checksums: str = ""
    save_id: str = ""  # the save's identity, alike on every rank (engine._save_id); "" when unknown
    # The tiers below this one that the save was not due on (their ``every``), by name: a restart does not drain
    # the snapshot there. A tier its engine did not have (added since) is not among them: it takes the snapshot.
    skipped: list[str] = field(default_factory=list)

    @property
    def checksummed(self) -> bool:
        if not self.items:  # a rank with nothing of its own to save: its record is final once its checksums are
            return self.checksums not in ("", "pending")
        return all(it.checksum for it in self.items)

    @property
    def verified_origin(self) -> bool:
        """Checksums that show the bytes are the ones saved (not ones a restart took from what it found)."""
        return self.checksummed and self.checksums != UNVERIFIED

    def to_json(self) -> bytes:
        return dump_with_digest({"format": FORMAT, "version": VERSION, **asdict(self)})

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


def undrained_tiers(meta: SlotMeta, committed: Mapping[str, Collection[int]]) -> list[str]:
    """The tiers of ``committed`` (name -> the steps it committed, fastest first) that ``meta``'s snapshot has yet
    to reach: those holding neither its step nor a newer one, except the ones its save skipped
    (:attr:`SlotMeta.skipped`). A tier with a newer step never takes an older one (its retention would have
    removed it anyway)."""
    return [name for name, steps in committed.items()
            if name not in meta.skipped and meta.step not in steps and max(steps, default=-1) < meta.step]


def snapshot_layout_changes(meta: SlotMeta, coords: RankCoords) -> list[str]:
    """What differs between the layout a snapshot was saved with (its rank, coordinates, parallel layout) and
    ``coords``' ("DP 2 → 1", "rank 1 → 0"); empty when the snapshot is this rank's state at this layout. A record
    without a layout (written before layouts were recorded) is taken as this rank's."""
    changed = layout_changes(meta.parallel, coords.layout) if meta.parallel else []
    if meta.rank != coords.rank:
        changed.append(f"rank {meta.rank} → {coords.rank}")
    here = coords.to_dict()
    changed += [f"{k} coordinate {meta.coords[k]} → {here[k]}" for k in sorted(here)
                if k != "rank" and k in meta.coords and meta.coords[k] != here[k]]
    return changed
