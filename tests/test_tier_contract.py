"""Every built-in tier kind passes the contract suite (tiered_ckpt.testing.contract)."""

from __future__ import annotations

import uuid

import pytest

from tiered_ckpt.testing.contract import TierContract


class TestGpuTierOnCpu(TierContract):
    @pytest.fixture
    def tier(self, make_tier):
        return make_tier("gpu", device="cpu")


class TestGpuTierWithLimit(TierContract):
    @pytest.fixture
    def tier(self, make_tier):
        return make_tier("gpu", device="cpu", max_bytes="1GiB")


class TestShmTier(TierContract):
    @pytest.fixture
    def tier(self, make_tier, shm_root):
        return make_tier("shm", path=shm_root)


class TestLocalTier(TierContract):
    @pytest.fixture
    def tier(self, make_tier, tmp_path):
        return make_tier("local", path=tmp_path / "local")


class TestLocalTierWithoutFsync(TierContract):
    @pytest.fixture
    def tier(self, make_tier, tmp_path):
        return make_tier("local", path=tmp_path / "local", fsync=False)


class TestFsspecMemory(TierContract):
    @pytest.fixture
    def tier(self, make_tier):
        return make_tier("fsspec", url=f"memory://contract-{uuid.uuid4().hex}/root")


class TestFsspecFile(TierContract):
    @pytest.fixture
    def tier(self, make_tier, tmp_path):
        return make_tier("fsspec", url=f"file://{tmp_path}/fsspec-root", block_size="1MiB")
