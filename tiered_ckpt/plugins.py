"""The plugin manager, on pluggy: the built-ins, the ``tiered_ckpt`` entry points and a caller's own plugins.

Every plugin goes through one path: the built-ins are an entry point of the ``tiered_ckpt`` group like any
installed plugin (:meth:`PluginManager._load_entry_points`), and every plugin, however given, is registered by
:meth:`PluginManager._add`: pluggy holds, for each plugin, its marked hook
functions, each wrapped once when it is registered, so that

* a registration hook knows which plugin is adding (a duplicate name is an error naming both plugins), and
* an event observer that raises is logged and the others still run (pluggy itself stops a hook call at the first
  exception, so the isolation has to sit around each implementation, not around the call).

Hooks are then called the pluggy way, ``pm.hook.<name>(...)``, and ``check_pending`` runs at start-up: a misspelt
hook is an error naming the plugin and the hook, never silently ignored.

The drain worker (a separate process) rebuilds the same plugins from a :class:`PluginSpec`: entry-point names,
importable module names and pickled plugin objects. A plugin that cannot get there is an error when the engine is
built (:meth:`PluginManager.for_engine`), not a failed save. See docs/plugins.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import logging
import pickle
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .errors import PluginError
from .events import Event
from .registry import Registry
from .tiers.base import Tier, worker_source
from .validate import suggest

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tiered_ckpt"
# The built-ins are an entry point of the same group, declared here rather than in the package's metadata, so they
# load through the same code as every installed plugin, also where entry points are skipped or the metadata is
# absent (a source checkout on PYTHONPATH).
BUILTIN_ENTRY_POINTS = (EntryPoint(name="tiered_ckpt.builtin", value="tiered_ckpt.builtin", group=ENTRY_POINT_GROUP),)
BUILTIN_PLUGINS = tuple(ep.name for ep in BUILTIN_ENTRY_POINTS)
EVENT_HOOK = "tiered_ckpt_on_event"
REGISTRATION_HOOKS = ("tiered_ckpt_register_tiers", "tiered_ckpt_register_layouts", "tiered_ckpt_register_codecs")
HOOK_NAMES = (*REGISTRATION_HOOKS, EVENT_HOOK)
_UNATTRIBUTED = "<direct>"


@dataclass
class Registries:
    tiers: Registry
    layouts: Registry
    codecs: Registry
    # How a drain worker rebuilds the plugins behind these registries (None: the default plugins). load_config
    # copies it into the Config, which is what the worker receives.
    spec: PluginSpec | None = None


@dataclass(frozen=True)
class PluginSpec:
    """The plugins a drain worker rebuilds, in registration order, as plain picklable data.

    ``plugins``: ``(name, how, what)`` with ``how`` one of ``"entry_point"`` (``what``: the entry point's name),
    ``"module"`` (an importable module name) or ``"object"`` (the plugin pickled). Only plugins that register
    kinds, layouts or codecs are listed: observers run in the training process alone. ``unreachable``:
    ``(name, why)`` of the plugins that cannot be rebuilt in another process.
    """

    plugins: tuple[tuple[str, str, Any], ...] = ()
    unreachable: tuple[tuple[str, str], ...] = ()


class _Hooks:
    """What pluggy holds for one plugin: its hook functions, wrapped (see the module docstring)."""

    def __init__(self, plugin: Any, name: str):
        self.plugin = plugin
        self.name = name

    def __repr__(self) -> str:
        return f"<tiered_ckpt plugin {self.name!r}: {self.plugin!r}>"


def _positional(fn: Callable[..., Any]) -> list[str]:
    """The arguments pluggy passes to ``fn``, in order: its positional parameters without a default."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in kinds and p.default is inspect.Parameter.empty]


def _wrapped(hook: str, fn: Callable[..., Any], plugin_name: str, opts: dict[str, Any]) -> Callable[..., Any]:
    if opts.get("wrapper") or opts.get("hookwrapper"):
        return fn  # a wrapper around the others: pluggy must see the generator itself
    if hook == EVENT_HOOK:
        @functools.wraps(fn)
        def observe(*args: Any) -> Any:
            try:
                return fn(*args)
            except Exception:  # observation must never break a save
                kind = getattr(args[0], "kind", "?") if args else "?"
                log.exception("event observer %r failed on a %r event; it is skipped for this event",
                              plugin_name, kind)
                return None

        return pluggy.HookimplMarker(hookspecs.PROJECT)(**opts)(observe)
    if hook in REGISTRATION_HOOKS:
        names = _positional(fn)
        where = names.index("registry") if "registry" in names else None

        @functools.wraps(fn)
        def register(*args: Any) -> Any:
            registry = args[where] if where is not None else None
            if isinstance(registry, Registry):
                registry.provider = plugin_name
            try:
                return fn(*args)
            finally:
                if isinstance(registry, Registry):
                    registry.provider = _UNATTRIBUTED

        return pluggy.HookimplMarker(hookspecs.PROJECT)(**opts)(register)
    return fn  # a hook nobody declared: check_pending names it


def _worker_safe_pickle(plugin: Any) -> tuple[bytes | None, str | None]:
    """``plugin`` pickled, and None; or None and why another process could not unpickle it."""
    try:
        data = pickle.dumps(plugin)
    except Exception as exc:  # lambdas, local classes and functions, open handles
        return None, f"it cannot be pickled ({type(exc).__name__}: {exc})"
    try:
        _MainRefusingUnpickler(io.BytesIO(data)).load()
    except _FromMain as exc:
        return None, f"it refers to {exc}, defined in the script being run (__main__), which the drain worker " \
                     "does not import"
    except Exception as exc:
        return None, f"it cannot be unpickled again ({type(exc).__name__}: {exc})"
    return data, None


class _FromMain(Exception):
    pass


class _MainRefusingUnpickler(pickle.Unpickler):
    """Unpickles as a spawned worker would: ``__main__`` there is not the user's script."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__":
            raise _FromMain(f"__main__.{name}")
        return super().find_class(module, name)


def _module_origin(module: Any) -> tuple[str | None, str | None]:
    """The name a worker imports ``module`` by, and None; or None and why it cannot."""
    name = getattr(module, "__name__", None)
    if name == "__main__":
        return None, "it is the script being run (__main__), which the drain worker does not import"
    try:
        found = importlib.util.find_spec(name) if isinstance(name, str) else None
    except (ImportError, ValueError):
        found = None
    if found is None:
        return None, f"no module named {name!r} can be imported by name"
    return name, None


class PluginManager:
    """Loads plugins once and builds the registries from their hooks."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: Iterable[Any] = ()):
        self._start(entry_point_names=None if load_entry_points else (), extra=[(p, None) for p in extra_plugins])

    def _start(self, *, entry_point_names: Iterable[str] | None, extra: list[tuple[Any, str | None]],
               objects: Iterable[tuple[str, Any]] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._hooks: dict[str, _Hooks] = {}
        self._origins: dict[str, tuple[str, Any]] = {}  # builtins and entry points; others: spec() looks
        self._lock = threading.Lock()
        self._load_entry_points(entry_point_names)
        for plugin, name in extra:
            self._add(plugin, name)
        for name, plugin in objects:
            self._add(plugin, name)
        self._check_pending()
        self.registries = self._build_registries()
        self.registries.spec = self.spec()

    # ----- registration ------------------------------------------------------------------------------------
    def _load_entry_points(self, names: Iterable[str] | None) -> None:
        """The built-ins, then every installed plugin of the ``tiered_ckpt`` group (``names`` None) or those named."""
        wanted = None if names is None else set(names)
        found: dict[str, str] = {}  # entry point name -> what it names
        installed = [(ep, "entry_point") for ep in entry_points(group=ENTRY_POINT_GROUP)]
        for ep, how in [(ep, "builtin") for ep in BUILTIN_ENTRY_POINTS] + installed:
            if how != "builtin" and wanted is not None and ep.name not in wanted:
                continue
            if ep.name in found:
                if found[ep.name] == ep.value:  # one distribution seen twice on the path (an editable install)
                    continue
                # Which one won depended on the path's order, and the other's kinds vanished without a word (a
                # plugin author's trial: a copied pyproject.toml kept the name of the faults plugin).
                raise PluginError(f"two plugins are installed under the entry point name {ep.name!r} of group "
                                  f"{ENTRY_POINT_GROUP!r}: {found[ep.name]} and {ep.value}; rename one of them (the "
                                  "name in its [project.entry-points] table) or uninstall one")
            found[ep.name] = ep.value
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must say who it is
                raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            self._add(plugin, ep.name, origin=(how, ep.name))
        if wanted and wanted - found.keys():
            missing = ", ".join(sorted(wanted - found.keys()))
            raise PluginError(f"entry point(s) {missing} of group {ENTRY_POINT_GROUP!r} are not installed in this "
                              "environment (the drain worker runs the same Python as the training process)")

    def _add(self, plugin: Any, name: str | None, origin: tuple[str, Any] | None = None) -> str:
        if inspect.isroutine(plugin):  # the hook function itself: pluggy read it as a hook named after our holder
            fn = getattr(plugin, "__qualname__", repr(plugin))
            raise PluginError(f"plugin {name or fn!r} is the function {fn}, not a plugin: a plugin is the module (or "
                              "object) whose attributes are the hook functions; register the module, or "
                              f"types.SimpleNamespace({getattr(plugin, '__name__', 'hook')}=...)")
        name = name or self.pm.get_canonical_name(plugin)
        if name in self._hooks:
            raise PluginError(f"a plugin named {name!r} is already registered ({self._hooks[name].plugin!r}); "
                              "give the new one another name")
        if any(h.plugin is plugin for h in self._hooks.values()):
            raise PluginError(f"plugin {plugin!r} is already registered; register it once")
        hooks = _Hooks(plugin, name)
        for attr in dir(plugin):
            opts = self.pm.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                if attr.startswith(f"{hookspecs.PROJECT}_") and inspect.isroutine(inspect.getattr_static(
                        plugin, attr, None)):
                    raise PluginError(f"plugin {name!r}: {attr} is not marked @hookimpl (from tiered_ckpt import "
                                      "hookimpl), so it would never be called; decorate it"
                                      f"{' or rename it' if attr not in HOOK_NAMES else ''}")
                continue
            setattr(hooks, attr, _wrapped(opts.get("specname") or attr, getattr(plugin, attr), name, dict(opts)))
        try:
            self.pm.register(hooks, name=name)
        except pluggy.PluginValidationError as exc:  # arguments the hook does not have, say
            raise PluginError(f"plugin {name!r}: {exc}") from None
        self._hooks[name] = hooks
        if origin is not None:
            self._origins[name] = origin
        return name

    @staticmethod
    def _origin(plugin: Any) -> tuple[str, Any] | tuple[None, str]:
        if inspect.ismodule(plugin):
            modname, why = _module_origin(plugin)
            return ("module", modname) if modname else (None, str(why))
        data, why = _worker_safe_pickle(plugin)
        return ("object", data) if data is not None else (None, str(why))

    def _check_pending(self) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            hooks = exc.plugin
            plugin = self._shown(hooks.name) if isinstance(hooks, _Hooks) else repr(hooks)
            unknown = sorted(_implemented(self.pm, hooks) - set(HOOK_NAMES))
            hook = unknown[0] if unknown else "?"
            raise PluginError(f"plugin {plugin} implements {hook!r}, which is no hook of tiered_ckpt"
                              f"{suggest(hook, HOOK_NAMES)} (hooks: {', '.join(HOOK_NAMES)}; see docs/hooks.md)"
                              ) from None

    def _build_registries(self) -> Registries:
        regs = Registries(Registry("tier kind", Tier, _tier_class_problem), Registry("layout"), Registry("codec"))
        self.pm.hook.tiered_ckpt_register_tiers(registry=regs.tiers)
        self.pm.hook.tiered_ckpt_register_layouts(registry=regs.layouts)
        self.pm.hook.tiered_ckpt_register_codecs(registry=regs.codecs)
        return regs

    def register(self, plugin: Any, name: str | None = None) -> str:
        """Add an observer plugin at run time: it sees the events of every engine built on this manager (for
        one engine's events alone, give the engine ``observers=``). Registration hooks run only at start-up: a
        plugin adding kinds must be passed as ``extra_plugins`` or installed as an entry point."""
        adds = sorted(_implemented(self.pm, plugin) & set(REGISTRATION_HOOKS))
        if adds:
            raise PluginError(f"plugin {name or plugin!r} implements {adds[0]}, which runs only when the plugin "
                              "manager starts: pass it as PluginManager(extra_plugins=(...,)) or publish it as an "
                              f"entry point of group {ENTRY_POINT_GROUP!r}")
        with self._lock:
            added = self._add(plugin, name)
            try:
                self._check_pending()
            except PluginError:
                self._remove(added)
                raise
            return added

    def unregister(self, plugin: Any) -> None:
        with self._lock:
            for name, hooks in list(self._hooks.items()):
                if hooks.plugin is plugin:
                    self._remove(name)

    def _remove(self, name: str) -> None:
        self.pm.unregister(self._hooks.pop(name))
        self._origins.pop(name, None)

    def _shown(self, name: str) -> str:
        """A plugin's name for messages, with what it is when the name alone says nothing (an id)."""
        hooks = self._hooks.get(name)
        if hooks is None or not name.isdigit():
            return repr(name)
        what = repr(hooks.plugin)
        return f"{name!r} ({what[:117] + '...' if len(what) > 120 else what})"

    def get_plugin(self, name: str) -> Any:
        hooks = self._hooks.get(name)
        return hooks.plugin if hooks is not None else None

    def plugin_names(self) -> list[str]:
        return list(self._hooks)

    def observers(self) -> list[tuple[str, Any]]:
        """(name, plugin) of every plugin that observes events (``tiered_ckpt_on_event``), in registration order."""
        return [(name, h.plugin) for name, h in self._hooks.items() if hasattr(h, EVENT_HOOK)]

    # ----- events ------------------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Deliver ``event`` to the observers registered on this manager (an engine adds its own: EngineEvents)."""
        self.pm.hook.tiered_ckpt_on_event(event=event)

    def for_engine(self, config: Config, observers: Iterable[Any] = ()) -> EngineEvents:
        """What an engine needs from its plugins: the check that a drain worker can rebuild them (raised now, not
        at the first save), and the engine's own event delivery (its ``events`` observers and ``observers``)."""
        if _uses_worker(self, config):
            self.check_worker(config)
        return EngineEvents(self, config, observers)

    # ----- the drain worker --------------------------------------------------------------------------------
    def spec(self) -> PluginSpec:
        plugins, unreachable = [], []
        for name, hooks in self._hooks.items():
            if not _implemented(self.pm, hooks.plugin) & set(REGISTRATION_HOOKS):
                continue  # an observer: the worker forwards events, it runs none
            how, what = self._origins.get(name) or self._origin(hooks.plugin)
            if how == "builtin":
                continue
            if how is None:
                unreachable.append((name, what))
            else:
                plugins.append((name, how, what))
        return PluginSpec(tuple(plugins), tuple(unreachable))

    def check_worker(self, config: Config) -> None:
        """Raise :class:`PluginError` when the drain worker process could not rebuild these plugins, or could not
        read ``config`` (an ``Options`` class defined in ``__main__``)."""
        spec = self.spec()
        where = f" in {config.source}" if config.source else ""
        fix = (f"move it into an importable module (and register that module, or publish an entry point of group "
               f"{ENTRY_POINT_GROUP!r}), or drain in threads of this process: drain: {{mode: thread}}{where}")
        for name, why in spec.unreachable:
            raise PluginError(f"plugin {self._shown(name)} cannot reach the drain worker process (drain: "
                              f"{{mode: process}}): the worker re-creates each plugin by import, and {why}; {fix}")
        _, why = _worker_safe_pickle(dataclasses.replace(config, plugins=None))
        if why is not None:
            raise PluginError(f"the configuration cannot reach the drain worker process: {why}; a tier kind's "
                              f"Options class must be importable too: {fix}")


def _tier_class_problem(cls: type) -> str | None:
    """Why a tier class cannot be built (an abstract method left out, an ``Options`` that is no dataclass), or
    None."""
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        return f"does not implement {', '.join(missing)} (docs/plugins.md, section 1)"
    if not dataclasses.is_dataclass(cls.Options):
        return f"has an Options that is not a dataclass ({cls.Options!r}): decorate it with @dataclass"
    return None


def _implemented(pm: pluggy.PluginManager, plugin: Any) -> set[str]:
    """The hooks ``plugin`` implements (a ``specname`` counts as its hook)."""
    hooks = set()
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is not None:
            hooks.add(opts.get("specname") or attr)
    return hooks


def _uses_worker(manager: PluginManager, config: Config) -> bool:
    """Whether an engine on ``config`` drains in a worker process: mode ``process`` and a memory tier that
    outlives the process (the snapshot the worker reads), none after it in one process's memory (worker_source)."""
    if config.drain.mode != "process":
        return False
    tiers = manager.registries.tiers
    caps = [(t, tiers.get(t.kind).capabilities_for(t.options)) for t in config.tiers
            if t.enabled is not False and t.kind in tiers]
    # A tier left to `enabled: auto` may be off once built: one in process memory then no longer keeps the
    # drain in threads, so it is counted out (the check is made whenever a worker may run).
    return worker_source([c for t, c in caps if c.survives_process or t.enabled is True]) is not None


class EngineEvents:
    """One engine's event delivery: every event stamped with the engine's ``run_id``, then given to the plugin
    manager's observers (they see every engine's events) and to the engine's own (only this engine's)."""

    def __init__(self, manager: PluginManager, config: Config, observers: Iterable[Any] = ()):
        from .observers import from_config

        self.manager = manager
        self.run_id = config.run_id
        self._own = pluggy.PluginManager(hookspecs.PROJECT)
        self._own.add_hookspecs(hookspecs)
        self._names: dict[int, str] = {}
        for observer in (*from_config(config.events, config.source), *observers):
            self.add(observer)

    def add(self, observer: Any, name: str | None = None) -> None:
        """Let ``observer`` (an object with a ``@hookimpl tiered_ckpt_on_event``) see this engine's events."""
        name = name or f"{type(observer).__name__}-{id(observer):x}"
        opts = self._own.parse_hookimpl_opts(observer, EVENT_HOOK)
        if opts is None:
            raise PluginError(f"observer {observer!r} has no @hookimpl {EVENT_HOOK}(event)")
        hooks = _Hooks(observer, name)
        setattr(hooks, EVENT_HOOK, _wrapped(EVENT_HOOK, getattr(observer, EVENT_HOOK), name, dict(opts)))
        self._own.register(hooks, name=name)
        self._names[id(observer)] = name

    def remove(self, observer: Any) -> None:
        name = self._names.pop(id(observer), None)
        if name is not None:
            self._own.unregister(name=name)

    def emit(self, event: Event) -> None:
        if event.run_id is None:
            event = dataclasses.replace(event, run_id=self.run_id)
        self.manager.pm.hook.tiered_ckpt_on_event(event=event)
        self._own.hook.tiered_ckpt_on_event(event=event)

    def close(self) -> None:
        for name in list(self._names.values()):
            self._own.unregister(name=name)
        self._names.clear()


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        return _default


def manager_for_worker(spec: PluginSpec | None) -> PluginManager:
    """In a drain worker: the plugin manager of the training process, rebuilt from ``spec`` (None: the default
    one), made this process's default too (a kind that looks up other kinds, such as ``faulty``, finds them)."""
    global _default
    if spec is None:
        return get_plugin_manager()
    if spec.unreachable:  # for_engine refused these already; say so if someone got here another way
        raise PluginError("plugins that cannot be rebuilt in the drain worker: "
                          + "; ".join(f"{n}: {why}" for n, why in spec.unreachable))
    manager = PluginManager.__new__(PluginManager)
    entry_names = [what for _, how, what in spec.plugins if how == "entry_point"]
    modules = [(importlib.import_module(what), name) for name, how, what in spec.plugins if how == "module"]
    objects = [(name, pickle.loads(what)) for name, how, what in spec.plugins if how == "object"]
    manager._start(entry_point_names=entry_names, extra=modules, objects=objects)
    with _default_lock:
        _default = manager
    return manager
