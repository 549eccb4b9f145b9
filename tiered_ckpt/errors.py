"""Every error tiered_ckpt raises on purpose derives from :class:`TieredCkptError`.

Messages always say *where* (file, key path, rank, tier) and *what* was wrong, so a user reading a log line of a
512-rank job can act on it without a debugger.
"""

from __future__ import annotations


class TieredCkptError(Exception):
    """Base class of the library's own errors."""


class ConfigError(TieredCkptError, ValueError):
    """The configuration is invalid. The message names the source, the key path, what was expected and found."""

    def __init__(self, message: str, *, source: str | None = None, key_path: str | None = None):
        self.source = source
        self.key_path = key_path
        self.message = message  # without the source and key path
        prefix = ""
        if source:
            prefix += f"{source}: "
        if key_path:
            prefix += f"{key_path}: "
        super().__init__(prefix + message)


class DrainClosedError(TieredCkptError):
    """A save reached the drain after ``close()`` had begun: the step was not handed to it (its snapshot stays in
    the first tier's slot until the slot is reused)."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"step {step}: the drain is closed (close() ran while this save was being taken); the step "
                         "was not handed to it")


class PluginError(TieredCkptError):
    """A plugin could not be loaded, or two plugins claim the same name."""


class EncodeError(TieredCkptError, TypeError):
    """A value in a state dict cannot be encoded without pickle. The message names its key path (and, from
    ``save()``, the item): ``item 'model' at layers[0]: cannot encode ...``.

    ``path``: the key path inside the value encoded (``""``: the value itself); ``item``: the item's name;
    ``detail``: the message without either. None when the raiser did not give them."""

    def __init__(self, message: str, *, path: str | None = None, item: str | None = None):
        self.detail = message
        self.path = path
        self.item = item
        where = []
        if item is not None:
            where.append(f"item {item!r}")
        if path:
            where.append(f"at {path}" if item is not None else path)
        elif path is not None and item is None:
            where.append("<root>")
        super().__init__(" ".join(where) + ": " + message if where else message)


class DecodeError(TieredCkptError, ValueError):
    """A snapshot header or file is malformed."""


def _located(message: str, tier: str | None, key: str | None, *, noun: str) -> str:
    """``message`` after where it happened: "tier 'x', <noun> 'k': message"."""
    where = ([f"tier {tier!r}"] if tier else []) + ([f"{noun} {key!r}"] if key else [])
    return (", ".join(where) + ": " if where else "") + message


class TierError(TieredCkptError):
    """An operation on a tier failed. ``tier`` names the tier, ``key`` the object involved."""

    def __init__(self, message: str, *, tier: str | None = None, key: str | None = None):
        self.tier = tier
        self.key = key
        super().__init__(_located(message, tier, key, noun="key"))


class TransientTierError(TierError):
    """A failure worth retrying: timeouts, throttling, 5xx answers, connection resets."""


class PermanentTierError(TierError):
    """A failure that retrying cannot fix: permission denied, disk full, bad configuration."""


class BlobNotFoundError(TierError, KeyError):
    """The requested key does not exist on the tier."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class RangeError(TierError):
    """A read of a range the blob does not hold: the blob is shorter than what points into it says (a file cut
    short, or an index that is wrong): damage, not a failure to reach the tier."""


class CapacityError(PermanentTierError):
    """A memory tier has no room for the requested allocation (checked before allocating, never a SIGBUS)."""


class CorruptionError(TieredCkptError):
    """Stored bytes do not match their manifest (checksum or size), or a manifest is malformed."""

    def __init__(self, message: str, *, tier: str | None = None, key: str | None = None):
        self.tier = tier
        self.key = key
        super().__init__(_located(message, tier, key, noun="file"))


class BlobTooLargeError(CorruptionError):
    """A blob larger than the most its reader allowed (``read_blob_hashed(max_size=...)``): refused, unread."""

    def __init__(self, message: str, *, size: int, max_size: int, tier: str | None = None, key: str | None = None):
        self.size = size
        self.max_size = max_size
        super().__init__(message, tier=tier, key=key)


class NoCheckpointError(TieredCkptError, FileNotFoundError):
    """No tier holds a complete, verifiable checkpoint (for the requested step)."""


class StepNotFoundError(TieredCkptError, LookupError):
    """``load(step=N)``: no tier of any rank holds step N (the message lists the steps they hold). Deliberately
    *not* a :class:`NoCheckpointError`: a resume script that starts from scratch on "nothing there" must not do so
    because the step it asked for was mistyped or removed by retention."""


class TierUnavailableError(TieredCkptError):
    """``load()`` found nothing loadable on the tiers it could list, and some tier could not be listed at all
    (an unreachable object store, a permission error): "could not look", never "nothing there". Deliberately
    *not* a :class:`NoCheckpointError`, so that a resume script that starts from scratch on "nothing there"
    stops here instead. ``unreachable`` maps each tier this rank could not list to why (empty when only other
    ranks could not)."""

    def __init__(self, message: str, unreachable: dict[str, str] | None = None):
        self.unreachable = dict(unreachable or {})
        super().__init__(message)


class CheckpointUnreadableError(TieredCkptError):
    """``load()`` found checkpoints, and could load none of them: every copy of every step it tried failed
    (checksums, a damaged manifest, a missing file), or a file tier failed to read the newest step with its own
    errors (throttled, unreachable, permission denied: no proof of damage, so no older step is taken in its place;
    load again, or ask for an older step). Deliberately *not* a :class:`NoCheckpointError`: a resume
    script that starts from scratch on "nothing there" must stop here, or its new run's saves land beside
    damaged steps that still count as the newest. ``failures`` lists what each copy tried failed with."""

    def __init__(self, message: str, failures: list[str] | None = None):
        self.failures = list(failures or [])
        super().__init__(message)


class LoadIntoError(TieredCkptError, ValueError):
    """``load(into=...)`` was given a target the checkpoint cannot go into: an item name it does not hold, or a
    tensor of another shape or dtype. The message names the item, the key path and both shapes."""


class PeerFailedError(TieredCkptError):
    """A collective operation (``load()``) stopped on every rank because another rank failed in it, or because
    the ranks were at different points of it. The failing rank raised its own error: that one says what to fix.
    ``ranks`` maps each failed rank to its error's text."""

    def __init__(self, message: str, ranks: dict[int, str] | None = None):
        self.ranks = dict(ranks or {})
        super().__init__(message)


class UnsafePickleError(TieredCkptError):
    """A checkpoint file would execute code when unpickled; refused unless ``trust_pickles`` is set."""


class LayoutMismatchError(TieredCkptError):
    """The checkpoint's parallel layout cannot be loaded with the current one (names what changed)."""


class RunLockedError(TieredCkptError):
    """Another live engine on this node holds the same run_id and rank."""
