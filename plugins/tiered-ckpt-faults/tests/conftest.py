"""Fixtures for the plugin's tests (tiered_ckpt's own fixtures come from its pytest11 plugin)."""

from __future__ import annotations

import pytest
from tiered_ckpt_faults import FaultyTier


@pytest.fixture(autouse=True)
def faulty_registry_and_controls(tier_registry, monkeypatch):
    """Inner tiers are built from the test registry, and no test sees another one's fault controls."""
    monkeypatch.setattr(FaultyTier, "registry", tier_registry)
    FaultyTier.controls.clear()
    yield
    FaultyTier.controls.clear()
