"""The plugin manager: built-ins first, through the same hooks, then the ``tiered_ckpt`` entry points."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginError
from .events import Event
from .registry import Registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tiered_ckpt"
BUILTIN_PLUGINS = ("tiered_ckpt.builtin",)


@dataclass
class Registries:
    tiers: Registry
    layouts: Registry
    codecs: Registry


class PluginManager:
    """Loads plugins once and builds the registries from their hooks."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: tuple[Any, ...] = ()):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for modname in BUILTIN_PLUGINS:
            module = __import__(modname, fromlist=["_"])
            self.pm.register(module, name=modname)
        if load_entry_points:
            self._load_entry_points()
        for plugin in extra_plugins:
            self.pm.register(plugin)
        self.registries = self._build_registries()

    def _load_entry_points(self) -> None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if self.pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must say who it is
                raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            self.pm.register(plugin, name=ep.name)

    def _call_register(self, hook_name: str, registry: Registry) -> None:
        # Call each implementation separately so the registry knows which plugin is adding.
        hook = getattr(self.pm.hook, hook_name)
        for impl in reversed(hook.get_hookimpls()):
            registry.provider = impl.plugin_name
            impl.function(registry=registry)
        registry.provider = "<direct>"

    def _build_registries(self) -> Registries:
        regs = Registries(Registry("tier kind"), Registry("layout"), Registry("codec"))
        self._call_register("tiered_ckpt_register_tiers", regs.tiers)
        self._call_register("tiered_ckpt_register_layouts", regs.layouts)
        self._call_register("tiered_ckpt_register_codecs", regs.codecs)
        return regs

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register an observer plugin at run time (only event hooks take effect after start-up)."""
        self.pm.register(plugin, name=name)

    def unregister(self, plugin: Any) -> None:
        self.pm.unregister(plugin)

    def emit(self, event: Event) -> None:
        for impl in self.pm.hook.tiered_ckpt_on_event.get_hookimpls():
            try:
                impl.function(event=event)
            except Exception:  # observation must never break a save
                log.exception("event observer %s failed on %s", impl.plugin_name, event.kind)


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        return _default
