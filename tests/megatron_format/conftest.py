"""Lets these tests use tests/helpers.py when run on their own (``pytest tests/megatron_format``)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.append(_TESTS)


import os  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests write many small files on local tiers: durability is the tiers' tests' business."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
