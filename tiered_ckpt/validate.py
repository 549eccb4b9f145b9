"""Build frozen dataclasses from plain YAML/JSON data, with errors that name the key path.

One small validator serves the top-level config and every tier kind's own ``Options`` dataclass, so a third-party
tier gets the same strict checking (unknown keys are errors) by declaring typed fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import pathlib
import re
import types
import typing
from typing import Any, Literal, NewType, Union

from .errors import ConfigError, PluginError

# A byte count: an int, or a string with a unit ("8GiB", "512 MB", "1e9").
Size = NewType("Size", int)
# Integers with a sign constraint; the message says which.
PositiveInt = NewType("PositiveInt", int)
NonNegativeInt = NewType("NonNegativeInt", int)
# A duration in seconds: a number, or a string with a unit ("30s", "5m", "250ms").
Seconds = NewType("Seconds", float)

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SECONDS_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """``8GiB`` → 8589934592. Raises ValueError with a readable reason."""
    if isinstance(value, bool):
        raise ValueError("expected a byte size (e.g. 8GiB), got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a non-negative byte size, got {value}")
        return value
    if isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            size = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if math.isfinite(size):  # "1e999" is no size (and int() of it an OverflowError)
                return int(size)
    raise ValueError(f"expected a byte size such as 512MiB or 8GiB, got {value!r}")


def parse_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a duration (e.g. 30s), got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value) if isinstance(value, float) or abs(value) < 2**1000 else math.inf
        if not 0 <= seconds < math.inf:  # NaN fails this too
            raise ValueError(f"expected a finite, non-negative duration, got {value}")
        return seconds
    if isinstance(value, str):
        m = _NUMBER_UNIT.match(value)
        if m and m.group(2).lower() in _SECONDS_UNITS:
            seconds = float(m.group(1)) * _SECONDS_UNITS[m.group(2).lower()]
            if seconds < math.inf:
                return seconds
    raise ValueError(f"expected a duration such as 30s or 5m, got {value!r}")


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__}"
    return repr(value)


def _type_name(tp: Any) -> str:
    if tp is Size:
        return "a byte size"
    if tp is PositiveInt:
        return "a positive integer"
    if tp is NonNegativeInt:
        return "a non-negative integer"
    if tp is Seconds:
        return "a duration"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if _is_path_type(tp):
        return "a path"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, value: Any, path: str, source: str | None) -> Any:
    """Check ``value`` against the annotation ``tp``; return the converted value or raise ConfigError."""

    def fail(expected: str | None = None, detail: str | None = None) -> ConfigError:
        msg = detail or f"expected {expected or _type_name(tp)}, got {_describe(value)}"
        return ConfigError(msg, source=source, key_path=path)

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for arg in non_none:
            try:
                return coerce(arg, value, path, source)
            except ConfigError as exc:
                errors.append(exc)
        if len(non_none) == 1:
            raise errors[0]
        raise fail(" or ".join(_type_name(a) for a in non_none))
    if tp is Size:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise fail(detail=str(exc)) from None
    if tp is Seconds:
        try:
            return parse_seconds(value)
        except ValueError as exc:
            raise fail(detail=str(exc)) from None
    if origin is Literal:
        if value in typing.get_args(tp) and not (isinstance(value, bool) and True not in typing.get_args(tp)):
            return value
        raise fail()
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail()
    if tp in (int, PositiveInt, NonNegativeInt):
        if isinstance(value, int) and not isinstance(value, bool):
            if (tp is PositiveInt and value <= 0) or (tp is NonNegativeInt and value < 0):
                raise fail()
            return value
        raise fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    if _is_path_type(tp):
        if isinstance(value, (str, os.PathLike)) and not isinstance(value, bool) and os.fspath(value) != "":
            return tp(value)
        raise fail()
    if origin is dict:
        if not isinstance(value, dict):
            raise fail()
        ktp, vtp = typing.get_args(tp) or (Any, Any)
        # A plain dict, not a read-only proxy: configs travel to the drain worker process by pickle.
        return {coerce(ktp, k, f"{path}.{k}", source): coerce(vtp, v, f"{path}.{k}", source) for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise fail()
        (etp,) = typing.get_args(tp)[:1] or (Any,)
        return tuple(coerce(etp, v, f"{path}[{i}]", source) for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build_dataclass(tp, value, path, source)
    raise PluginError(f"{path}: annotation {tp!r} cannot be read from a configuration file ({SUPPORTED_TYPES})")


#: What a field of a configuration dataclass (a tier kind's ``Options``) may be annotated with.
SUPPORTED_TYPES = ("supported: str, bool, int, float, pathlib.Path, Literal[...], Size, Seconds, PositiveInt, "
                   "NonNegativeInt, Any, a dataclass, list[T], tuple[T, ...], dict[K, V], and unions of these "
                   "(T | None for an optional key)")


def _is_path_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, pathlib.PurePath)


def _supported(tp: Any) -> bool:
    if tp is Any or tp in (str, bool, int, float, Size, Seconds, PositiveInt, NonNegativeInt, type(None)):
        return True
    if _is_path_type(tp) or dataclasses.is_dataclass(tp):
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return True
    if origin in (Union, types.UnionType, list, tuple, dict):
        return all(a is Ellipsis or _supported(a) for a in typing.get_args(tp))
    return tp in (list, tuple, dict)


@functools.cache
def _checked_hints(cls: type) -> dict[str, Any]:
    """The field annotations of ``cls``, refused at once (naming the class and field) where a configuration file
    could never give a value of that type: a plugin author finds out at the first load, not a user at a typo."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # a forward reference that does not resolve, say
        raise PluginError(f"{cls.__module__}.{cls.__qualname__}: cannot read its field annotations: {exc}") from None
    for f in dataclasses.fields(cls):
        if f.init and not _supported(hints[f.name]):
            raise PluginError(f"{cls.__module__}.{cls.__qualname__}.{f.name}: annotation {hints[f.name]!r} "
                              f"cannot be read from a configuration file ({SUPPORTED_TYPES}; see docs/plugins.md)")
    return hints


def suggest(key: Any, candidates: Any) -> str:
    """``; did you mean 'keep'?`` for the closest of ``candidates`` to a misspelt ``key``, or ``""``."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def shown_key(key: Any) -> str:
    """A key as a key path shows it: bare when printable, repr() otherwise."""
    return key if isinstance(key, str) and key.isprintable() and key.strip() == key and key else repr(key)


def unknown_key_error(key: Any, allowed: Any, path: str, source: str | None, where: str = "here") -> ConfigError:
    known = ", ".join(sorted(allowed))
    return ConfigError(f"unknown key (allowed {where}: {known}){suggest(key, allowed)}", source=source,
                       key_path=_join(path, shown_key(key)))


def field_names(cls: type) -> list[str]:
    """The keys a configuration mapping for ``cls`` may hold."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


def build_dataclass(cls: type, data: Any, path: str = "", source: str | None = None) -> Any:
    """Validate ``data`` (a mapping) into ``cls``. Unknown keys and missing required keys are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {_describe(data)}", source=source, key_path=path or "<root>")
    hints = _checked_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise unknown_key_error(unknown[0], fields, path, source)
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        if name in data:
            kwargs[name] = coerce(hints[name], data[name], sub, source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"required key is missing (expected {_type_name(hints[name])})",
                              source=source, key_path=sub)
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # a __post_init__ check; its key path is relative to this mapping
        where = exc.key_path
        if where and where.split(".", 1)[0].split("[", 1)[0] in fields:
            where = _join(path, where)
        raise ConfigError(exc.message, source=exc.source or source, key_path=where or path or "<root>") from None
    except (ValueError, TypeError) as exc:  # a dataclass __post_init__ check
        # "device: expected ..." names the field: the key path does, so the message reads tiers[0].device: ...
        message = str(exc)
        head, sep, rest = message.partition(": ")
        if sep and head in fields:
            raise ConfigError(rest, source=source, key_path=_join(path, head)) from None
        raise ConfigError(message, source=source, key_path=path or "<root>") from None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
