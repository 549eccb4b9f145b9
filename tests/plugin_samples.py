"""Plugins defined in an importable module, as a drain worker process can rebuild them (tests/test_plugins.py)."""

from __future__ import annotations

import types

from tiered_ckpt import hookimpl
from tiered_ckpt.tiers.local import LocalTier


class MirrorTier(LocalTier):
    """A local tier under another kind name: a kind only this module's plugin provides."""

    kind = "mirror"


@hookimpl
def tiered_ckpt_register_tiers(registry):
    registry.add("mirror", MirrorTier)


# The same hook as a plugin object (registered by object, pickled to the worker), not as this module.
as_object = types.SimpleNamespace(tiered_ckpt_register_tiers=tiered_ckpt_register_tiers)
