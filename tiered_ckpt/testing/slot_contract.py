"""The contract suite's part about slots (``allocate_slot``, for tiers with ``capabilities.memory``) and
zero-copy reads (``capabilities.zero_copy_read``). :class:`~tiered_ckpt.testing.TierContract` includes it; the
``tier`` fixture, ``read`` and ``require`` come from it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import xxhash

from ..errors import TierError
from ..tiers.base import Tier, as_memoryview
from .interface_contract import MiB


def host_bytes(data: Any) -> bytes:
    """The bytes of a chunk or of a ``read_blob`` result (any device)."""
    return bytes(as_memoryview(data))


def _digest(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(as_memoryview(data))


class SlotContract:
    """The slot and zero-copy tests of :class:`~tiered_ckpt.testing.TierContract`."""

    # ----- zero-copy reads ----------------------------------------------------------------------------------
    def test_zero_copy_read_sees_writes_into_the_slot(self, tier: Tier) -> None:
        self.require(tier, "zero_copy_read", "reads are copies")
        self.require(tier, "memory", "no slots to write into behind the reader's back")
        slot = tier.allocate_slot("snap/zc", 3 * 4096 + 5)
        slot.fill_(1)
        view = tier.read_blob("snap/zc")
        slot.fill_(7)
        assert bool((view.cpu() == 7).all()), "read_blob returned a copy, not a view of the stored bytes"
        slot[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=slot.device)
        assert view[:4].cpu().tolist() == [1, 2, 3, 4]

    # ----- slots -------------------------------------------------------------------------------------------
    def test_non_memory_tiers_hold_no_slots(self, tier: Tier) -> None:
        if tier.capabilities.memory:
            pytest.skip(f"{tier.kind} tier: capabilities.memory is True (it holds slots; see the slot tests)")
        with pytest.raises(TierError):
            tier.allocate_slot("snap/0", 1024)

    def test_slot_write_then_read(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        slot = tier.allocate_slot("snap/0", 10_000)
        assert isinstance(slot, torch.Tensor) and slot.dtype == torch.uint8 and slot.dim() == 1
        assert slot.numel() >= 10_000
        pattern = torch.arange(10_000, dtype=torch.int64).remainder(251).to(torch.uint8)
        slot[:10_000] = pattern.to(slot.device)
        assert tier.exists("snap/0")
        assert tier.size("snap/0") == slot.numel()
        assert tier.list() == ["snap/0"]
        out = tier.read_blob("snap/0")
        assert host_bytes(out[:10_000]) == host_bytes(pattern)
        assert tier.read_range("snap/0", 100, 50) == host_bytes(pattern[100:150])

    def test_slot_reuse_keeps_the_buffer(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        first = tier.allocate_slot("snap/0", 64 * 1024)
        first[:3] = torch.tensor([9, 8, 7], dtype=torch.uint8, device=first.device)
        again = tier.allocate_slot("snap/0", 64 * 1024)
        smaller = tier.allocate_slot("snap/0", 100)
        assert again.data_ptr() == first.data_ptr() == smaller.data_ptr()
        assert again.numel() == smaller.numel() == first.numel()
        assert again[:3].cpu().tolist() == [9, 8, 7]

    def test_slot_growth_reallocates(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        tier.allocate_slot("snap/0", 4096)
        grown = tier.allocate_slot("snap/0", 3 * MiB + 1)
        assert grown.numel() >= 3 * MiB + 1
        grown.fill_(5)
        assert tier.size("snap/0") == grown.numel()
        assert _digest(tier.read_blob("snap/0").cpu()) == _digest(grown.cpu())
        assert tier.allocate_slot("snap/0", 3 * MiB).data_ptr() == grown.data_ptr()

    def test_slots_are_independent(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        s0 = tier.allocate_slot("snap/0", 8192)
        s1 = tier.allocate_slot("snap/1", 8192)
        s0.fill_(1)
        s1.fill_(2)
        assert bool((tier.read_blob("snap/0").cpu() == 1).all())
        assert bool((tier.read_blob("snap/1").cpu() == 2).all())
        assert tier.list("snap/") == ["snap/0", "snap/1"]

    def test_write_blob_over_a_slot(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        slot = tier.allocate_slot("snap/0", 8192)
        slot.fill_(3)
        tier.write_blob("snap/0", [b"replaced"])
        assert self.read(tier, "snap/0") == b"replaced"
        assert bool((slot.cpu() == 3).all()), "the detached buffer stays valid for whoever holds it"
        fresh = tier.allocate_slot("snap/0", 8192)
        assert fresh.numel() >= 8192
        fresh.fill_(4)
        assert bool((tier.read_blob("snap/0").cpu()[:8192] == 4).all())

    def test_delete_a_slot(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        tier.allocate_slot("snap/0", 8192).fill_(1)
        tier.delete("snap/0")
        assert not tier.exists("snap/0")
        assert tier.list() == []
        again = tier.allocate_slot("snap/0", 8192)
        again.fill_(2)
        assert bool((tier.read_blob("snap/0").cpu() == 2).all())
        tier.delete_prefix("snap")
        assert tier.list() == []

    def test_slot_size_must_not_be_negative(self, tier: Tier) -> None:
        self.require(tier, "memory", "holds no slots")
        with pytest.raises(ValueError):
            tier.allocate_slot("snap/0", -1)
