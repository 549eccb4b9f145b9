"""Retention of node-local tiers that knows what the other nodes committed (docs/operations.md, "Node-local tiers
on several nodes").

A node-local tier (each node's own disk) commits each node's ranks on their own, and each node's retention counts
``keep`` among its own commits. A step that failed on one node's disk and committed on the others let their
retention delete the step before it, the failing node's newest: no step was left on every node. So each node's
committing rank publishes, in the job's ``torch.distributed`` store (a key-value store every rank already
reaches, no collective), the steps its node holds committed on such a tier with the save that made each (its
save id: the job's incarnation and generation, docs/architecture.md "Save identity"). Global rank 0 works out,
per tier, the newest step of the current save generation that every node holds (the *floor*) and publishes it;
each node's retention keeps that step and every newer one. Where no step of the generation is on every node yet
(the first step of a job, or after it went back to an older step), nothing is retired there.

Only the ranks that commit a node-local tier for their node take part (one per node; retention runs there): the
store answers a few requests per node and second. What is published comes from listing the tier (a step
un-committed to be saved again leaves the list), never from memory of what was committed. The floor travels with
each drain request (a drain worker process has no store of its own) with the save id it belongs to: a floor of
another generation than the save's counts as unknown, and one a little stale is lower, so it only keeps more.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from .distributed import Coordinator
from .file_store import FileStore
from .manifest import SAVE_KEY

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how often each node lists its commits and reads the floor
PUBLISHED = 16  # the newest committed steps a node publishes per tier (only the newest common one matters)
UNKNOWN = -1  # a floor under every step: keep them all
JOIN_S = 2.0  # how long close() waits for the background thread


class NodeCommits:
    """One engine's view of what every node committed on each node-local tier, through the key-value store ``kv``
    (``set``/``get``/``check``, as torch.distributed's stores have them)."""

    def __init__(self, kv: Any, prefix: str, node: str, nodes: list[str], stores: dict[str, FileStore], *,
                 aggregates: bool):
        self.kv, self.prefix, self.node = kv, prefix, node
        self.nodes = nodes  # every node of the job, once each (Coordinator.nodes)
        self.stores = stores  # the node-local tiers this rank commits for its node
        self.aggregates = aggregates  # global rank 0: works out the floors for every node
        self._published: dict[str, str] = {}
        self._floors: dict[str, tuple[str, int]] = {}  # tier -> (save id, newest step every node holds)
        self._current = ""  # the save id of this engine's newest save
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered_ckpt-node-commits", daemon=True)
        self._thread.start()

    def _key(self, tier: str, node: str) -> str:
        return f"{self.prefix}/{tier}/{node}"

    def kept_from(self, save_id: str) -> dict[str, int]:
        """Per node-local tier, for a save ``save_id``: the newest step of that save's generation every node
        holds (retention keeps it and every newer one), or UNKNOWN."""
        with self._lock:
            self._current = save_id  # the job's current save generation (rank 0 works out the floors for it)
            floors = dict(self._floors)
        return {t: floors[t][1] if t in floors and floors[t][0] == save_id else UNKNOWN for t in self.stores}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)  # it may be in a store call: never past a moment

    # ----- in the background -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            for tier, files in self.stores.items():
                self._publish(tier, files)
                floor = self._common_floor(tier) if self.aggregates else self._read_floor(tier)
                if self.aggregates and floor is not None:
                    self._set(self._key(tier, "@floor"), json.dumps(floor))
                with self._lock:
                    if floor is None:
                        self._floors.pop(tier, None)
                    else:
                        self._floors[tier] = floor
            if self._stop.wait(REFRESH_S):
                return

    def _publish(self, tier: str, files: FileStore) -> None:
        """This node's committed steps of ``tier`` with their save ids, newest last, when they changed."""
        try:
            held = []
            for step in files.committed_steps()[-PUBLISHED:]:
                manifest = files.read_manifest(step)
                held.append([step, manifest.extra.get(SAVE_KEY, "")])
        except Exception as exc:  # noqa: BLE001 - published as before: the floor keeps more, never less
            log.debug("tier %r: could not list this node's commits for the other nodes: %s", tier, exc)
            return
        text = json.dumps(held)
        if self._published.get(tier) != text and self._set(self._key(tier, self.node), text):
            self._published[tier] = text

    def _set(self, key: str, value: str) -> bool:
        try:
            self.kv.set(key, value)
            return True
        except Exception as exc:  # noqa: BLE001 - the other nodes keep more, never less
            log.debug("could not publish %s: %s", key, exc)
            return False

    def _get(self, key: str) -> Any:
        """The JSON value of ``key``, None when it is not there (``get`` would wait for it) or unreadable."""
        try:
            return json.loads(self.kv.get(key)) if self.kv.check([key]) else None
        except Exception as exc:  # noqa: BLE001 - cannot tell: keep everything until it can
            log.debug("could not read %s: %s", key, exc)
            return None

    def _read_floor(self, tier: str) -> tuple[str, int] | None:
        found = self._get(self._key(tier, "@floor"))
        return (str(found[0]), int(found[1])) if isinstance(found, list) and len(found) == 2 else None

    def _common_floor(self, tier: str) -> tuple[str, int] | None:
        """The newest (save id, step) of the current save generation that every node holds, or None."""
        held: list[set[tuple[str, int]]] = []
        for node in self.nodes:
            found = self._get(self._key(tier, node))
            if not isinstance(found, list):
                return None  # a node that has not told its commits (yet)
            held.append({(str(save), int(step)) for step, save in found})
        with self._lock:
            current = self._current  # every rank saves the same steps: rank 0's newest save is the job's
        if not current:
            return None
        common = set.intersection(*[{p for p in pairs if p[0] == current} for pairs in held])
        return max(common, key=lambda p: p[1]) if common else None


def start(coordinator: Coordinator, stores: dict[str, FileStore], coords: Any) -> NodeCommits | None:
    """The node commits of a job on several nodes with node-local file tiers that retire steps, through the
    default ``torch.distributed`` store; None where there is nothing to coordinate (one node, no such tier, not
    this node's committing rank, no store)."""
    local = {n: s for n, s in stores.items() if s.tier.capabilities.node_local and s.cfg.keep is not None
             and s._commits_here(coords, coordinator.node_ranks)}
    if len(coordinator.nodes) < 2 or not local or not coordinator.incarnation:
        return None
    try:
        import torch.distributed as dist

        kv = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - a process group without a store: retention as on one node
        log.warning("node-local tiers %s: no torch.distributed store to learn the other nodes' commits from (%s): "
                    "each node's retention counts only its own", ", ".join(map(repr, local)), exc)
        return None
    return NodeCommits(kv, f"tiered_ckpt/{coordinator.incarnation}/node_commits", coordinator.node,
                       coordinator.nodes, local, aggregates=coords.rank == 0)
