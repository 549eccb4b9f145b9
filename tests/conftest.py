"""Fixtures shared by every test directory. The tier fixtures (``make_tier``, ``shm_root``, ``s3_server``, ...) come
from tiered_ckpt's pytest plugin, which is opt-in: declared here, not loaded into every pytest run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI: the property tests draw the same examples every run, so a red run means a change, never a new draw; a local
# run explores new ones (and keeps what failed in .hypothesis/).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

sys.path.insert(0, str(Path(__file__).parent))  # `helpers` for tests in sub-directories too
from helpers import Recorder  # noqa: E402

pytest_plugins = ["tiered_ckpt.testing.pytest_plugin"]


@pytest.fixture
def recorder():
    """Every event the engine emits during the test (an observer on the process-wide plugin manager)."""
    from tiered_ckpt.plugins import get_plugin_manager

    rec = Recorder()
    pm = get_plugin_manager()
    pm.register(rec)
    yield rec
    pm.unregister(rec)
