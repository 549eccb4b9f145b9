"""Reading a committed step of a file tier for one rank: which reader the step needs (docs/architecture.md, "The
data path of a load").

* Our manifest at this job's parallel layout: the rank's own files (``FileStore.load_rank``), verified.
* Our manifest at another DP size: Megatron's items re-split for this rank (``megatron/legacy.py``); any other
  change of layout, or items saved per rank, is refused naming what changed.
* No manifest (Megatron-LM wrote it): Megatron's files, unverified, and the result says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import BlobNotFoundError, CorruptionError, LayoutMismatchError, NoCheckpointError, TierError
from .layouts.base import MODEL_ITEM, OPTIM_ITEM
from .load_into import apply_into, tensors
from .parallel import RankCoords, layout_changes

if TYPE_CHECKING:
    from .file_store import FileStore


def read_committed_step(store: FileStore, step: int, coords: RankCoords, *, copy: bool, map_location: Any,
                        verify: bool, trust_pickles: bool, into: dict[str, Any] | None
                        ) -> tuple[dict[str, Any], bool, int]:
    """``(items, verified, bytes read)`` of ``coords``' part of ``step`` on ``store`` (see the module docstring).
    ``into``: load as usual, then copy into the targets (the fused path is for memory snapshots)."""
    if into is not None:
        items, verified, nbytes = read_committed_step(store, step, coords, copy=copy, map_location=map_location,
                                                      verify=verify, trust_pickles=trust_pickles, into=None)
        return apply_into(items, into, f"step {step} on tier {store.name!r}"), verified, nbytes
    if not store.tier.exists(store.layout.manifest_key(step)):
        return _read_megatron(store, step, coords, verify=verify, trust=trust_pickles)  # written by Megatron-LM
    # Read afresh: this process's cache may hold an earlier commit of a step saved again since (its drain worker
    # commits in another process, another rank may have un-committed it), whose checksums the files no longer match.
    manifest = store.read_manifest(step)
    changed = layout_changes(manifest.parallel, coords.layout)
    if changed:
        if any(not c.startswith("DP ") for c in changed):
            raise _refuse(store, changed, step, "only a DP change can be re-split")
        saved = {f.item for f in manifest.files}
        if not saved:  # every rank saved {}: no Megatron files to re-split (not a damaged Megatron checkpoint)
            raise _refuse(store, changed, step, "no rank saved any item, so there is nothing to re-split")
        if not saved <= {MODEL_ITEM, OPTIM_ITEM}:
            raise _refuse(store, changed, step, f"items {sorted(saved - {MODEL_ITEM, OPTIM_ITEM})} were saved "
                          "per rank and cannot be re-split (Megatron's items can)")
        items, verified, nbytes = _read_megatron(store, step, coords, verify=verify, trust=trust_pickles)
        return items, verified and _origins_verified(store, manifest, coords.rank), nbytes
    if _merged_only(manifest, coords):
        items, verified, nbytes = _read_megatron(store, step, coords, verify=verify, trust=trust_pickles)
        # the rank's other items (a dataloader's state, carried by convert at the same DP) are its own files
        others = [f for f in store.layout.files_for_rank(manifest.files, manifest.parallel, coords)
                  if f.item not in (MODEL_ITEM, OPTIM_ITEM)]
        for entry in others:
            blob = store.read_verified(entry, step, coords.rank, verify=verify)
            items[entry.item] = store.decode_entry(entry, blob, copy=copy, map_location=map_location,
                                                   trust_pickles=trust_pickles)
        return items, verified and _origins_verified(store, manifest, coords.rank), \
            nbytes + sum(f.size for f in others)
    items = store.load_rank(manifest, coords, verify=verify, copy=copy, map_location=map_location,
                            trust_pickles=trust_pickles)
    mine = store.layout.files_for_rank(manifest.files, manifest.parallel, coords)
    ranges = _in_place_ranges(store, manifest, coords)
    if ranges is not None:
        items[ranges.item] = read_in_place_item(store, step, coords, ranges, verify=verify)
        mine.append(ranges)
    # files drained from a snapshot of unverified origin (snapshot_record.UNVERIFIED) match their checksums, but
    # nothing showed those bytes were the ones saved
    origin_ok = not any(f.meta.get("origin") == "unverified" for f in mine)
    return items, verify and origin_ok, sum(f.size for f in mine)


def _origins_verified(store: FileStore, manifest: Any, rank: int) -> bool:
    """Whether no file of ``manifest`` was drained from a snapshot of unverified origin: a re-split reads every
    old rank's part, so one such rank makes the result unverified. Ranges written in place into Megatron's merged
    file say so in their rank's own manifest."""
    if any(f.meta.get("origin") == "unverified" for f in manifest.files):
        return False
    for merged in (f for f in manifest.files if f.meta.get("written") == "in_place"):
        for r in merged.meta.get("merged_from", ()):
            key = store.layout.rank_manifest_key(manifest.step, r)
            ranks = store._retry(lambda r=r: store.read_rank_manifest(manifest.step, r), manifest.step, rank,
                                 f"read {key}")
            if any(f.meta.get("origin") == "unverified" for f in ranks.files):
                return False
    return True


def _merged_only(manifest: Any, coords: RankCoords) -> bool:
    """Whether this rank's optimizer state is only in Megatron's merged file (one ``convert --to megatron``
    wrote: no rank file, no ranges written in place): it is then split from that file, as for a DP change."""
    from .layouts.megatron import is_merged_optimizer_file

    merged = [f for f in manifest.files if is_merged_optimizer_file(f)]
    own = [f for f in manifest.files if f.item == OPTIM_ITEM and f.rank == coords.rank and f not in merged]
    return bool(merged) and not own and not any(f.meta.get("written") == "in_place" for f in merged)


def _in_place_ranges(store: FileStore, manifest: Any, coords: RankCoords) -> Any:
    """This rank's entry for its ranges of a Megatron file written in place (None: it wrote none). The checkpoint
    manifest lists the file (``written: in_place``, the ranks it holds); the ranges and their CRC-32s are in the
    rank's own manifest, which must describe that file's plan (else a CorruptionError: the load falls back)."""
    merged = [f for f in manifest.files if f.meta.get("written") == "in_place"
              and coords.rank in f.meta.get("merged_from", ())]
    if not merged:
        return None
    key = store.layout.rank_manifest_key(manifest.step, coords.rank)
    ranks = store._retry(lambda: store.read_rank_manifest(manifest.step, coords.rank), manifest.step, coords.rank,
                         f"read {key}")
    for entry in ranks.files:
        facts = entry.meta.get("in_place")
        if isinstance(facts, dict) and entry.key == merged[0].key and facts.get("plan") == merged[0].meta.get("plan"):
            return entry
    raise CorruptionError(f"rank {coords.rank}'s manifest lists no ranges of {merged[0].key} as committed",
                          tier=store.name, key=key)


def read_in_place_item(store: FileStore, step: int, coords: RankCoords, entry: Any, *, verify: bool) -> Any:
    """A rank's ``distrib_optim`` item written in place into Megatron's merged file (``entry.meta.in_place``): its
    ranges read once, checked against the CRC-32s it recorded (``verify``) and placed in its shards."""
    from .megatron import inplace

    return store._retry(lambda: inplace.read_rank_shard(store.tier, entry, coords.rank, coords.layout, verify=verify),
                        step, coords.rank, f"read {entry.key}")


def _refuse(store: FileStore, changed: list[str], step: int, why: str) -> LayoutMismatchError:
    return LayoutMismatchError(f"step {step} on tier {store.name!r} was saved with another parallel layout "
                               f"({', '.join(changed)}): {why}")


def _read_megatron(store: FileStore, step: int, coords: RankCoords, *, verify: bool, trust: bool
                   ) -> tuple[dict[str, Any], bool, int]:
    """Megatron's items for this rank, re-split for this job's DP size where it changed; also reads checkpoints
    Megatron-LM wrote (no manifest: only each model file's zip CRC-32s are checked, and the result says
    unverified)."""
    from .megatron import legacy  # Megatron's format code is imported only when a step needs it

    try:
        items = legacy.load_rank_items(store.tier, step, coords, trust_pickles=trust, verify=verify)
    except NoCheckpointError as exc:
        # No step there after all (its directory removed since the listing, by another process's retention, or
        # files left by a save never committed): gone, as a missing file is, so load() moves on (not a tier's
        # own error, after which it would stop: a review found that).
        raise BlobNotFoundError(str(exc), tier=store.name) from None
    except LayoutMismatchError as exc:
        err = TierError(str(exc), tier=store.name)  # another tier may hold this step in a form this job loads
        err.layout_mismatch = True  # type: ignore[attr-defined]
        raise err from None
    nbytes = sum(t.numel() * t.element_size() for t in tensors(items))
    return dict(items), bool(items.verified), nbytes
