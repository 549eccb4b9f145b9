"""The configuration: YAML file or dict → validated frozen dataclasses (docs/configuration.md).

Common keys of a tier (name, kind, enabled, every, keep, slots, when_full, on_close, compression, retry, codec,
codecs) are checked here; every other key of a tier entry belongs to its kind and is checked against that kind's
``Options`` dataclass, found through the plugin registry, so third-party kinds get the same strictness. A common
key that the kind would ignore (``keep`` on a memory tier, ``slots`` on a file tier, ``on_close`` on gpu) is an
error too.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError, PluginError
from .validate import (
    NonNegativeInt,
    PositiveInt,
    Seconds,
    _join,
    build_dataclass,
    coerce,
    field_names,
    suggest,
    unknown_key_error,
)

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_TIER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class CompressionConfig:
    codec: Literal["none", "zstd"] = "zstd"
    level: int = 3
    threads: int = 0  # zstd worker threads; 0 = compress on the calling thread, -1 = one per core
    byte_grouping: bool = False  # regroup float bytes by significance before zstd (see docs/tiers.md)

    def __post_init__(self) -> None:
        if not -7 <= self.level <= 22:
            raise ValueError(f"level: expected an integer from -7 to 22, got {self.level}")
        if self.threads < -1:
            raise ValueError(f"threads: expected -1, 0 or a positive integer, got {self.threads}")


@dataclass(frozen=True)
class RetryConfig:
    attempts: PositiveInt = 5  # total tries, the first included
    initial_s: Seconds = 0.5
    max_s: Seconds = 30.0
    deadline_s: Seconds = 900.0  # give up on a step for this tier after this long, whatever attempts remain


@dataclass(frozen=True)
class TierConfig:
    name: str
    kind: str
    enabled: bool | Literal["auto"] = True
    every: PositiveInt = 1  # this tier takes every n-th step saved
    keep: PositiveInt | None = None  # committed steps kept; None = all (memory tiers: their slot count)
    slots: PositiveInt | None = None  # memory tiers: snapshot buffers held (2 = double buffering)
    when_full: Literal["wait", "skip"] = "wait"  # memory tiers: what save() does when every slot is draining
    # memory tiers that outlive the process (shm): what a clean close() does with the slots. "keep": they stay
    # for a restart to resume from memory; "release": those whose step a file tier committed are deleted.
    on_close: Literal["keep", "release"] = "keep"
    compression: CompressionConfig | None = None
    retry: RetryConfig = field(default_factory=RetryConfig)
    # File tiers: the file codec of the items whose format the layout leaves open (None: the layout's default,
    # ``flat``), and per item (``{state: torch}``). Names are registered codecs; checked against the layout.
    codec: str | None = None
    codecs: dict[str, str] = field(default_factory=dict)
    options: Any = None  # the kind's own Options dataclass instance


@dataclass(frozen=True)
class DrainConfig:
    mode: Literal["process", "thread"] = "process"
    # How long close() waits for pending drains before giving up (the shm snapshot stays loadable anyway).
    close_timeout_s: Seconds = 600.0
    # How long the committing rank waits for every rank's files of a step before declaring it not committed.
    commit_timeout_s: Seconds = 120.0


@dataclass(frozen=True)
class LoadConfig:
    copy: bool = True  # False: tensors loaded from shm are zero-copy views of the snapshot (see docs)
    verify: bool = True  # check checksums against the manifest
    trust_pickles: bool = False  # allow arbitrary pickles in legacy files (logged); never the default
    # A tier whose listing has not answered by then counts as unreachable for this load (a stalled object store
    # would otherwise hold a restart for its timeouts times its retries: minutes). None: wait for it.
    list_timeout_s: Seconds | None = 120.0

    def __post_init__(self) -> None:
        if self.list_timeout_s is not None and self.list_timeout_s <= 0:
            raise ValueError(f"list_timeout_s: expected a positive duration or null, got {self.list_timeout_s}")


@dataclass(frozen=True)
class EventsConfig:
    jsonl: str | None = None  # write one JSON line per event to this file ("-" for stderr)
    log: bool = False  # also log each event at INFO through the ``tiered_ckpt.events`` logger


@dataclass(frozen=True)
class Config:
    tiers: tuple[TierConfig, ...]
    run_id: str = "default"
    layout: str = "rank_sharded"
    drain: DrainConfig = field(default_factory=DrainConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    source: str | None = None  # where it was read from, for messages
    # The plugins the configuration was read with, for a drain worker to rebuild (plugins.PluginSpec; set by
    # load_config from the registries; None: the default plugins).
    plugins: Any = field(default=None, compare=False, repr=False)

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)


_COMMON_TIER_KEYS = {"name", "kind", "enabled", "every", "keep", "slots", "when_full", "on_close", "compression",
                     "retry", "codec", "codecs"}
# Common keys that only one family of tiers reads: given to the other, they would be silently ignored.
_FILE_TIER_KEYS = {
    "every": "a memory tier takes every save",
    "keep": "a memory tier holds the newest `slots` snapshots (set slots instead)",
    "compression": "a memory tier holds raw snapshots, never compressed",
    "codec": "a memory tier holds snapshots in its own format, not files",
    "codecs": "a memory tier holds snapshots in its own format, not files",
    "retry": "a memory tier's copies are not retried (the policy applies to file tiers' writes)",
}
_MEMORY_TIER_KEYS = {
    "slots": "only memory tiers hold slots",
    "when_full": "only memory tiers hold slots that can all be busy",
    "on_close": "only memory tiers hold slots to keep or release",
}


def expand_env(value: Any, path: str = "", source: str | None = None, env: dict[str, str] | None = None) -> Any:
    """Replace ``${VAR}`` and ``${VAR:-default}`` in every string, recursively. As in the shell, the default
    stands in for a variable that is unset or empty; ``${VAR}`` of an empty one is empty."""
    env = os.environ if env is None else env
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if default is not None and not env.get(name):
                return default
            if name in env:
                return env[name]
            raise ConfigError(f"environment variable {name} is not set (write ${{{name}:-default}} for a default)",
                              source=source, key_path=path or "<root>")
        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: expand_env(v, f"{path}.{k}" if path else str(k), source, env) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{path}[{i}]", source, env) for i, v in enumerate(value)]
    return value


def _tier_config(raw: Any, index: int, registries: Any, source: str | None) -> TierConfig:
    path = f"tiers[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a mapping with at least name and kind, got {raw!r}", source=source,
                          key_path=path)
    for key in ("name", "kind"):
        if key not in raw:
            raise ConfigError("required key is missing (expected a string)", source=source,
                              key_path=f"{path}.{key}")
    name = coerce(str, raw["name"], f"{path}.name", source)
    if not _TIER_NAME.fullmatch(name):
        raise ConfigError(f'expected letters, digits, "_", "-" or ".", starting with a letter or digit (at most 64), '
                          f'got "{name}"',
                          source=source, key_path=f"{path}.name")
    kind = coerce(str, raw["kind"], f"{path}.kind", source)
    try:
        tier_cls = registries.tiers.get(kind)
    except PluginError as exc:
        raise ConfigError(str(exc), source=source, key_path=f"{path}.kind") from None
    option_keys = set(field_names(tier_cls.Options))
    unknown = [k for k in raw if k not in _COMMON_TIER_KEYS and k not in option_keys]
    own = {k: v for k, v in raw.items() if k not in _COMMON_TIER_KEYS and k in option_keys}
    if unknown:
        memory = _memory_hint(tier_cls, own)
        skip = _FILE_TIER_KEYS if memory else _MEMORY_TIER_KEYS
        allowed = (_COMMON_TIER_KEYS - set(skip)) | option_keys
        raise unknown_key_error(unknown[0], allowed, path, source, where=f"for a {kind} tier")
    common = {k: v for k, v in raw.items() if k in _COMMON_TIER_KEYS}
    options = build_dataclass(tier_cls.Options, own, path, source)
    tc = build_dataclass(TierConfig, common, path, source)
    try:
        capabilities = tier_cls.capabilities_for(options)
    except ConfigError as exc:  # a kind that validates more of its options here (the faulty plugin's inner tier)
        where = _join(path, exc.key_path) if exc.key_path else path
        raise ConfigError(exc.message, source=source, key_path=where) from None
    memory = capabilities.memory
    inapplicable = _FILE_TIER_KEYS if memory else _MEMORY_TIER_KEYS
    for key, why in inapplicable.items():
        if key in common:
            message = (f"does not apply to a memory tier (kind {kind!r}): {why}; remove the key" if memory
                       else f"{why}; kind {kind!r} does not (remove the key)")
            raise ConfigError(message, source=source, key_path=f"{path}.{key}")
    if memory and "on_close" in common and not capabilities.survives_process:
        raise ConfigError(f"kind {kind!r} holds its slots in this process's memory, which ends with it: there is "
                          "nothing to keep or release at close (on_close applies to shm); remove the key",
                          source=source, key_path=f"{path}.on_close")
    _check_codecs(tc, registries, path, source)
    return TierConfig(**{**tc.__dict__, "options": options})


def _check_order(tiers: tuple[TierConfig, ...], registries: Any, source: str | None) -> None:
    """Memory tiers come before file tiers: a memory tier takes its snapshots from the memory tier above it, so
    one below a file tier would fail at every save."""
    first_file = None
    for i, t in enumerate(tiers):
        memory = registries.tiers.get(t.kind).capabilities_for(t.options).memory
        if not memory and first_file is None:
            first_file = i
        elif memory and first_file is not None:
            raise ConfigError(f"memory tier {t.name!r} (kind {t.kind!r}) comes after file tier "
                              f"{tiers[first_file].name!r} (tiers[{first_file}]): tiers are listed fastest first, "
                              "and a memory tier takes its snapshots from the memory tier above it; move it up",
                              source=source, key_path=f"tiers[{i}]")


def _chosen_codecs(tc: TierConfig) -> list[tuple[str, str | None, str]]:
    """(key, item or None for the tier-wide ``codec``, codec name) of each codec a tier's configuration names."""
    chosen: list[tuple[str, str | None, str]] = [("codec", None, tc.codec)] if tc.codec is not None else []
    return chosen + [(f"codecs.{item}", item, name) for item, name in tc.codecs.items()]


def _tier_codecs(registries: Any) -> list[str]:
    """The codecs a tier may name: every registered one but a layout's own (``FileCodec.layout_only``)."""
    return [n for n, cls, _ in registries.codecs.items() if not getattr(cls, "layout_only", False)]


def _check_codecs(tc: TierConfig, registries: Any, path: str, source: str | None) -> None:
    """``codec`` and ``codecs`` name registered codecs (the layout's own constraints: _check_layout_codecs)."""
    known = _tier_codecs(registries)
    for key, _, name in _chosen_codecs(tc):
        if name in registries.codecs:
            continue
        hint = suggest(name, known)
        if not hint and name in ("zstd", "none"):
            hint = "; compression is set with compression: {codec: zstd}"
        raise ConfigError(f'unknown codec "{name}" (allowed: {", ".join(known) or "none"}){hint}', source=source,
                          key_path=f"{path}.{key}")


def _check_layout_codecs(tiers: tuple[TierConfig, ...], layout_cls: Any, registries: Any,
                         source: str | None) -> None:
    """Items whose files another program reads (Megatron's ``model_optim_rng.pt``, DCP's ``.distcp``) keep the
    layout's codec (layouts/base.py: any choice of its own but the default); a codec only a layout may pick
    (``FileCodec.layout_only``) is not a tier's choice."""
    layout = layout_cls()
    for i, t in enumerate(tiers):
        for key, item, name in _chosen_codecs(t):  # every name is registered (_check_codecs)
            if getattr(registries.codecs.get(name), "layout_only", False) and (
                    item is None or layout.codec_for(item) != name):
                raise ConfigError(f"codec \"{name}\" is the format of a layout's own files (the layout picks it "
                                  f"for the items it builds), not a tier's choice (allowed: "
                                  f"{', '.join(_tier_codecs(registries))}); remove the key", source=source,
                                  key_path=f"tiers[{i}].{key}")
        for item, name in t.codecs.items():
            want = layout.codec_for(item)
            if want != layout.default_codec and name != want:
                why = (layout.fixed_codec_reason if item in layout.fixed_codecs else
                       "the layout writes this file in its own format")
                raise ConfigError(f'layout "{layout_cls.name}" writes {item} with codec "{want}" ({why}); got '
                                  f'"{name}" (remove the key)', source=source, key_path=f"tiers[{i}].codecs.{item}")


def _memory_hint(tier_cls: Any, own: dict[str, Any]) -> bool:
    """Whether a tier of this kind is a memory tier, for the list of keys an error shows (best effort)."""
    try:
        return bool(tier_cls.capabilities_for(build_dataclass(tier_cls.Options, own)).memory)
    except Exception:
        return bool(getattr(tier_cls.capabilities, "memory", False))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it keeps the last one, silently). Checked
    before merge keys (``<<: *anchor``) are applied, which modify the anchored node in place: keys a mapping
    gives beside a merge override the merged ones, as YAML says."""

    def flatten_mapping(self, node: Any) -> None:
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} is given twice (first at line {seen[key].line + 1}); "
                        "keep one", key_node.start_mark)
                seen[key] = key_node.start_mark
        super().flatten_mapping(node)


def load_config(config: Any, *, registries: Any = None, env: dict[str, str] | None = None) -> Config:
    """A YAML path, a YAML string of a mapping is not accepted (ambiguous with paths): a path, a dict or a Config."""
    if isinstance(config, Config):
        spec = getattr(registries, "spec", None)
        if spec is not None and config.plugins != spec:  # read elsewhere: the worker rebuilds these plugins
            return dataclasses.replace(config, plugins=spec)
        return config
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        try:
            text = Path(config).read_text()
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8, a NUL in the path
            raise ConfigError(f"cannot read the configuration: {getattr(exc, 'strerror', None) or exc}",
                              source=source) from None
        try:
            config = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"not valid YAML{where}: {getattr(exc, 'problem', exc)}", source=source) from None
        except Exception as exc:  # PyYAML's constructors raise anything: "2024-02-30", "!!float", deep nesting
            raise ConfigError(f"not valid YAML: {type(exc).__name__}: {exc}", source=source) from None
    if config is None and source is not None:
        raise ConfigError("the file is empty (or only comments): it needs at least run_id and tiers (see "
                          "docs/configuration.md)", source=source)
    if not isinstance(config, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(config).__name__}", source=source,
                          key_path="<root>")
    if registries is None:
        from .plugins import get_plugin_manager

        registries = get_plugin_manager().registries
    try:
        raw = expand_env(config, source=source, env=env)
    except RecursionError:
        raise ConfigError("the configuration contains itself (a YAML alias inside its own anchor) or is nested "
                          "too deeply", source=source, key_path="<root>") from None
    top_keys = set(field_names(Config)) - {"source", "plugins"}
    unknown = [k for k in raw if k not in top_keys]
    if unknown:
        raise unknown_key_error(unknown[0], top_keys, "", source)
    raw_tiers = raw.get("tiers")
    if not isinstance(raw_tiers, list) or not raw_tiers:
        got = "nothing" if raw_tiers is None else repr(raw_tiers)
        raise ConfigError(f"expected a non-empty list of tiers, got {got}", source=source, key_path="tiers")
    tiers = tuple(_tier_config(t, i, registries, source) for i, t in enumerate(raw_tiers))
    seen: dict[str, int] = {}
    for i, t in enumerate(tiers):
        if t.name in seen:
            raise ConfigError(f'duplicate tier name "{t.name}" (also tiers[{seen[t.name]}])', source=source,
                              key_path=f"tiers[{i}].name")
        seen[t.name] = i
    _check_order(tiers, registries, source)
    _check_distinct_places(tiers, source)
    rest = {k: v for k, v in raw.items() if k != "tiers"}
    cfg = build_dataclass(Config, {**rest, "tiers": []}, "", source)
    if not _RUN_ID.fullmatch(cfg.run_id):
        raise ConfigError(f'expected letters, digits, "_", "-" or ".", starting with a letter or digit (at most 128), '
                          f'got "{cfg.run_id}"',
                          source=source, key_path="run_id")
    if cfg.layout not in registries.layouts:
        known = list(registries.layouts)
        raise ConfigError(f'unknown layout "{cfg.layout}" (known: {", ".join(known) or "none"})'
                          f"{suggest(cfg.layout, known)}", source=source, key_path="layout")
    _check_layout_codecs(tiers, registries.layouts.get(cfg.layout), registries, source)
    return Config(**{**cfg.__dict__, "tiers": tiers, "source": source,
                     "plugins": getattr(registries, "spec", None)})


def _place(t: TierConfig) -> tuple[str, str, str] | None:
    """Where a built-in tier keeps its blobs on this machine's filesystem, as (family, normalised path, option
    name), the way the tier itself resolves it; None for other kinds and for remote URLs (two object stores may
    hold buckets of one name: the URL alone does not say it is one place)."""
    opts = t.options
    path = getattr(opts, "path", None)
    if t.kind == "local" and isinstance(path, str):
        return "files", os.path.normpath(os.path.abspath(os.path.expanduser(path))), "path"
    if t.kind == "shm" and isinstance(path, str):
        return "shm", os.path.normpath(os.path.abspath(path)), "path"
    url = getattr(opts, "url", None)
    if t.kind == "fsspec" and isinstance(url, str) and (url.startswith("file://") or "://" not in url):
        return "files", os.path.normpath(os.path.abspath(url.removeprefix("file://"))), "url"
    return None


def _check_distinct_places(tiers: tuple[TierConfig, ...], source: str | None) -> None:
    """Two tiers in one place would share their steps: each one's retention (``keep``) deletes the other's, and
    ``load()`` would count one copy twice as a fallback that does not exist."""
    seen: dict[tuple[str, str], int] = {}
    for i, t in enumerate(tiers):
        place = _place(t) if t.enabled is not False else None
        if place is None:
            continue
        family, where, option = place
        if (family, where) in seen:
            j = seen[(family, where)]
            raise ConfigError(f"{where} is also tiers[{j}]'s ({tiers[j].name!r}): two tiers in one place share their "
                              "steps, and each one's keep deletes the other's; give each tier its own",
                              source=source, key_path=f"tiers[{i}].{option}")
        seen[(family, where)] = i


__all__ = [
    "CompressionConfig", "Config", "DrainConfig", "EventsConfig", "LoadConfig", "RetryConfig", "TierConfig",
    "load_config", "expand_env", "NonNegativeInt", "suggest",
]
