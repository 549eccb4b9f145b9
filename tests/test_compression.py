"""zstd per tier, with and without byte grouping: transparent on load, smaller on realistic optimizer state."""

from __future__ import annotations

import uuid

import pytest
import torch
import zstandard
from helpers import assert_same, make_items

from tiered_ckpt import CheckpointEngine
from tiered_ckpt.codecs import flat
from tiered_ckpt.codecs.byte_grouping import BLOCK, grouped_chunks, ungroup_


def _adam_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        loss = model(torch.randn(32, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"state": {"model": {k: v.bfloat16() for k, v in model.state_dict().items()},
                      "optimizer": opt.state_dict()}}


def test_grouping_is_a_permutation_within_blocks():
    t = torch.randn(BLOCK // 4 + 1000)  # more than one block
    items = {"a": t, "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(7).bfloat16()}
    plan = flat.plan_snapshot(items)
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    flat.copy_into(plan, buf)
    info = flat.decode_header(flat.encode_header(plan))
    grouped = torch.cat(list(grouped_chunks(info, buf)))
    assert grouped.numel() == buf.numel() and not torch.equal(grouped, buf)
    assert torch.equal(torch.sort(grouped).values, torch.sort(buf).values)
    ungroup_(info, grouped)
    assert torch.equal(grouped, buf)


def _tier(tmp_path, name, **compression):
    return {"name": name, "kind": "local", "path": str(tmp_path / name), "compression": compression}


def test_zstd_with_and_without_grouping(tmp_path, shm_root):
    state = _adam_state()
    cfg = {"run_id": f"z{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [
        {"name": "shm", "kind": "shm", "path": str(shm_root)},
        _tier(tmp_path, "plain", codec="zstd", level=3),
        _tier(tmp_path, "grouped", codec="zstd", level=3, byte_grouping=True),
    ]}
    with CheckpointEngine(cfg) as engine:
        engine.save(1, state).wait(timeout=60)
        sizes = {}
        for name in ("plain", "grouped"):
            (entry,) = engine.pipeline.stores[name].read_manifest(1).files
            sizes[name] = entry.size
            assert entry.meta.get("byte_grouping", False) == (name == "grouped")
            assert_same(state, engine._load_from(name, 1, True, None)[0])
        assert sizes["grouped"] < sizes["plain"]


def test_grouped_bytes_are_ungrouped_for_an_uncompressed_tier(tmp_path, shm_root):
    cfg = {"run_id": f"z{uuid.uuid4().hex[:8]}", "drain": {"mode": "thread"}, "tiers": [
        {"name": "shm", "kind": "shm", "path": str(shm_root)},
        _tier(tmp_path, "grouped", codec="zstd", byte_grouping=True),
        {"name": "raw", "kind": "local", "path": str(tmp_path / "raw")},
    ]}
    items = make_items(4)
    with CheckpointEngine(cfg) as engine:
        engine.save(1, items).wait(timeout=60)
        (grouped,) = engine.pipeline.stores["grouped"].read_manifest(1).files
        (entry,) = engine.pipeline.stores["raw"].read_manifest(1).files
        assert entry.compression is None and "byte_grouping" not in entry.meta
        assert entry.size == grouped.raw_size
        assert_same(items, engine._load_from("raw", 1, True, None)[0])


def test_a_raw_size_the_machine_cannot_allocate_is_a_corruption_error():
    # Within the manifest check's bound for zstd (32768x the stored size) but not allocatable: the load must fall
    # back to the next tier, so this is a CorruptionError naming the file, never torch's RuntimeError.
    from tiered_ckpt.compression import decompress_to_tensor
    from tiered_ckpt.errors import CorruptionError

    blob = torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(b"x" * 100)), dtype=torch.uint8)
    with pytest.raises(CorruptionError, match="state.flat.*raw_size of 1125899906842624 bytes"):
        decompress_to_tensor(blob, 1 << 50, where="iter_0000001/rank_00000/state.flat", tier="local")
