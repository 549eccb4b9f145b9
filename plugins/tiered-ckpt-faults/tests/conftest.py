"""Fixtures for the plugin's tests (tiered_ckpt's own fixtures come from its opt-in pytest plugin)."""

from __future__ import annotations

import pytest
from tiered_ckpt_faults import FaultyTier

pytest_plugins = ["tiered_ckpt.testing.pytest_plugin"]


@pytest.fixture(autouse=True)
def faulty_registry_and_controls(tier_registry, monkeypatch):
    """Inner tiers are built from the test registry, and no test sees another one's fault controls."""
    monkeypatch.setattr(FaultyTier, "registry", tier_registry)
    FaultyTier.controls.clear()
    yield
    FaultyTier.controls.clear()
