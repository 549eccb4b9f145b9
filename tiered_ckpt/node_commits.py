"""Retention of node-local tiers that knows what the other nodes committed (docs/operations.md, "Node-local tiers
on several nodes").

A node-local tier (each node's own disk) commits each node's ranks on their own, and each node's retention counts
``keep`` among its own commits. A step that failed on one node's disk and committed on the others let their
retention delete the step before it, the failing node's newest: no step was left on every node. So each node's
committing rank publishes the steps its node committed on such a tier in the job's ``torch.distributed`` store
(a key-value store every rank already reaches, no collective), and each node's retention keeps every step from
the newest one that every node has committed (:meth:`NodeCommits.kept_from`). While a node has not told its
commits (at start-up, for a moment) or no step is on every node, nothing there is retired.

Only the ranks that commit a node-local tier for their node take part (one per node; retention runs there). Global
rank 0 reads every node's commits and publishes the floor of each tier; the others read that one key, so the
store answers a few requests per node and second, whatever the job's size. The floors travel with each drain
request (a drain worker process has no store of its own); one a little stale is lower, never higher: it only
keeps more.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

from .file_store import FileStore

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how often the other nodes' commits are read
PUBLISHED = 64  # the newest committed steps a node publishes per tier (only the newest common one matters)
UNKNOWN = -1  # a floor under every step: keep them all


class NodeCommits:
    """One engine's view of what every node committed on each node-local tier, through the key-value store ``kv``
    (``set``/``get``/``check``, as torch.distributed's stores have them)."""

    def __init__(self, kv: Any, prefix: str, node: str, nodes: Iterable[str], stores: dict[str, FileStore],
                 publishes: Iterable[str], *, aggregates: bool):
        self.kv, self.prefix, self.node = kv, prefix, node
        self.nodes = sorted(set(nodes))
        self.stores = stores
        self.publishes = set(publishes)  # the tiers this rank commits for its node
        self.aggregates = aggregates  # global rank 0: works out the floors for every node
        self._mine: dict[str, set[int]] = {t: set() for t in self.publishes}
        self._floors: dict[str, int] = {t: UNKNOWN for t in self.publishes}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered_ckpt-node-commits", daemon=True)
        self._thread.start()

    def _key(self, tier: str, node: str) -> str:
        return f"{self.prefix}/{tier}/{node}"

    def committed(self, tier: str, step: int) -> None:
        """This node committed ``step`` on ``tier`` (on its committing rank): tell the other nodes."""
        if tier not in self.publishes:
            return
        with self._lock:
            self._mine[tier].add(step)
            steps = sorted(self._mine[tier])[-PUBLISHED:]
        self._publish(tier, steps)

    def kept_from(self) -> dict[str, int]:
        """Per node-local tier: the newest step every node has committed (retention keeps it and every newer
        one), or UNKNOWN."""
        with self._lock:
            return dict(self._floors)

    def close(self) -> None:
        self._stop.set()

    # ----- in the background -------------------------------------------------------------------------------
    def _publish(self, tier: str, steps: list[int]) -> None:
        try:
            self.kv.set(self._key(tier, self.node), json.dumps(steps))
        except Exception as exc:  # noqa: BLE001 - the other nodes then keep more, never less
            log.warning("tier %r: could not tell the other nodes which steps this node committed: %s", tier, exc)

    def _run(self) -> None:
        for tier in self.publishes:  # what this node holds already (a restart): before any floor is worked out
            try:
                found = self.stores[tier].committed_steps()
            except Exception as exc:  # noqa: BLE001 - its commits are told as they come
                log.warning("tier %r: could not list its committed steps for the other nodes: %s", tier, exc)
                found = []
            with self._lock:
                self._mine[tier].update(found)
                steps = sorted(self._mine[tier])[-PUBLISHED:]
            self._publish(tier, steps)
        while True:
            for tier in self.publishes:
                floor = self._common_floor(tier) if self.aggregates else self._read_floor(tier)
                if self.aggregates and floor != UNKNOWN:
                    self._set_floor(tier, floor)
                with self._lock:
                    self._floors[tier] = floor
            if self._stop.wait(REFRESH_S):
                return

    def _set_floor(self, tier: str, floor: int) -> None:
        try:
            self.kv.set(self._key(tier, "@floor"), str(floor))
        except Exception as exc:  # noqa: BLE001 - the nodes keep their older floor: more, never less
            log.debug("tier %r: could not publish the floor: %s", tier, exc)

    def _read_floor(self, tier: str) -> int:
        key = self._key(tier, "@floor")
        try:
            return int(self.kv.get(key)) if self.kv.check([key]) else UNKNOWN
        except Exception as exc:  # noqa: BLE001 - cannot tell: keep everything until it can
            log.debug("tier %r: the floor could not be read: %s", tier, exc)
            return UNKNOWN

    def _common_floor(self, tier: str) -> int:
        common: set[int] | None = None
        for node in self.nodes:
            key = self._key(tier, node)
            try:
                if not self.kv.check([key]):
                    return UNKNOWN  # a node that has not told its commits yet
                steps = set(json.loads(self.kv.get(key)))
            except Exception as exc:  # noqa: BLE001 - cannot tell: keep everything until it can
                log.debug("tier %r: the commits of node %r could not be read: %s", tier, node, exc)
                return UNKNOWN
            common = steps if common is None else common & steps
        return max(common) if common else UNKNOWN


def start(coordinator: Any, stores: dict[str, FileStore], coords: Any) -> NodeCommits | None:
    """The node commits of a job on several nodes with node-local file tiers that retire steps, through the
    default ``torch.distributed`` store; None where there is nothing to coordinate (one node, no such tier, no
    store)."""
    nodes = getattr(coordinator, "nodes", None) or []
    incarnation = getattr(coordinator, "incarnation", None)
    local = {n: s for n, s in stores.items() if s.tier.capabilities.node_local and s.cfg.keep is not None}
    if len(set(nodes)) < 2 or not local or not incarnation:
        return None
    try:
        import torch.distributed as dist

        kv = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - a process group without a store: retention as on one node
        log.warning("node-local tiers %s: no torch.distributed store to learn the other nodes' commits from (%s): "
                    "each node's retention counts only its own", ", ".join(map(repr, local)), exc)
        return None
    publishes = [n for n, s in local.items() if s._commits_here(coords, coordinator.node_ranks)]
    if not publishes:  # not this node's committing rank: its retention never runs
        return None
    return NodeCommits(kv, f"tiered_ckpt/{incarnation}/node_commits", coordinator.node, nodes, local, publishes,
                       aggregates=coords.rank == 0)
