"""Load Megatron-LM's torch pickles safely, without Megatron installed.

:func:`load` is ``torch.load(weights_only=True)`` plus the allow-list Megatron registers when
``megatron.core`` is imported (docs/megatron-format.md, "What Megatron pickles (safe loading)"): ``argparse.Namespace``,
``types.SimpleNamespace``, ``PosixPath``, ``io.BytesIO``, ``signal.Signals``, ``torch.Generator``, numpy
arrays, dtypes and scalars, and Megatron's own enums and ``OptimizerConfig``. Nothing outside it is ever
called: such a file raises :class:`UnsafePickleError` naming the file and the offending globals, unless
``trust_pickles=True`` (then a full unpickle, logged).

Megatron's classes are replaced by inert stand-ins (:mod:`._standins`) unless Megatron is already imported in
this process, in which case its real classes are used. A stand-in keeps its module, qualname and value, and
pickles again under the same global name, so a re-saved file still loads in Megatron.

The allow-list is active only during our own loads (``torch.serialization.safe_globals``, reference counted so
concurrent loads share it); entries are ``(object, name)`` pairs, so leaving never removes entries that
Megatron or the user registered themselves.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import re
import struct
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import DecodeError, TieredCkptError, UnsafePickleError
from ..memfile import MemoryReader
from ..tiers.base import as_memoryview
from . import _standins

log = logging.getLogger(__name__)

# Public here: undo the placeholder modules that pickling a stand-in registers (see _standins).
remove_stand_in_modules = _standins.remove_stand_in_modules

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")
# Messages of torch's weights-only unpickler that mean "this would run code we do not allow".
# Anything else it refuses (say, "Unsupported operand" for opcodes of pickle protocols > 2) is reported as
# unsafe too: it cannot be loaded safely, and trust_pickles=True may load it.
_UNSAFE_MARKERS = ("Unsupported global", "unsupported GLOBAL", "Trying to call reduce", "Can only build",
                   "Can only create new object", "Can only append", "Can only set", "Can only extend",
                   "is blocked")
_DECODE_MARKERS = ("PytorchStreamReader", "failed finding central directory", "not a valid zip",
                   "invalid load key", "pickle data was truncated", "Ran out of input")


def load(
    path: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    trust_pickles: bool = False,
    mmap: bool = False,
) -> Any:
    """Load a Megatron ``model_optim_rng.pt`` / ``distrib_optim.pt`` (or any torch file) with the allow-list.
    """
    where = os.fspath(path)
    return _load(lambda: where, where, map_location=map_location, trust_pickles=trust_pickles, mmap=mmap)


def load_bytes(
    data: bytes | bytearray | memoryview,
    *,
    where: str = "<bytes>",
    map_location: Any = "cpu",
    trust_pickles: bool = False,
) -> Any:
    """:func:`load` for a file's content already in memory (read without copying it)."""
    view = memoryview(data).cast("B")
    return _load(lambda: MemoryReader(view), where, map_location=map_location, trust_pickles=trust_pickles)


def load_views(
    blob: torch.Tensor,
    *,
    where: str = "<bytes>",
    map_location: Any = "cpu",
    trust_pickles: bool = False,
) -> Any:
    """:func:`load_bytes` whose tensors are views of ``blob`` (a 1-D uint8 CPU tensor holding the file) instead of
    copies of it: for bytes this process owns, already read into private memory, this saves a second copy of every
    storage (and its page faults). Storages are slices of ``blob``'s storage, exactly as ``torch.load(mmap=True)``
    slices a mapped file, and keep that memory alive; the unpickler and allow-list are the same as :func:`load`'s.

    Anything this path does not handle (not a zip file, a big-endian file, a refused pickle, a torch without the
    hook it needs) goes through :func:`load_bytes`, which copies and raises the usual errors.
    """
    view = _views_source(blob)
    if view is None:
        return load_bytes(as_memoryview(blob), where=where, map_location=map_location, trust_pickles=trust_pickles)
    try:
        return _load_views(blob, view, where, map_location)
    except Exception as exc:  # the reference path below decides: it loads, or raises the error users expect
        fast_error = exc
    result = load_bytes(view, where=where, map_location=map_location, trust_pickles=trust_pickles)
    if not isinstance(fast_error, pickle.UnpicklingError | DecodeError):  # loads, but not as it should: say so
        log.warning("%s: loaded with copies: the zero-copy path failed (%s: %s)", where, type(fast_error).__name__,
                    _first_line(fast_error))
    return result


def _views_source(blob: torch.Tensor) -> memoryview | None:
    """``blob``'s bytes if the zero-copy path applies: a contiguous uint8 CPU tensor holding a zip file, and a torch
    whose loader accepts a ready storage (``overall_storage``, what ``torch.load(mmap=True)`` passes)."""
    if (blob.device.type != "cpu" or blob.dtype != torch.uint8 or blob.dim() != 1 or not blob.is_contiguous()
            or blob.numel() < 4 or not _has_storage_hook()):
        return None
    view = memoryview(blob.numpy()).cast("B")
    return view if view[:4] == b"PK\x03\x04" else None


@functools.cache
def _has_storage_hook() -> bool:
    """Whether this torch has the internals :func:`_load_views` uses (private, but what ``torch.load(mmap=True)``
    itself calls since torch 2.1); without them every load copies, silently."""
    import inspect

    ts = torch.serialization
    try:
        if not all(callable(getattr(ts, name, None)) for name in
                   ("_open_zipfile_reader", "_is_torchscript_zip", "_load")) or ts._weights_only_unpickler is None:
            return False
        return "overall_storage" in inspect.signature(ts._load).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _load_views(blob: torch.Tensor, view: memoryview, where: str, map_location: Any) -> Any:
    ts = torch.serialization
    storage = blob.untyped_storage()
    start = blob.storage_offset()
    if start or storage.nbytes() != blob.numel():
        storage = storage[start:start + blob.numel()]  # a view: offsets in the zip are relative to the file
    with allow_megatron_globals(), _decode_errors(where), ts._open_zipfile_reader(MemoryReader(view)) as zf:
        if ts._is_torchscript_zip(zf):
            raise DecodeError(f"{where}: a TorchScript archive")  # load_bytes refuses it with torch's message
        # torch swaps a foreign byte order in place (and guesses one for files without the record): that would
        # write into blob, so such files take the copying path.
        if not zf.has_record("byteorder") or zf.get_record("byteorder") != sys.byteorder.encode():
            raise DecodeError(f"{where}: not marked {sys.byteorder}-endian")
        return ts._load(zf, map_location, ts._weights_only_unpickler, overall_storage=storage, encoding="utf-8")


def unsafe_globals(source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> list[str]:
    """The globals a torch zip file names that our allow-list does not cover (a static scan; loads nothing).
    """
    f = MemoryReader(memoryview(source).cast("B")) if isinstance(source, bytes | bytearray | memoryview) \
        else os.fspath(source)
    with allow_megatron_globals():
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))


def _load(open_source: Any, where: str, *, map_location: Any, trust_pickles: bool, mmap: bool = False) -> Any:
    try:
        return _safe_load(open_source(), where, map_location=map_location, mmap=mmap)
    except UnsafePickleError as exc:
        if not trust_pickles:
            raise
        found = getattr(exc, "globals", [])
        log.warning("%s: full unpickling because trust_pickles=True; the safe loader refused it (%s)", where,
                    "globals outside the allow-list: " + ", ".join(found) if found else exc)
        with _decode_errors(where):
            return torch.load(open_source(), map_location=map_location, weights_only=False,
                              pickle_module=_standins.trusting_pickle_module(), mmap=mmap)


def _safe_load(f: Any, where: str, *, map_location: Any, mmap: bool) -> Any:
    with allow_megatron_globals(), _decode_errors(where):
        try:
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise _translate(exc, where, f) from None


@contextmanager
def _decode_errors(where: str) -> Iterator[None]:
    """Turn what torch's readers raise on garbage or truncated files into DecodeError naming the file."""
    try:
        yield
    except (TieredCkptError, FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except RuntimeError as exc:  # also raised for reasons unrelated to the file (map_location=cuda, ...)
        if any(m in str(exc) for m in _DECODE_MARKERS):
            raise DecodeError(f"{where}: not a readable torch file: {_first_line(exc)}") from exc
        raise
    except (EOFError, ValueError, KeyError, IndexError, OSError, zipfile.BadZipFile, struct.error) as exc:
        kind = type(exc).__name__  # KeyError, OSError EINVAL, EOFError, ... depending on where it breaks
        raise DecodeError(f"{where}: not a readable torch file: {kind}: {_first_line(exc)}") from exc


def _translate(exc: pickle.UnpicklingError, where: str, f: Any) -> Exception:
    """Map torch's weights-only failure to UnsafePickleError (with every offending global we can find)."""
    text = str(exc)
    reason = (text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines() or [repr(exc)])[0]
    if not any(m in text for m in _UNSAFE_MARKERS):
        if any(m in text for m in _DECODE_MARKERS):
            return DecodeError(f"{where}: not a readable torch file: {reason}")
        return _unsafe(f"{where}: refused by the weights-only unpickler: {reason}", where, [])
    found = _GLOBAL_IN_MESSAGE.findall(reason)
    try:  # the static scan lists all of them, not only the first one torch stumbled on
        if hasattr(f, "seek"):
            f.seek(0)
        found = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(f))) or found
    except Exception:  # not a zip file, or unreadable: keep what the message said
        pass
    if found:
        message = (f"{where}: refusing to unpickle {', '.join(found)}: not in the allow-list of Megatron "
                   "checkpoints (unpickling it could run arbitrary code); pass trust_pickles=True only if "
                   "you trust this file")
    else:
        message = f"{where}: refused by the weights-only unpickler: {reason}"
    return _unsafe(message, where, found)


def _unsafe(message: str, where: str, found: list[str]) -> UnsafePickleError:
    err = UnsafePickleError(message)
    err.path = where  # type: ignore[attr-defined]
    err.globals = found  # type: ignore[attr-defined]
    return err


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------------------
# the allow-list, active only while we load

_lock = threading.Lock()
_depth = 0
_active: Any = None  # the torch.serialization.safe_globals context while _depth > 0


@contextmanager
def allow_megatron_globals() -> Iterator[None]:
    """Make torch's weights-only unpickler accept Megatron's allow-list (and our stand-ins) in this block."""
    global _depth, _active
    with _lock:
        if _depth == 0:
            _active = torch.serialization.safe_globals(allow_list())
            _active.__enter__()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _active.__exit__(None, None, None)
                _active = None


def allow_list() -> list[tuple[Any, str]]:
    """``(object, "module.qualname")`` pairs: the real safe classes/functions, then Megatron's (real if
    imported)."""
    import argparse
    import pathlib
    import signal
    import types

    import numpy as np

    entries: list[tuple[Any, str]] = [
        (argparse.Namespace, "argparse.Namespace"),
        (types.SimpleNamespace, "types.SimpleNamespace"),
        (pathlib.PosixPath, "pathlib.PosixPath"),
        (pathlib.PosixPath, "pathlib._local.PosixPath"),  # Python 3.13's name
        (io.BytesIO, "_io.BytesIO"),
        (io.BytesIO, "io.BytesIO"),
        (signal.Signals, "signal.Signals"),
        (torch.Generator, "torch._C.Generator"),
        (torch.Generator, "torch.Generator"),
        (np.ndarray, "numpy.ndarray"),
        (np.dtype, "numpy.dtype"),
    ]
    multiarray = _numpy_multiarray()
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 / numpy 2 pickles
        entries.append((multiarray._reconstruct, f"{module}._reconstruct"))
        entries.append((multiarray.scalar, f"{module}.scalar"))
    # dtype objects are rebuilt by BUILD on an instance of their class: the class must be allowed too.
    for char in "?bBhHiIlLqQefdgFDGSU":
        cls = type(np.dtype(char))
        entries.append((cls, f"{cls.__module__}.{cls.__qualname__}"))
    entries.extend(_standins.megatron_allow_list())
    return entries


def _numpy_multiarray() -> Any:
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray
    return multiarray
