"""Every hook of tiered_ckpt, in one place.

Hooks are for *discovery* (which tier kinds, layouts and codecs exist) and *observation* (events). Behaviour lives
in classes: a tier kind is a :class:`tiered_ckpt.tiers.base.Tier` subclass, registered by name through
:func:`tiered_ckpt_register_tiers`.

The built-in kinds register through these same hooks (``tiered_ckpt.builtin``), exactly like a third-party plugin
found through the ``tiered_ckpt`` entry-point group. A plugin module implements any subset of these functions,
decorated with :data:`hookimpl` (a misspelt name, or a ``tiered_ckpt_*`` function without the decorator, is an
error when the plugin manager starts)::

    from tiered_ckpt import hookimpl

    @hookimpl
    def tiered_ckpt_register_tiers(registry):
        registry.add("faulty", FaultyTier)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .events import Event
    from .registry import Registry

PROJECT = "tiered_ckpt"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def tiered_ckpt_register_tiers(registry: Registry) -> None:
    """Add tier kinds.

    :param registry: the tier registry. Call ``registry.add(kind, tier_class)`` once per kind, where
        ``tier_class`` subclasses :class:`tiered_ckpt.tiers.base.Tier`.
    :return: nothing; every implementation is called.

    Adding a kind that another plugin already added raises :class:`tiered_ckpt.errors.PluginError` naming both
    plugins: names are never silently overridden or renamed.
    """


@hookspec
def tiered_ckpt_register_layouts(registry: Registry) -> None:
    """Add layout policies (how steps, items and ranks map to paths; see ``tiered_ckpt.layouts``).

    :param registry: the layout registry; ``registry.add(name, layout_class)``.
    :return: nothing; every implementation is called. Duplicate names are an error, as for tiers.
    """


@hookspec
def tiered_ckpt_register_codecs(registry: Registry) -> None:
    """Add codecs (how an item becomes bytes on a file tier, and back; see ``tiered_ckpt.codecs``).

    :param registry: the codec registry; ``registry.add(name, codec_class)``.
    :return: nothing; every implementation is called. Duplicate names are an error, as for tiers.
    """


@hookspec
def tiered_ckpt_on_event(event: Event) -> None:
    """Observe what the pipeline does: snapshot, drain, commit, evict, retry, fallback, load, ...

    :param event: a frozen :class:`tiered_ckpt.events.Event` with ``kind``, ``run_id`` (the emitting engine's),
        ``step``, ``rank``, ``tier``, ``seconds``, ``nbytes``, ``message``, ``time`` (when it happened, seconds
        since the epoch) and a free-form ``detail`` dict.
    :return: ignored; every implementation is called.

    An implementation on a plugin sees the events of every engine built on its plugin manager; one given to an
    engine (``CheckpointEngine(..., observers=[...])``, or the configuration's ``events``) sees that engine's only.
    Called in the training process (events from the drain worker are forwarded there), from whichever thread
    produced the event. Keep implementations quick and thread-safe. An exception raised here is logged and the
    other observers still get the event: observation must never break a save.
    """
