"""The `faulty` kind, with no fault active, is a transparent wrapper: it passes the tier contract suite."""

from __future__ import annotations

import pytest
from tiered_ckpt_faults import FAULT_OPS

from tiered_ckpt.testing import TierContract


class TestFaultyLocalContract(TierContract):
    @pytest.fixture
    def tier(self, make_tier, tmp_path):
        return make_tier("faulty", inner={"kind": "local", "path": str(tmp_path / "inner")})


class TestFaultyShmContract(TierContract):
    """Over a memory tier: slots and zero-copy reads go through the wrapper too."""

    @pytest.fixture
    def tier(self, make_tier, shm_root):
        return make_tier("faulty", inner={"kind": "shm", "path": shm_root}, fail_at="start")


class TestFaultyLocalWithIdleFaults(TierContract):
    """Faults configured for primitives the suite's failures would show, but never due: still transparent."""

    @pytest.fixture
    def tier(self, make_tier, tmp_path):
        return make_tier("faulty", inner={"kind": "local", "path": str(tmp_path / "inner"), "fsync": False},
                         fail_every=1_000_000, disk_full_after="1TiB", ops=list(FAULT_OPS))
