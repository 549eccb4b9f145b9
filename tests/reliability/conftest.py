"""Reliability tests (issue #9): crash points, corruption, full disks, bad input, concurrency and permissions."""

from __future__ import annotations

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)  # tests/helpers.py

from helpers import Recorder  # noqa: E402


@pytest.fixture
def recorder():
    from tiered_ckpt.plugins import get_plugin_manager

    rec = Recorder()
    pm = get_plugin_manager()
    pm.register(rec)
    yield rec
    pm.unregister(rec)
