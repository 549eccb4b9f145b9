"""The ``faulty`` tier kind: wraps any tier and injects latency, errors, a full disk or bit flips.

Faults come from three layers, later ones overriding earlier ones field by field:

1. the tier's options (the configuration file), 2. the JSON control file named by ``control_file``, re-read
whenever it changes, so a test can change faults in a process it does not control (the engine's drain worker),
3. in-process overrides: ``FaultyTier.controls[name].set(...)``.

Counters (operations seen, bytes written, the random generator for bit flips) belong to the process and
restart whenever the effective faults change (a new control file, ``set``, ``update``, ``clear``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from tiered_ckpt.errors import ConfigError, PermanentTierError, PluginError, TransientTierError
from tiered_ckpt.tiers.base import Capabilities, Chunk, Tier, TierContext, UnfinishedUpload, as_memoryview, check_key
from tiered_ckpt.validate import NonNegativeInt, Seconds, Size, build_dataclass

#: Primitives the error and latency faults may apply to.
FAULT_OPS = ("write_blob", "publish", "read_blob", "read_range", "size", "exists", "list", "delete",
             "delete_prefix", "allocate_slot")
#: What ``ops`` means when it is empty.
DEFAULT_OPS = ("write_blob", "publish")
_READ_OPS = ("read_blob", "read_range")
_WRITE_OPS = ("write_blob", "publish")


@dataclass(frozen=True)
class FaultSettings:
    """The faults (every field also is an option of the ``faulty`` kind and a key of the control file)."""

    latency_s: Seconds = 0.0  # sleep before each operation in `ops`
    transient_errors: NonNegativeInt = 0  # the first N operations in `ops` raise TransientTierError
    fail_every: NonNegativeInt = 0  # then every n-th operation in `ops` does (0: never)
    permanent_error: bool = False  # every operation in `ops` raises PermanentTierError
    # write_blob/publish fail with a "disk full" PermanentTierError once this many bytes were written
    disk_full_after: Size | None = None
    flip_bits_on_read: bool = False  # read_blob/read_range return the data with one bit flipped
    ops: list[str] = ()  # primitives the error and latency faults apply to (empty: write_blob and publish)
    fail_at: Literal["start", "midway"] = "midway"  # write_blob errors: before any data, or after one chunk
    seed: int = 0  # for the position of flipped bits

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in FAULT_OPS]
        if unknown:
            raise ValueError(f"ops: unknown primitive {unknown[0]!r} (known: {', '.join(FAULT_OPS)})")

    @property
    def active_ops(self) -> tuple[str, ...]:
        return tuple(self.ops) or DEFAULT_OPS


FAULT_FIELDS = tuple(f.name for f in dataclasses.fields(FaultSettings))


@dataclass(frozen=True)
class FaultyOptions(FaultSettings):
    # The wrapped tier: its kind and that kind's own options, e.g. {kind: local, path: /ckpt}.
    inner: dict[str, Any] = field(kw_only=True)
    control_file: str | None = None  # JSON object of FaultSettings fields, re-read when it changes

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.inner.get("kind"), str):
            raise ValueError("inner: expected a mapping with the wrapped tier's kind, e.g. "
                             "{kind: local, path: ...}")


def write_control_file(path: str | os.PathLike[str], **settings: Any) -> None:
    """Write (atomically: temp file + rename) a control file setting ``settings``; no settings clears it.

    Validated first, so a typo fails here rather than in the process that reads the file.
    """
    _validate(settings, f"control file {os.fspath(path)}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".faults-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(settings, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _validate(settings: dict[str, Any], source: str) -> FaultSettings:
    return build_dataclass(FaultSettings, dict(settings), "", source)


class FaultControl:
    """The faults and counters of every ``faulty`` tier of one name in this process."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.RLock()
        self._overrides: dict[str, Any] = {}
        self._file_values: dict[str, Any] = {}
        self._file_sig: tuple[int, int, int] | None = None
        self._key: Any = None
        self._settings: FaultSettings | None = None
        self._reset_counters()

    # ----- what tests call ---------------------------------------------------------------------------------
    def set(self, **settings: Any) -> None:
        """Replace the in-process overrides (validated) and restart the counters."""
        _validate(settings, f"FaultyTier.controls[{self.name!r}].set")
        with self._lock:
            self._overrides = dict(settings)
            self._key = None

    def update(self, **settings: Any) -> None:
        """Change some in-process overrides, keep the others; restarts the counters."""
        with self._lock:
            merged = {**self._overrides, **settings}
        self.set(**merged)

    def clear(self) -> None:
        """Drop the in-process overrides (the options and the control file apply again)."""
        self.set()

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``ops`` (operations seen), ``injected`` (faults and bit flips), ``bytes_written``."""
        with self._lock:
            return {"ops": self.ops_seen, "injected": self.injected, "bytes_written": self.bytes_written}

    # ----- what the tier calls -----------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.ops_seen = 0
        self.injected = 0
        self.bytes_written = 0
        self.rng = random.Random(0)

    def settings(self, options: FaultyOptions) -> FaultSettings:
        """The effective faults: options < control file < overrides. Restarts counters when they change."""
        with self._lock:
            if options.control_file:
                self._read_file(options.control_file)
            base = {name: getattr(options, name) for name in FAULT_FIELDS}
            key = (tuple(sorted(base.items(), key=lambda kv: kv[0])), self._file_sig,
                   json.dumps(self._overrides, sort_keys=True, default=str))
            if key != self._key:
                merged = {**base, **self._file_values, **self._overrides}
                self._settings = _validate(merged, f"faulty tier {self.name!r}")
                self._key = key
                self._reset_counters()
                self.rng = random.Random(self._settings.seed)
            assert self._settings is not None
            return self._settings

    def _read_file(self, path: str) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._file_sig, self._file_values = None, {}
            return
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._file_sig:
            return
        try:
            with open(path) as f:
                values = json.load(f) if st.st_size else {}
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the fault control file: {exc}", source=path) from exc
        if not isinstance(values, dict):
            raise ConfigError("expected a JSON object of fault settings", source=path)
        _validate(values, path)
        self._file_sig, self._file_values = sig, values


class FaultyTier(Tier):
    """A tier that forwards every primitive to an inner tier, injecting the configured faults."""

    kind = "faulty"
    Options = FaultyOptions
    capabilities = Capabilities()  # an instance reports its inner tier's

    #: name → the control shared by every faulty tier of that name in this process
    controls: ClassVar[dict[str, FaultControl]] = {}
    _controls_lock: ClassVar[threading.Lock] = threading.Lock()
    #: tier registry used to build inner tiers (None: the plugin manager's); tests may set it
    registry: ClassVar[Any] = None

    def __init__(self, name: str, options: FaultyOptions, context: TierContext | None = None, *,
                 inner: Tier | None = None, registry: Any = None):
        super().__init__(name, options, context)
        if inner is None:
            inner_cls, inner_options = self._inner_spec(options, registry)
            inner = inner_cls(name, inner_options, self.context)
        self.inner = inner
        self.capabilities = inner.capabilities
        self.control = self.control_for(name)

    @classmethod
    def control_for(cls, name: str) -> FaultControl:
        with cls._controls_lock:
            if name not in cls.controls:
                cls.controls[name] = FaultControl(name)
            return cls.controls[name]

    @classmethod
    def wrap(cls, inner: Tier, *, name: str | None = None, control_file: str | None = None,
             **settings: Any) -> FaultyTier:
        """Wrap an existing tier: ``FaultyTier.wrap(LocalTier(...), transient_errors=2)``."""
        options = build_dataclass(FaultyOptions, {"inner": {"kind": inner.kind}, "control_file": control_file,
                                                  **settings}, "", "FaultyTier.wrap")
        return cls(name or inner.name, options, inner.context, inner=inner)

    @classmethod
    def _inner_spec(cls, options: FaultyOptions, registry: Any = None) -> tuple[type[Tier], Any]:
        if registry is None:
            registry = cls.registry
        if registry is None:
            from tiered_ckpt.plugins import get_plugin_manager

            registry = get_plugin_manager().registries.tiers
        raw = dict(options.inner)
        kind = raw.pop("kind")
        try:
            inner_cls = registry.get(kind)
        except PluginError as exc:
            raise ConfigError(str(exc), key_path="inner.kind") from None
        return inner_cls, build_dataclass(inner_cls.Options, raw, "inner")

    @classmethod
    def capabilities_for(cls, options: FaultyOptions) -> Capabilities:
        inner_cls, inner_options = cls._inner_spec(options)
        return inner_cls.capabilities_for(inner_options)

    # ----- fault machinery ---------------------------------------------------------------------------------
    def settings(self) -> FaultSettings:
        return self.control.settings(self.options)

    def _before(self, op: str) -> tuple[FaultSettings, int]:
        """Count the operation (its number, or 0 when ``ops`` leaves it alone); sleep and raise as configured.

        write_blob with ``fail_at: midway`` raises later, from inside the stream of chunks.
        """
        s = self.settings()
        if op not in s.active_ops:
            return s, 0
        with self.control._lock:
            self.control.ops_seen += 1
            n = self.control.ops_seen
        if s.latency_s:
            time.sleep(s.latency_s)
        if not (op == "write_blob" and s.fail_at == "midway"):
            self._maybe_fail(s, op, n)
        return s, n

    def _maybe_fail(self, s: FaultSettings, op: str, n: int, key: str | None = None) -> None:
        if not n:
            return
        if s.permanent_error:
            self._count_injected()
            raise PermanentTierError(f"injected permanent fault ({op}, operation {n})", tier=self.name,
                                     key=key)
        if n <= s.transient_errors or (s.fail_every and n % s.fail_every == 0):
            self._count_injected()
            raise TransientTierError(f"injected transient fault ({op}, operation {n})", tier=self.name,
                                     key=key)

    def _count_injected(self) -> None:
        with self.control._lock:
            self.control.injected += 1

    def _disk_full(self, s: FaultSettings, key: str, more: int) -> None:
        if s.disk_full_after is not None and self.control.bytes_written + more > s.disk_full_after:
            self._count_injected()
            cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise PermanentTierError(f"disk full (ENOSPC): injected after {s.disk_full_after} bytes",
                                     tier=self.name, key=key) from cause

    def _chunks(self, s: FaultSettings, n: int, key: str, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        """The caller's chunks with the disk-full budget applied and, for ``fail_at: midway``, the error
        raised when the inner tier asks for more after the first chunk (before the producer is asked): it has
        data in flight by then and must clean it up."""
        midway = n if s.fail_at == "midway" else 0
        it = iter(chunks)
        written = i = 0
        while True:
            if i == 1:  # before asking the producer for more
                self._maybe_fail(s, "write_blob", midway, key)
            try:
                chunk = next(it)
            except StopIteration:
                break
            size = _nbytes(chunk)
            self._disk_full(s, key, written + size)
            written += size
            i += 1
            yield chunk
        if i == 0:
            self._maybe_fail(s, "write_blob", midway, key)

    def _flip(self, data: bytearray | torch.Tensor) -> None:
        """Flip one bit of ``data`` in place, at a position drawn from the seeded generator."""
        n = data.numel() if isinstance(data, torch.Tensor) else len(data)
        if n == 0:
            return
        with self.control._lock:
            pos = self.control.rng.randrange(n)
            bit = 1 << self.control.rng.randrange(8)
            self.control.injected += 1
        data[pos] ^= bit

    # ----- primitives --------------------------------------------------------------------------------------
    def write_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        return self._write(key, chunks, private=False)

    def write_private_blob(self, key: str, chunks: Iterable[Chunk]) -> int:
        # the same faults as write_blob (op "write_blob"); the inner tier still stores it its own way
        return self._write(key, chunks, private=True)

    def _write(self, key: str, chunks: Iterable[Chunk], *, private: bool) -> int:
        check_key(key)
        s, n = self._before("write_blob")
        if (n and s.fail_at == "midway") or s.disk_full_after is not None:
            chunks = self._chunks(s, n, key, chunks)
        nbytes = (self.inner.write_private_blob if private else self.inner.write_blob)(key, chunks)
        with self.control._lock:
            self.control.bytes_written += nbytes
        return nbytes

    def publish(self, key: str, data: bytes) -> None:
        check_key(key)
        s, _ = self._before("publish")
        self._disk_full(s, key, len(data))
        self.inner.publish(key, data)
        with self.control._lock:
            self.control.bytes_written += len(data)

    def read_blob(self, key: str) -> torch.Tensor:
        s, _ = self._before("read_blob")
        out = self.inner.read_blob(key)
        if s.flip_bits_on_read:
            out = out.clone()  # never corrupt what the inner tier stores (zero-copy reads are views of it)
            self._flip(out)
        return out

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        s, _ = self._before("read_range")
        data = self.inner.read_range(key, offset, length)
        if s.flip_bits_on_read:
            flipped = bytearray(data)
            self._flip(flipped)
            return bytes(flipped)
        return data

    def size(self, key: str) -> int:
        self._before("size")
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        self._before("exists")
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        self._before("list")
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._before("delete")
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self._before("delete_prefix")
        self.inner.delete_prefix(prefix)

    def allocate_slot(self, key: str, nbytes: int) -> torch.Tensor:
        self._before("allocate_slot")
        return self.inner.allocate_slot(key, nbytes)

    # The rest of the Tier interface is the inner tier's, without faults: gc, the CLI and staging see through it.
    @property
    def location(self) -> str | None:
        return self.inner.location

    def missing_location(self) -> str | None:
        return self.inner.missing_location()

    def temp_files(self) -> list[str]:
        return self.inner.temp_files()

    def remove_temp_file(self, key: str) -> None:
        self.inner.remove_temp_file(key)

    def unfinished_uploads(self, min_age_s: float = 0.0,
                           keys: Callable[[str], bool] | None = None) -> list[UnfinishedUpload]:
        return self.inner.unfinished_uploads(min_age_s, keys)

    def abort_upload(self, upload: UnfinishedUpload) -> None:
        self.inner.abort_upload(upload)

    def modified(self, key: str) -> float | None:
        return self.inner.modified(key)

    @classmethod
    def resolve_enabled(cls, enabled: bool | str, options: FaultyOptions, *, name: str = "") -> bool:
        inner_cls, inner_options = cls._inner_spec(options)
        return inner_cls.resolve_enabled(enabled, inner_options, name=name)

    @classmethod
    def check_usable(cls, options: FaultyOptions) -> None:
        inner_cls, inner_options = cls._inner_spec(options)
        try:
            inner_cls.check_usable(inner_options)
        except ConfigError as exc:  # the inner tier's key, as the configuration spells it
            raise ConfigError(exc.message, source=exc.source, key_path=f"inner.{exc.key_path}" if exc.key_path
                              else "inner") from None

    def describe(self) -> str:
        return f"faulty({self.inner.describe()})"

    def close(self) -> None:
        self.inner.close()


def _nbytes(chunk: Chunk) -> int:
    if isinstance(chunk, torch.Tensor):  # without moving a device tensor to the host
        return chunk.numel() * chunk.element_size()
    return len(as_memoryview(chunk))
