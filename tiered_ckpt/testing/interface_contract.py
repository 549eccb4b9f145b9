"""The contract suite's part about what the engine, ``gc`` and the CLI ask of a kind beyond the blob primitives
(tiers/base.py: ``resolve_enabled``, ``check_usable``, ``staging_options``, ``location``, ``missing_location``,
``temp_files``/``remove_temp_file``, ``unfinished_uploads``, ``modified``).
:class:`~tiered_ckpt.testing.TierContract` includes it; the ``tier`` fixture comes from the subclass.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..tiers.base import Tier, UnfinishedUpload, as_memoryview

MiB = 1 << 20


class InterfaceContract:
    @staticmethod
    def read(tier: Tier, key: str) -> bytes:
        return bytes(as_memoryview(tier.read_blob(key)))

    def test_enabled_false_turns_the_kind_off(self, tier: Tier) -> None:
        assert type(tier).resolve_enabled(False, tier.options, name=tier.name) is False

    @pytest.mark.parametrize("enabled", [True, "auto"])
    def test_a_usable_tier_is_on_with_true_and_auto(self, tier: Tier, enabled: Any) -> None:
        cls = type(tier)
        cls.check_usable(tier.options)  # the tier was built here, so its options are usable here
        assert cls.resolve_enabled(enabled, tier.options, name=tier.name) is True, \
            f"{cls.__name__}.resolve_enabled({enabled!r}, ...) must be True (a bool) where the tier can be built"

    def test_staging_options_give_a_private_memory_tier(self, tier: Tier) -> None:
        cls = type(tier)
        options = cls.staging_options()
        if options is None:
            pytest.skip(f"kind {cls.kind!r} does not stage saves (staging_options() is None)")
        caps = cls.capabilities_for(options)
        assert caps.memory and not caps.survives_process, \
            "a staging tier holds slots in this process's memory: capabilities memory=True, survives_process=False"
        staging = cls(f"{tier.name}-staging", options, tier.context)
        try:
            slot = staging.allocate_slot("snap/0", 8192)
            slot.fill_(7)
            assert set(self.read(staging, "snap/0")[:8192]) == {7}
        finally:
            staging.close()

    def test_location_is_a_name_and_exists_once_written(self, tier: Tier) -> None:
        tier.write_blob("probe", [b"x"])
        where = tier.location
        assert where is None or (isinstance(where, str) and where.strip() == where and where), \
            f"location must be None or a non-empty string a user can read, got {where!r}"
        assert tier.missing_location() is None, "the tier holds a blob, so its location exists"

    def test_temp_files_list_only_unfinished_writes(self, tier: Tier) -> None:
        seen: dict[str, Any] = {}

        def chunks():
            yield b"a" * MiB
            seen["temp"] = tier.temp_files()
            seen["listed"] = tier.list()
            yield b"b"

        tier.write_blob("dir/blob", chunks())
        temp = seen["temp"]
        assert isinstance(temp, list) and all(isinstance(k, str) for k in temp)
        assert not set(temp) & set(seen["listed"]), "temp_files() and list() never share a key"
        assert tier.temp_files() == [], "nothing temporary is left once the write finished"
        with pytest.raises(ValueError):
            tier.remove_temp_file("dir/blob")  # a finished blob is no temporary file: gc must never delete it
        assert self.read(tier, "dir/blob") == b"a" * MiB + b"b"

    def test_unfinished_uploads_are_only_those_of_writes_in_flight(self, tier: Tier) -> None:
        seen: dict[str, Any] = {}

        def chunks(fail: bool):
            for i in range(3):  # past one 5 MiB part (S3's smallest): an object store has an upload open by now
                yield bytes([i]) * (4 * MiB)
            seen["open"] = tier.unfinished_uploads()
            if fail:
                raise RuntimeError("the producer failed")

        tier.write_blob("dir/big", chunks(False))
        assert all(isinstance(u, UnfinishedUpload) and u.key == "dir/big" for u in seen["open"]), \
            f"unfinished_uploads() lists UnfinishedUpload entries, under the key being written: {seen['open']!r}"
        assert tier.unfinished_uploads() == [], "a finished write leaves no upload open"
        with pytest.raises(RuntimeError, match="the producer failed"):
            tier.write_blob("dir/failed", chunks(True))
        assert tier.unfinished_uploads() == [], "a write that failed leaves no upload open (it aborts its own)"

    def test_modified_is_a_time_or_unknown(self, tier: Tier) -> None:
        tier.write_blob("probe", [b"x"])
        when = tier.modified("probe")
        assert when is None or (isinstance(when, float) and when > 0), \
            f"modified() must be seconds since the epoch (a float) or None, got {when!r}"
        assert tier.modified("never/written") is None
