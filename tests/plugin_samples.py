"""Plugins defined in an importable module, as a drain worker process can rebuild them (tests/test_plugins.py)."""

from __future__ import annotations

import os
import types

from tiered_ckpt import hookimpl
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.local import LocalOptions, LocalTier


class MirrorTier(LocalTier):
    """A local tier under another kind name: a kind only this module's plugin provides."""

    kind = "mirror"


@hookimpl
def tiered_ckpt_register_tiers(registry):
    registry.add("mirror", MirrorTier)


# The same hook as a plugin object (registered by object, pickled to the worker), not as this module.
as_object = types.SimpleNamespace(tiered_ckpt_register_tiers=tiered_ckpt_register_tiers)


class PartTimeTier(LocalTier):
    """A kind that is never available with ``enabled: auto`` (as the gpu kind on a machine without a GPU)."""

    kind = "part_time"

    @classmethod
    def resolve_enabled(cls, enabled, options, *, name=""):
        return enabled is True


class SweptTier(Tier):
    """A plugin kind that answers gc's questions through the Tier interface alone (it has no ``files`` helper
    such as the built-in file tiers keep): blobs in a local directory, through an inner local tier."""

    kind = "swept"
    Options = LocalOptions

    def __init__(self, name, options=None, context=None):
        super().__init__(name, options, context)
        self._disk = LocalTier(name, self.options, self.context)

    def write_blob(self, key, chunks):
        return self._disk.write_blob(key, chunks)

    def read_blob(self, key):
        return self._disk.read_blob(key)

    def size(self, key):
        return self._disk.size(key)

    def exists(self, key):
        return self._disk.exists(key)

    def list(self, prefix=""):
        return self._disk.list(prefix)

    def delete(self, key):
        self._disk.delete(key)

    def temp_files(self):
        return self._disk.files.temp_files()

    def remove_temp_file(self, key):
        self._disk.files.remove_temp_file(key)

    def modified(self, key):
        try:
            return os.stat(self._disk.files.path(key), follow_symlinks=False).st_mtime
        except (OSError, ValueError):
            return None


class VaultTier(SweptTier):
    """A plugin kind that tells the CLI when its location is missing, without creating it."""

    kind = "vault"

    def __init__(self, name, options=None, context=None):
        Tier.__init__(self, name, options, context)
        self._disk = None  # opened on the first write: reading must create nothing

    def _open(self):
        if self._disk is None:
            self._disk = LocalTier(self.name, self.options, self.context)
        return self._disk

    def write_blob(self, key, chunks):
        return self._open().write_blob(key, chunks)

    def list(self, prefix=""):
        return self._open().list(prefix) if os.path.isdir(self.options.path) else []

    @property
    def location(self):
        return f"vault:{self.options.path}"

    def missing_location(self):
        return None if os.path.isdir(self.options.path) else f"no such vault {os.path.basename(self.options.path)!r}"


@hookimpl(specname="tiered_ckpt_register_tiers")
def register_more_tiers(registry):
    registry.add("part_time", PartTimeTier)
    registry.add("swept", SweptTier)
    registry.add("vault", VaultTier)


more_kinds = types.SimpleNamespace(register_more_tiers=register_more_tiers)
