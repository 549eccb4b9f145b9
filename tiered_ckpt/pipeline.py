"""The configured tiers, instantiated: stores in pipeline order and the entry tier (docs/architecture.md).

Every store is held as a :class:`~tiered_ckpt.store.Store`; the drain that moves steps between them is chosen by
:func:`tiered_ckpt.worker.open_drain`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import events as ev
from .codecs.file_codecs import FileCodec
from .config import Config, TierConfig
from .errors import ConfigError
from .file_store import FileStore
from .locking import run_lock_path, shm_paths
from .memory_store import MemoryStore
from .parallel import RankCoords
from .plugins import PluginManager
from .store import SnapshotStore, Store
from .tiers.base import Tier, TierContext

log = logging.getLogger(__name__)

STAGING = "_staging"  # in-process host buffers, when the fastest configured tier is not a memory tier
DEFAULT_SLOTS = 2


def tier_enabled(pm: PluginManager, cfg: TierConfig) -> bool:
    # The Tier interface (tiers/base.py): off only for false, unless the kind knows better (gpu without a device).
    return bool(pm.registries.tiers.get(cfg.kind).resolve_enabled(cfg.enabled, cfg.options, name=cfg.name))


def make_store(pm: PluginManager, config: Config, cfg: TierConfig, coords: RankCoords, local_rank: int,
               emit: Callable[[ev.Event], None]) -> Store:
    """The store of one tier: snapshot slots on a memory tier, files through the layout on the others."""
    cls = pm.registries.tiers.get(cfg.kind)
    context = TierContext(run_id=config.run_id, rank=coords.rank, local_rank=local_rank)
    try:
        tier: Tier = cls(cfg.name, cfg.options, context)
    except ConfigError as exc:  # a tier's own finding about its options (a path that is a file): placed
        raise _placed(exc, config, cfg.name) from None
    if tier.capabilities.memory:
        return MemoryStore(tier, coords.rank, cfg.slots or DEFAULT_SLOTS, cfg)
    layout = pm.registries.layouts.get(config.layout)()
    codecs: dict[str, FileCodec] = {name: c() for name, c, _ in pm.registries.codecs.items()}
    return FileStore(tier, cfg, layout, codecs, emit, run_id=config.run_id,
                     lock_dir=run_lock_path(config.run_id, shm_paths(config)))


def staging_config(pm: PluginManager) -> TierConfig:
    """The hidden entry tier when the first one is a file tier: a kind whose ``staging_options()`` (the Tier
    interface, tiers/base.py) gives host memory of this process, the built-in ``gpu`` kind first."""
    kinds = pm.registries.tiers
    for kind in sorted(kinds, key=lambda k: k != "gpu"):
        options = kinds.get(kind).staging_options()
        if options is not None:
            return TierConfig(name=STAGING, kind=kind, options=options, slots=DEFAULT_SLOTS)
    raise ConfigError("the first tier is a file tier and no tier kind can stage saves in host memory (none has "
                      "staging_options()); put a memory tier such as shm first", key_path="tiers")


@dataclass
class Pipeline:
    config: Config
    coords: RankCoords
    pm: PluginManager
    order: list[str]
    cfgs: dict[str, TierConfig]
    stores: dict[str, Store]
    emit: Callable[[ev.Event], None]
    local_rank: int = 0
    node_ranks: list[int] = field(default_factory=list)

    @property
    def entry(self) -> str:
        return self.order[0]

    @property
    def entry_store(self) -> SnapshotStore:
        slots = self.stores[self.entry].slots()
        assert slots is not None, "build_pipeline puts a memory tier first"
        return slots

    @property
    def entry_cfg(self) -> TierConfig:
        return self.cfgs[self.entry]

    def durable_stores(self) -> dict[str, Store]:
        """The file tiers, in pipeline order."""
        return {n: s for n, s in self.stores.items() if s.durable}

    def due_tiers(self, ordinal: int, persistent: bool = True) -> tuple[str, ...]:
        """Tiers below the entry that take the ``ordinal``-th save (1-based); each store decides
        (:meth:`~tiered_ckpt.store.Store.due`)."""
        return tuple(n for n in self.order[1:] if self.stores[n].due(ordinal, persistent))

    def placement(self, item: str, value: Any) -> Mapping[int, int] | None:
        """Where the first file tier whose layout has a wish wants tensors of ``item`` in the slot (see
        :data:`~tiered_ckpt.memory_store.ItemPlacement`): the entry tier's copy lays them out once for all."""
        for store in self.stores.values():
            files = store.files()
            if files is not None:
                wish = files.layout.placement(item, value, files.tier)
                if wish:
                    return wish
        return None

    def check_items(self, names: list[str]) -> None:
        """ConfigError when a file tier's layout cannot hold items of these names (its :meth:`refused_items`)."""
        for store in self.stores.values():
            files = store.files()
            why = files.layout.refused_items(names) if files is not None else None
            if why:
                raise ConfigError(why, key_path="layout")

    def prepare(self, nbytes: int) -> None:
        for name in self.order:
            self.stores[name].prepare(nbytes)

    def drain_options(self) -> dict:
        return {"commit_wait_s": self.config.drain.commit_timeout_s, "node_ranks": self.node_ranks}

    def close(self) -> None:
        for store in self.stores.values():
            try:
                store.close()
            except Exception:
                log.exception("closing tier %r failed", store.name)


def build_stores(config: Config, pm: PluginManager, coords: RankCoords, local_rank: int, names: list[str],
                 emit: Callable[[ev.Event], None]) -> dict[str, Store]:
    cfgs = {t.name: t for t in config.tiers}
    return {n: make_store(pm, config, cfgs[n], coords, local_rank, emit) for n in names}


def _placed(exc: ConfigError, config: Config, name: str) -> ConfigError:
    """A tier's ConfigError (its key path ``tier 'NAME'.key`` or ``key``) as the configuration's ``tiers[i].key``."""
    if exc.key_path and exc.key_path.startswith("tiers["):  # placed already (make_store, then build_pipeline)
        return exc
    index = next(i for i, t in enumerate(config.tiers) if t.name == name)
    rel = re.sub(r"^tier '[^']*'\.?", "", exc.key_path or "")  # "tier 'hbm'.enabled" → "enabled"
    path = f"tiers[{index}].{rel}" if rel else f"tiers[{index}]"
    return ConfigError(f"{exc.message} (tier {name!r})", source=config.source, key_path=path)


def build_pipeline(config: Config, pm: PluginManager, coords: RankCoords, local_rank: int,
                   emit: Callable[[ev.Event], None], node_ranks: list[int] | None = None) -> Pipeline:
    cfgs: dict[str, TierConfig] = {}
    for cfg in config.tiers:
        try:
            enabled = tier_enabled(pm, cfg)
            if enabled:  # what only this machine can tell (pin: true and no CUDA), before any save
                pm.registries.tiers.get(cfg.kind).check_usable(cfg.options)
        except ConfigError as exc:
            raise _placed(exc, config, cfg.name) from None
        if enabled:
            cfgs[cfg.name] = cfg
        else:
            reason = "enabled: false" if cfg.enabled is False else "not available on this machine"
            log.info("tier %r (%s) is off: %s", cfg.name, cfg.kind, reason)
            emit(ev.Event(ev.TIER_DISABLED, rank=coords.rank, tier=cfg.name, message=reason))
    if not cfgs:
        raise ConfigError("every tier is disabled; enable at least one", source=config.source, key_path="tiers")
    if config.layout == "megatron":
        for cfg in cfgs.values():
            if cfg.compression is not None and cfg.compression.codec != "none":
                log.warning("tier %r compresses its files: Megatron-LM cannot read them (layout megatron); "
                            "tiered_ckpt can, and `tiered-ckpt convert` writes plain ones", cfg.name)
    file_tiers = [c for c in cfgs.values() if not pm.registries.tiers.get(c.kind).capabilities_for(c.options).memory]
    if file_tiers and all(c.keep == 1 for c in file_tiers) and coords.rank == 0:
        # One damaged newest step then leaves load() nothing older to fall back to (a known way to lose work).
        log.warning("every file tier keeps only its newest step (keep: 1 on %s): if that step is ever damaged, "
                    "load() has no older step to fall back to; keep 2 or more on one of them",
                    ", ".join(repr(c.name) for c in file_tiers))
    order = list(cfgs)
    first = cfgs[order[0]]
    if not pm.registries.tiers.get(first.kind).capabilities_for(first.options).memory:
        # Saves must block only for a memory copy: stage in host memory of this process, then drain from there.
        cfgs = {STAGING: staging_config(pm), **cfgs}
        order.insert(0, STAGING)
    stores: dict[str, Store] = {}
    for name in order:
        try:
            stores[name] = make_store(pm, config, cfgs[name], coords, local_rank, emit)
        except BaseException as exc:  # a tier's PermanentTierError (a path it cannot create) too
            for store in stores.values():
                try:
                    store.close()
                except Exception:  # noqa: BLE001 - the error being raised is the one to report
                    log.warning("tier %r: close after a failed start failed", store.name, exc_info=True)
            if not isinstance(exc, ConfigError):
                raise
            raise _placed(exc, config, name) if name != STAGING else exc from None
    return Pipeline(config, coords, pm, order, cfgs, stores, emit, local_rank, node_ranks or [coords.rank])
