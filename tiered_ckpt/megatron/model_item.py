"""Where a rank that did not snapshot ``model_optim_rng`` gets it on load: from memory, whatever its DP rank.

Megatron writes ``model_optim_rng`` once per model-parallel group (DP rank 0, CP rank 0); the adapter snapshots it
there only, so a DP rank > 0 resuming from a memory tier holds its optimizer shards but not the model. It gets the
model's item, in this order (docs/megatron.md, "Resuming every rank from memory"):

1. its own items (``model_on_every_rank=True``, or a file tier that holds the whole model file);
2. the holder's snapshot in this node's shared memory, read straight from the holder's slot: the very snapshot the
   holder itself loaded (same record, same checksum), verified against its checksum where it has one;
3. from the holder over the coordinator's gloo group (another node): the holder flat-encodes what it loaded and
   sends it with its checksum, the receiver verifies and decodes it with the snapshot codec (no pickle);
4. a file tier.

With ``torch.distributed`` initialised this is collective: every rank of the job calls :func:`resolve` (two small
all-gathers, then point-to-point sends only for ranks on other nodes than their holder).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from ..checksum import snapshot_checksum, snapshot_matches
from ..codecs import flat
from ..errors import CorruptionError, LayoutMismatchError
from ..snapshot_record import snapshot_layout_changes

log = logging.getLogger(__name__)
MODEL_ITEM = "model_optim_rng"


def holder_rank(engine: Any) -> int:
    """The rank that snapshots this rank's ``model_optim_rng``: same TP, PP and EP, DP rank 0, CP rank 0."""
    c = engine.coords
    return c.layout.rank_of(tp=c.tp, pp=c.pp, ep=c.ep, dp=0, cp=0)


def resolve(engine: Any, loaded: Any) -> tuple[dict[str, Any], str]:
    """``(model_optim_rng, where it came from)`` for this rank after ``loaded = engine.load(...)``."""
    mine = loaded.items.get(MODEL_ITEM)
    holder = holder_rank(engine)
    coordinator = engine.coordinator
    if not coordinator.distributed:
        if mine is not None:
            return mine, loaded.tier
        found = _from_node_snapshot(engine, holder, loaded.step, None)
        if found is not None:
            return found, f"shm of rank {holder}"
        return _from_files(engine, loaded.step), "file tier"
    # Round 1: who holds the item, and (for snapshots) with which checksum.
    offer_mine = coordinator.alone(_offer, engine, loaded) if mine is not None else None
    offers = coordinator.all_gather(offer_mine, "model_item offers")
    result: tuple[dict[str, Any], str] | None = (mine, loaded.tier) if mine is not None else None
    need = False
    if result is None:
        offer = offers[holder]
        if offer is not None and offer["snapshot"] is not None and holder in coordinator.node_ranks:
            found = coordinator.alone(_from_node_snapshot, engine, holder, loaded.step, offer["snapshot"])
            if found is not None:
                result = (found, f"shm of rank {holder}")
        need = result is None and offer is not None
    # Round 2: who needs it sent, then the sends (holder -> each receiver; no cycles, so no deadlock).
    needs = coordinator.all_gather(holder if need else None, "model_item needs")
    receivers = [r for r, h in enumerate(needs) if h == engine.coords.rank]
    if receivers:
        _send(mine, receivers, coordinator.group)
    if need:
        result = (_receive(holder, coordinator.group, engine.coords.rank), f"rank {holder} over gloo")
    if result is None:
        result = (_from_files(engine, loaded.step), "file tier")
    return result


def _offer(engine: Any, loaded: Any) -> dict[str, Any]:
    """What a holder tells the others: which snapshot it loaded the item from (its record's creation time, and
    the item's checksum where the drain computed one), or only the tier when it loaded from files."""
    store = engine.pipeline.stores.get(loaded.tier)
    slots = store.slots() if store is not None else None
    if slots is not None:
        for meta in slots.metas().values():
            if meta.step == loaded.step and any(it.name == MODEL_ITEM for it in meta.items):
                checksum = next(it.checksum for it in meta.items if it.name == MODEL_ITEM)
                return {"tier": loaded.tier, "snapshot": {"created": meta.created, "checksum": checksum or None}}
    return {"tier": loaded.tier, "snapshot": None}


def _from_node_snapshot(engine: Any, holder: int, step: int,
                        snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """The holder's snapshot of ``step`` from a memory tier on this node (``snapshot``: the very one the holder
    loaded, by creation time and checksum)."""
    holder_coords = engine.coords.layout.coords(holder)
    for store in engine.pipeline.stores.values():
        slots = store.slots()
        if slots is None:
            continue
        view = slots.for_rank(holder)
        for meta in sorted(view.metas().values(), key=lambda m: -m.created):
            item = next((it for it in meta.items if it.name == MODEL_ITEM), None)
            if meta.step != step or item is None:
                continue
            if snapshot is not None and (meta.created != snapshot["created"]
                                         or (item.checksum or None) != snapshot["checksum"]):
                continue
            if snapshot_layout_changes(meta, holder_coords):
                continue  # a snapshot of another parallel layout (an older job), or not the holder's own
            try:
                return view.load(meta, copy=True, verify=True, only={MODEL_ITEM})[MODEL_ITEM]
            except CorruptionError as exc:
                log.warning("rank %d: rank %d's snapshot of step %d on tier %r is unusable: %s",
                            engine.coords.rank, holder, step, store.name, exc)
    return None


def _from_files(engine: Any, step: int) -> dict[str, Any]:
    """``model_optim_rng`` of this rank's model-parallel group from a file tier."""
    tried = []
    for store in engine.pipeline.durable_stores().values():
        try:
            items, _, _ = store.read_step(step, engine.coords, copy=True, map_location=None, verify=True,
                                          trust_pickles=engine.config.load.trust_pickles, into=None)
        except Exception as exc:  # try the next tier
            tried.append(f"tier {store.name!r}: {exc}")
            continue
        if MODEL_ITEM in items:
            return items[MODEL_ITEM]
        tried.append(f"tier {store.name!r}: no {MODEL_ITEM} for this rank")
    raise LayoutMismatchError(
        f"rank {engine.coords.rank}: step {step} has no model_optim_rng for this rank: not in its snapshot, not in "
        f"rank {holder_rank(engine)}'s (its model-parallel group's DP rank 0) on this node or over the network, "
        f"and not on a file tier ({'; '.join(tried) or 'none configured'})")


# ------------------------------------------------------------------------------------------------------------
# over the coordinator's gloo group


def _send(item: dict[str, Any], receivers: list[int], group: Any) -> None:
    import torch.distributed as dist

    plan = flat.plan_snapshot(item)
    data = torch.empty(plan.total_bytes, dtype=torch.uint8)
    flat.copy_into(plan, data)
    header = flat.encode_header(plan)
    preamble = json.dumps({"header": len(header), "data": plan.total_bytes,
                           "checksum": snapshot_checksum(data)}).encode()
    tensors = [torch.tensor([len(preamble)], dtype=torch.int64), _bytes(preamble), _bytes(header), data]
    for r in receivers:
        for t in tensors:
            dist.send(t, r, group=group)


def _receive(holder: int, group: Any, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, holder, group=group)
    preamble = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(preamble, holder, group=group)
    meta = json.loads(bytes(preamble.numpy()))
    header = torch.empty(meta["header"], dtype=torch.uint8)
    dist.recv(header, holder, group=group)
    data = torch.empty(meta["data"], dtype=torch.uint8)
    dist.recv(data, holder, group=group)
    if not snapshot_matches(data, meta["checksum"]):
        raise CorruptionError(f"rank {rank}: model_optim_rng received from rank {holder} does not match its "
                              "checksum")
    return flat.restore(flat.decode_header(bytes(header.numpy())), data, copy=False)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
