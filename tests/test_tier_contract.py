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


def test_the_contract_catches_a_tier_whose_gc_listing_shows_finished_blobs(make_tier, tmp_path):
    from tiered_ckpt.tiers.local import LocalTier

    class ListsEverything(LocalTier):
        def temp_files(self):
            return self.list()  # wrong: gc would delete committed files

    tier = ListsEverything("bad", make_tier("local", path=tmp_path / "bad").options)
    with pytest.raises(AssertionError, match="nothing temporary is left"):
        TierContract().test_temp_files_list_only_unfinished_writes(tier)


def test_the_contract_catches_a_kind_that_ignores_enabled_false(make_tier, tmp_path):
    from tiered_ckpt.tiers.local import LocalTier

    class AlwaysOn(LocalTier):
        @classmethod
        def resolve_enabled(cls, enabled, options, *, name=""):
            return True

    tier = AlwaysOn("on", make_tier("local", path=tmp_path / "on").options)
    with pytest.raises(AssertionError):
        TierContract().test_enabled_false_turns_the_kind_off(tier)


class TestSweptPluginTier(TierContract):
    """A plugin kind implementing gc's part of the interface itself: its paused write shows a temporary file."""

    @pytest.fixture
    def tier(self, tmp_path):
        from plugin_samples import SweptTier

        from tiered_ckpt.tiers.local import LocalOptions

        tier = SweptTier("swept", LocalOptions(path=str(tmp_path / "swept")))
        yield tier
        tier.close()

    def test_a_paused_write_is_a_temporary_file(self, tier):
        seen = {}

        def chunks():
            yield b"a"
            seen["temp"] = tier.temp_files()
            yield b"b"

        tier.write_blob("dir/blob", chunks())
        assert len(seen["temp"]) == 1 and seen["temp"][0].startswith("dir/.blob")
