"""Name → class registries for tier kinds, layouts and codecs."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import PluginError

T = TypeVar("T")


class Registry(Generic[T]):
    """A registry of named classes; each name has exactly one provider.

    ``provider`` is set by the plugin manager to the name of the plugin whose hook is running, so conflicts can
    name both sides.
    """

    def __init__(self, what: str, base: type | None = None, check: Callable[[type], str | None] | None = None):
        self.what = what
        self.base = base  # what every entry must subclass
        self.check = check  # more of what an entry must be: why it is not, or None
        self._entries: dict[str, tuple[type[T], str]] = {}
        self.provider = "<direct>"

    def add(self, name: str, cls: type[T]) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"{self.provider}: {self.what} name must be a non-empty string, got {name!r}")
        # Refused here, naming the plugin: taken as it came, a wrong one failed later with a bare AttributeError
        # or TypeError from wherever it was first used (a plugin author's trial).
        if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
            base = f"{self.base.__module__}.{self.base.__qualname__}"
            got = f"an instance of {type(cls).__qualname__} (register the class itself)" \
                if isinstance(cls, self.base) else repr(cls)
            raise PluginError(f"{self.provider}: {self.what} {name!r} must be a subclass of {base}, got {got}")
        why = self.check(cls) if self.check is not None else None
        if why:
            raise PluginError(f"{self.provider}: {self.what} {name!r} ({cls.__module__}.{cls.__qualname__}) {why}")
        if name in self._entries:
            _, other = self._entries[name]
            raise PluginError(
                f"{self.what} {name!r} is provided by two plugins: {other!r} and {self.provider!r}; "
                "uninstall one of them or rename its kind"
            )
        self._entries[name] = (cls, self.provider)

    def get(self, name: str) -> type[T]:
        try:
            return self._entries[name][0]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            close = difflib.get_close_matches(name, sorted(self._entries), n=1, cutoff=0.6) \
                if isinstance(name, str) else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(f"unknown {self.what} {name!r} (known: {known}){hint}") from None

    def provider_of(self, name: str) -> str:
        return self._entries[name][1]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def items(self) -> list[tuple[str, type[T], str]]:
        return [(n, c, p) for n, (c, p) in sorted(self._entries.items())]
