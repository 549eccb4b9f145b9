"""The Store protocol: what the engine, the drains and the CLI ask of one tier (docs/architecture.md, "The two
protocols").

Two classes implement it: :class:`~tiered_ckpt.memory_store.MemoryStore` (snapshot slots on ``gpu``/``shm``) and
:class:`~tiered_ckpt.file_store.FileStore` (files, manifests and commits on ``local``/``fsspec``). A caller holds a
``Store`` and never asks which class it is: what differs between them is decided inside each store — which slot
a snapshot goes to, which rank commits a step, when retention runs. Two accessors hand out the parts only one kind
has: :meth:`Store.slots` (the snapshot slots, for the entry tier and for readers of other ranks' snapshots) and
:meth:`Store.files` (the committed files, for ``inspect``/``verify``/``gc`` and conversion).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .file_store import FileStore
    from .manifest import RankManifest
    from .parallel import RankCoords
    from .snapshot_record import SlotMeta
    from .tiers.base import Tier


@dataclass
class Written:
    """What :meth:`Store.write_step` left on a tier, before :meth:`Store.commit`."""

    step: int
    nbytes: int
    slot: int | None = None  # a memory tier: the slot that holds the step now
    manifest: RankManifest | None = None  # a file tier: this rank's manifest, published
    # Work that must finish once the step is committed (the snapshot's checksums, computed meanwhile) and, in
    # every case, before the source slot may be reused.
    on_committed: Callable[[], None] | None = None
    settle: Callable[[], None] | None = None
    # Work the commit leaves for after the step's delivery is reported and its source slot released (retention's
    # deletions of older steps' files, already un-committed): run by the drain before the job counts as done.
    housekeeping: list[Callable[[], None]] = field(default_factory=list)

    def committed(self) -> None:
        if self.on_committed is not None:
            self.on_committed()

    def close(self) -> None:
        if self.settle is not None:
            self.settle()


class Store(Protocol):
    """One tier seen by this rank: its steps, how it takes a step from the tier above, how it commits."""

    tier: Tier

    @property
    def name(self) -> str: ...

    @property
    def durable(self) -> bool:
        """Whether a committed step here outlives the training job's memory (a file tier)."""
        ...

    def slots(self) -> SnapshotStore | None:
        """The snapshot slots of this tier, if it holds snapshots (a memory tier); None otherwise."""
        ...

    def files(self) -> FileStore | None:
        """The committed files of this tier, if it holds files (a file tier); None otherwise."""
        ...

    # ----- life cycle ----------------------------------------------------------------------------------------
    def clean_start(self) -> list[str]:
        """Remove what a killed process of this rank left half-written (before any writer of ours starts);
        return what was removed."""
        ...

    def prepare(self, nbytes: int) -> None:
        """Allocate ahead of the first save whatever a save of ``nbytes`` would allocate."""
        ...

    def release_on_close(self, durable: Callable[[], set[int]]) -> list[int] | None:
        """``on_close: release``: free what this tier holds of steps in ``durable()`` (computed only when
        needed); the steps kept, or None when this tier releases nothing at close."""
        ...

    def close(self) -> None: ...

    # ----- saving --------------------------------------------------------------------------------------------
    def due(self, ordinal: int, persistent: bool) -> bool:
        """Whether this tier (below the entry tier) takes the ``ordinal``-th save (1-based)."""
        ...

    def write_step(self, step: int, coords: RankCoords, source: Store, *, slot: int | None,
                   pinned: Callable[[int], bool], hasher: Executor, node_ranks: list[int] | None = None,
                   wait_s: float = 0.0) -> Written:
        """Write this rank's part of ``step``, read from ``source`` (``slot``: where a memory source holds it).
        ``pinned(step)``: whether a step held here must not be overwritten. ``hasher``: where work that can run
        beside the write goes. ``node_ranks``: the ranks on this node (as :meth:`commit` gets them), so a file
        store knows whether its commit will cover the job (None: unknown). ``wait_s``: how long to wait for
        what another rank's commit of ``source`` makes (Megatron's merged file, written in place)."""
        ...

    def commit(self, written: Written, coords: RankCoords, *, node_ranks: list[int], wait_s: float,
               pinned: Callable[[], set[int]], on_committed: Callable[[int], None], fail_fast: bool = False
               ) -> None:
        """Make ``written`` a step of this tier (if this rank is the one that commits it here), calling
        ``on_committed(nbytes)`` once it is, then apply retention (never to a step in ``pinned()``; what can
        wait, deleting the files of steps it un-committed, goes to ``written.housekeeping``). Raises
        :class:`~tiered_ckpt.errors.TierError` when the step could not be committed: after ``wait_s`` without
        every rank's part, or (``fail_fast``: the save's first drain, not a recovery) as soon as a rank
        said its part failed (:meth:`write_failed`)."""
        ...

    def write_failed(self, step: int, coords: RankCoords, *, node_ranks: list[int], save_id: str,
                     reason: str) -> None:
        """This rank's part of ``step`` (the save ``save_id``) failed here, saying ``reason``: tell the ranks
        that would wait for it (a file tier records it; a memory tier has no one waiting). Never raises."""
        ...

    def retain(self, coords: RankCoords, *, node_ranks: list[int], pinned: Callable[[], set[int]]
               ) -> list[Callable[[], None]]:
        """Apply retention again, now that steps it had to keep at its last commit (``pinned()``: held for a tier
        below that had not taken them yet) may have been let go; the deletions to make. Nothing to do where the
        last commit's retention kept nothing back, or on a tier whose commit applies none."""
        ...

    # ----- loading -------------------------------------------------------------------------------------------
    def durable_steps(self) -> list[int]:
        """Steps committed here for good (none on a memory tier)."""
        ...

    def loadable_steps(self, coords: RankCoords) -> list[int]:
        """Steps this rank can load from here (its part is here; another parallel layout only where a load can
        re-split it)."""
        ...

    def read_step(self, step: int, coords: RankCoords, *, copy: bool, map_location: Any, verify: bool,
                  trust_pickles: bool, into: dict[str, Any] | None) -> tuple[dict[str, Any], bool, int]:
        """This rank's items of ``step``: ``(items, verified, bytes read)``. Raises CorruptionError, TierError or
        LayoutMismatchError when this tier cannot give them (the caller tries the next tier)."""
        ...


class SnapshotStore(Store, Protocol):
    """The slots of a memory tier: what a save writes into and a restart finds again."""

    rank: int
    nslots: int

    def for_rank(self, rank: int) -> SnapshotStore:
        """The same tier's slots of another rank (a reader's view: it never allocates)."""
        ...

    def acquire_slot(self, step: int, *, wait: bool, pinned: Callable[[int], bool] | None = None,
                     on_wait: Callable[[], None] | None = None) -> int | None:
        """A slot to write ``step`` into, held until :meth:`release_slot`: an empty one first, then the one
        holding the oldest step (never one held, nor one holding a ``pinned`` step). With ``wait``, block until
        one is free (calling ``on_wait`` at each look while it waits); without, None when none is."""
        ...

    def hold_slot(self, slot: int) -> None: ...

    def release_slot(self, slot: int) -> None: ...

    def write_snapshot(self, step: int, slot: int, placed: list, total: int, *, coords: RankCoords, layout: str,
                       run_id: str, persistent: bool, save_id: str = "",
                       skipped: Sequence[str] = ()) -> SlotMeta:
        """Copy the planned items (:func:`~tiered_ckpt.memory_store.plan_items`) into ``slot`` and publish its
        record: the save's only blocking work. ``save_id``: the save's identity, kept in the record; ``skipped``:
        the tiers below that this save is not due on, kept in the record for a restart's drain."""
        ...

    def metas(self) -> dict[int, SlotMeta]: ...

    def load(self, meta: SlotMeta, *, copy: bool, map_location: Any = None, verify: bool = True,
             into: dict[str, Any] | None = None, only: set[str] | None = None) -> dict[str, Any]: ...
