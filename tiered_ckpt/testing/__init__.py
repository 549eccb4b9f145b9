"""Test support for tier kinds: the contract suite and pytest fixtures.

* :class:`TierContract` (``tiered_ckpt.testing.contract``): subclass it and provide a ``tier`` fixture; every
  built-in kind and every plugin kind runs it.
* ``tiered_ckpt.testing.pytest_plugin`` (opt-in: ``pytest -p tiered_ckpt.testing.pytest_plugin`` or
  ``pytest_plugins = ["tiered_ckpt.testing.pytest_plugin"]`` in a conftest.py): the fixtures ``shm_root``,
  ``tier_context``, ``tier_registry``, ``make_tier`` and the S3 ones (``s3_server``, ``s3_bucket``,
  ``s3_fault_proxy``).

This package is imported when pytest loads the plugin, so it imports nothing heavy itself: ``TierContract``
(which needs torch and numpy) is loaded on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierContract", "build_tier_registry"]


def __getattr__(name: str) -> Any:
    if name == "TierContract":
        from .contract import TierContract

        return TierContract
    if name == "build_tier_registry":
        from .pytest_plugin import build_tier_registry

        return build_tier_registry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
