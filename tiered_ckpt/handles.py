"""What ``save()`` and ``load()`` return."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from .errors import TieredCkptError


class SaveError(TieredCkptError):
    """One or more tiers could not take a step. ``failures`` maps tier name → reason."""

    def __init__(self, step: int, failures: dict[str, str]):
        self.step = step
        self.failures = failures
        detail = "; ".join(f"tier {t!r}: {why}" for t, why in failures.items())
        super().__init__(f"step {step} was not committed on every due tier: {detail}")


class SavesFailedError(SaveError):
    """``engine.wait()``: saves since the previous ``engine.wait()`` that some tier could not take.
    ``steps`` maps step → (tier → reason); ``step`` and ``failures`` are the first one's, as in SaveError."""

    def __init__(self, steps: dict[int, dict[str, str]]):
        self.steps = {s: dict(f) for s, f in sorted(steps.items())}
        first = next(iter(self.steps))
        super().__init__(first, self.steps[first])
        detail = "; ".join(f"step {s} on tier {t!r}: {why}" for s, f in self.steps.items() for t, why in f.items())
        self.args = (f"{len(self.steps)} save(s) not committed on every due tier: {detail}",)


class SaveHandle:
    """A save in flight. ``blocking_s`` is how long ``save()`` blocked; ``wait()`` follows the drain."""

    def __init__(self, step: int, blocking_s: float, entry: str, due: tuple[str, ...], skipped: bool = False):
        self.step = step
        self.blocking_s = blocking_s
        self.entry = entry  # the tier the snapshot went into
        self.due = due  # the tiers below that take this step
        self.skipped = skipped
        self.save_id = ""  # the save's identity (a step saved again is another save): engine.wait_committed
        self.created = time.time()
        self._futures: dict[str, Future] = {t: Future() for t in due}
        self._errors: dict[str, str] = {}

    def _resolve(self, tier: str, ok: bool, error: str | None) -> None:
        fut = self._futures.get(tier)
        if fut is None or fut.done():
            return
        if not ok:
            self._errors[tier] = error or "failed"
        fut.set_result(ok)

    def done(self, tier: str | None = None) -> bool:
        futs = [self._futures[tier]] if tier else list(self._futures.values())
        return all(f.done() for f in futs)

    def wait(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Wait until every due tier (or ``tier``) has taken the step; raise :class:`SaveError` on failure.

        On the rank that commits a file tier's steps (global rank 0; a node-local tier: the node's first rank),
        "taken" means committed. On the other ranks of a multi-rank job it means this rank's part is on the tier
        and voted: whether the step then commits is the committing rank's to tell (its handle, the ``commit`` /
        ``commit_failed`` events). A step that does not commit is never loaded (``load()`` takes the newest
        committed one), so nothing is lost; a script that acts on a commit waits with
        :meth:`CheckpointEngine.wait_committed` on every rank instead."""
        if isinstance(tier, int | float) and not isinstance(tier, bool):  # engine.wait(60) takes a timeout there
            raise TypeError(f"SaveHandle.wait's first argument is a tier name, got {tier!r}: pass a timeout as "
                            f"wait(timeout={tier!r})")
        if tier is not None and tier not in self._futures:
            if tier == self.entry and not self.skipped:
                return
            raise KeyError(f"tier {tier!r} is not due for step {self.step} (due: {', '.join(self.due) or 'none'})")
        names = [tier] if tier else list(self._futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in names:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._futures[name].result(left)
            except FutureTimeout:
                raise TimeoutError(f"step {self.step} not committed on tier {name!r} within {timeout} s") from None
        failed = {n: self._errors[n] for n in names if n in self._errors}
        if failed:
            raise SaveError(self.step, failed)

    @property
    def results(self) -> dict[str, bool | None]:
        """Per due tier: True committed, False failed, None still draining."""
        return {t: (f.result() if f.done() else None) for t, f in self._futures.items()}

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} blocking_s={self.blocking_s:.4f} results={self.results}>"


@dataclass
class LoadResult:
    step: int
    items: dict[str, Any]
    tier: str  # which tier it came from
    verified: bool = True  # False when the tier had no checksum to verify against
    seconds: float = 0.0
    nbytes: int = 0
    fallbacks: list[str] = field(default_factory=list)  # what was tried first and why it was skipped
    # Tiers this rank could not list (tier → why): the step is the newest on the tiers it could see; one of
    # these may hold a newer one. Empty when every tier was listed.
    unreachable: dict[str, str] = field(default_factory=dict)

    def __iter__(self):  # step, items, tier = engine.load()
        return iter((self.step, self.items, self.tier))
